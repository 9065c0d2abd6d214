"""SkyRL's shipped text environments (the real ``skyrl_gym`` package) playing whole episodes through mlora's
multi-turn rollouts (``run_episodes``, environments made by ``make_text_env`` as the trainer makes them), a
scripted engine in place of the model: each environment's tool really runs (SQLite for ``text2sql``, an HTTP
retriever on 127.0.0.1 for ``search``/``searchcode``, a ``python`` subprocess for ``searchcode``, LiveCodeBench's
test runner for ``lcb``), its result reaches the model's next prompt as environment tokens, and the episode
scores the environment's own reward for right and wrong answers. Rows go through a parquet file and mlora's
loader first, as a training run reads them."""

from __future__ import annotations

import json

import pytest
import requests
from skyrl_env_assets import (
    DOCUMENTS,
    ENV_IDS,
    SEARCHCODE_PORT,
    SEARCHCODE_SEARCH_TURN,
    SINGERS,
    SQL_GOLD,
    SQL_OLDER_THAN_40,
    RetrievalServer,
    build_spider_db,
    env_rows,
    env_settings,
    scripted_turns,
    write_prompt_parquet,
)

from mlora.rollout.data import Prompt, load_prompts, prompt_ids
from mlora.rollout.envs import is_multi_turn
from mlora.rollout.generator import Generation, SamplingConfig
from mlora.rollout.gym import make_text_env, text_env_class
from mlora.rollout.multi_turn import TurnFormat, episode_metrics, run_episodes

pytestmark = pytest.mark.quick

MAX_TURNS = 4  # generator.max_turns: room for every environment's tool call and answer

# data_source: (turn rewards of the scripted episode, texts the environment's tokens must contain)
EXPECTED = {
    "openai/gsm8k": ([1.0], []),
    "gsm8k_multi_turn": ([0.2 / MAX_TURNS, 1.0], ["exact format: '#### ANSWER'"]),
    "aime": ([1.0], []),
    "spider": ([0.0, 1.0], ["<observation>", *SQL_OLDER_THAN_40, "52", "41",
                            f"You have {MAX_TURNS - 1} turns left"]),
    "lcb_stdin": ([1.0], []),
    "lcb_functional": ([1.0], []),
    "searchR1_nq": ([0.0, 1.0], ["<information>", f"Doc 1: {DOCUMENTS[0]['contents']}"]),
    "searchcode": ([0.0, 1.0], ["product=42"]),
}


class ScriptedEngine:
    """Stand-in for the engines: the trajectory whose prompt a sequence starts with answers its script's next
    turn (the end-of-turn token appended, log-prob -0.5 per token). A turn past the script fails the test."""

    def __init__(self, tokenizer, prompts: list[Prompt], scripts: list[list[str]]) -> None:
        self.tok, self.prompts, self.scripts = tokenizer, prompts, scripts
        self.turn = [0] * len(prompts)

    def _owner(self, sequence: list[int]) -> int:
        owners = [i for i, p in enumerate(self.prompts) if sequence[:len(p.token_ids)] == p.token_ids]
        assert len(owners) == 1, f"{len(owners)} prompts start this sequence"
        return owners[0]

    def __call__(self, sequences: list[list[int]], sampling: SamplingConfig) -> list[Generation]:
        out = []
        for k, sequence in enumerate(sequences):
            i = self._owner(list(sequence))
            script, turn = self.scripts[i], self.turn[i]
            assert turn < len(script), f"{self.prompts[i].row['data_source']}: the episode wants turn {turn + 1} " \
                                       f"of a {len(script)}-turn script"
            ids = self.tok(script[turn], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(Generation(k, ids, [-0.5] * len(ids), script[turn], "stop"))
            self.turn[i] += 1
        return out


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


@pytest.fixture(scope="module")
def spider(tmp_path_factory):
    return build_spider_db(tmp_path_factory.mktemp("sql_data"))


@pytest.fixture(scope="module")
def server():
    with RetrievalServer() as s:
        yield s


@pytest.fixture(scope="module")
def settings(spider, server) -> dict:
    return env_settings(spider.db_path, server.url)


@pytest.fixture(scope="module")
def rows(tmp_path_factory, spider) -> dict[str, dict]:
    """The rows as the trainer reads them: written to parquet, loaded by mlora's loader; by data_source."""
    path = write_prompt_parquet(env_rows(db_id=spider.db_id), tmp_path_factory.mktemp("data") / "train.parquet")
    return {row["data_source"]: row for row in load_prompts(path)}


def _play(tok, rows: list[dict], scripts: list[list[str]], settings: dict, conversation: bool = True,
          workers: int = 1) -> list[Generation]:
    """Episodes as mlora/train/rollouts.py ``_episodes`` runs them: one environment per trajectory, made from
    the row + max_turns and the environment's ``environment.skyrl_gym.<id>`` settings."""
    prompts = [Prompt(r, prompt_ids(r, tok), r["env_class"]) for r in rows]

    def make(p: Prompt):
        return make_text_env(p.env_class, settings.get(p.env_class), {**p.row, "max_turns": MAX_TURNS})

    def ids_of(p: Prompt, conversation_: list) -> list[int]:
        return prompt_ids({**p.row, "prompt": conversation_}, tok)

    engine = ScriptedEngine(tok, prompts, scripts)
    gens = run_episodes(engine, prompts, SamplingConfig(n_samples_per_prompt=1, seed=0), make,
                        TurnFormat(tok, conversation), MAX_TURNS, 8192, ids_of, workers)
    for g, script, used in zip(gens, scripts, engine.turn):
        assert used == len(script), f"{g.extra['env_class']} ended after {used} of {len(script)} scripted turns " \
                                    f"({g.extra['end_reason']})"
    return gens


def _env_text(tok, gen: Generation) -> str:
    """What the environment appended between the model's turns (the tokens out of the loss)."""
    return tok.decode([t for t, m in zip(gen.token_ids, gen.extra["model_mask"]) if not m])


def test_rows_load_and_route_to_skyrl_gym_envs(rows):
    """SkyRL-schema rows survive parquet and mlora's loader; every id, ``gsm8k`` included, is skyrl_gym's own
    class, and the trainer runs its rows as episodes."""
    assert sorted({r["env_class"] for r in rows.values()}) == sorted(ENV_IDS)
    for env_id in ENV_IDS:
        cls = text_env_class(env_id)
        assert cls.__module__.startswith("skyrl_gym.envs."), (env_id, cls)
        assert is_multi_turn(env_id), env_id
    assert text_env_class("gsm8k").__name__ == "GSM8kEnv"
    assert rows["searchR1_nq"]["reward_spec"] == {"method": "rule", "ground_truth": {"target": ["Paris"]}}
    assert rows["aime"]["reward_model"]["ground_truth"] == "24"
    assert rows["spider"]["db_id"] == "concert_singer" and rows["spider"]["data"] == "spider"
    assert json.loads(rows["lcb_functional"]["reward_spec"]["ground_truth"])[0]["metadata"]["func_name"] == "twoSum"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_episode_with_the_environments_tool(tok, rows, settings, server, name):
    """One scripted episode per environment: it ends because the environment says done, with the
    environment's reward for a right answer, and the tool's real result in the tokens the model reads next."""
    seen = len(server.requests)
    (gen,) = _play(tok, [rows[name]], [scripted_turns(name)], settings)
    rewards, texts = EXPECTED[name]
    assert gen.extra["end_reason"] == "done" and "failure" not in gen.extra
    assert gen.extra["turn_rewards"] == rewards
    env = _env_text(tok, gen)
    for text in texts:
        assert text in env, (text, env)
    if len(rewards) == 1:  # single-turn environments answer nothing back
        assert env == "" and all(gen.extra["model_mask"])
    if name == "spider":  # the rows the SQL selected, and only those
        assert not any(n in env for _, n, _, age in SINGERS if age <= 40)
    if name == "searchR1_nq":  # skyrl_gym 0.4's request, one per <search>
        assert server.requests[seen:] == [{"query": "capital of France", "topk": 3, "return_scores": True}]
    if name == "searchcode":  # the program's output, not the program
        assert "print(" not in env


def test_mixed_batch_in_worker_threads(tok, rows, settings):
    """Every environment in one batch, their steps in a thread pool (``environment.skyrl_gym.max_env_workers``),
    as a training step runs them; SkyRL's metric aggregation of gsm8k_multi_turn."""
    names = list(EXPECTED)
    gens = _play(tok, [rows[n] for n in names], [scripted_turns(n) for n in names], settings, workers=4)
    assert {n: g.extra["turn_rewards"] for n, g in zip(names, gens)} == {n: EXPECTED[n][0] for n in names}
    assert all(g.extra["end_reason"] == "done" for g in gens)
    assert episode_metrics(gens) == {"environment/avg_steps": 2.0}


def test_text2sql_with_plain_text_turns(tok, rows, settings):
    """SkyRL's text2sql example runs with ``use_conversation_multi_turn=false``: the observation is appended as
    its text, no chat-template message around it."""
    (gen,) = _play(tok, [rows["spider"]], [scripted_turns("spider")], settings, conversation=False)
    assert gen.extra["turn_rewards"] == [0.0, 1.0]
    env = _env_text(tok, gen)
    assert env.startswith("\n\n<observation>") and env.rstrip("\n").endswith("</reminder></observation>")
    assert "<|im_start|>" not in env and all(n in env for n in SQL_OLDER_THAN_40)


# data_source, the model's turns, the environment's turn rewards
LOWER = [
    ("openai/gsm8k", ["The answer is 72."], [0.0]),  # strict: only "#### N" counts
    ("openai/gsm8k", ["####72"], [0.0]),  # ... with exactly one space
    ("openai/gsm8k", ["#### 70"], [0.0]),
    ("gsm8k_multi_turn", ["#### 13"] * MAX_TURNS, [0.2 / MAX_TURNS] * MAX_TURNS),  # format score each turn
    ("aime", ["Answer: 25"], [-1.0]),  # a wrong answer is -1, not 0
    ("aime", ["\\boxed{24}"], [-1.0]),  # read from "Answer: ...", a bare \boxed is not
    ("spider", [f"<solution>{SQL_GOLD}</solution>"], [-1.0]),  # the right SQL, but no <think>
    ("spider", ["<think>All of them.</think><solution>SELECT name FROM singer</solution>"], [0.0]),
    ("lcb_stdin", ["```python\na, b = map(int, input().split())\nprint(a - b)\n```"], [0.0]),
    ("lcb_stdin", ["print(sum(map(int, input().split())))"], [0.0]),  # no code block
    ("searchR1_nq", ["<answer>Lyon</answer>"], [0.0]),
    ("searchcode", ["<solution>42</solution>"], [0.0]),  # scored as strict gsm8k
]


@pytest.mark.parametrize("name,turns,rewards", LOWER, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(LOWER)])
def test_wrong_answers_score_the_environments_lower_reward(tok, rows, settings, name, turns, rewards):
    (gen,) = _play(tok, [rows[name]], [turns], settings)
    assert gen.extra["turn_rewards"] == rewards and gen.extra["end_reason"] == "done"


def test_searchcode_search_is_pinned_to_port_8000(tok, rows, settings):
    """SearchCodeEnv builds ``SearchToolGroup()`` with its defaults and never reads env_config: its search goes
    to http://127.0.0.1:8000/retrieve whatever ``environment.skyrl_gym.searchcode.search_url`` says."""
    pinned = RetrievalServer(port=SEARCHCODE_PORT)
    try:
        pinned.start()
    except OSError as exc:
        pytest.skip(f"127.0.0.1:{SEARCHCODE_PORT}, where searchcode's search is pinned, is taken: {exc}")
    try:
        with RetrievalServer() as configured:
            ignored = {**settings, "searchcode": {"search_url": configured.url, "topk": 1}}
            script = [SEARCHCODE_SEARCH_TURN, *scripted_turns("searchcode")]
            (gen,) = _play(tok, [rows["searchcode"]], [script], ignored)
            assert configured.requests == []
        assert pinned.requests == [{"query": "six times seven", "topk": 3, "return_scores": True}]
    finally:
        pinned.stop()
    assert gen.extra["turn_rewards"] == [0.0, 0.0, 1.0]
    env = _env_text(tok, gen)
    assert DOCUMENTS[2]["contents"] in env and "product=42" in env


def test_retrieval_server_protocol(server):
    """The stand-in answers as SkyRL's example retriever: batched ``queries`` too, documents without scores
    when not asked for them, 404 elsewhere, 422 for a body it cannot read."""
    reply = requests.post(server.url, json={"queries": ["Berlin Germany", "Seine"], "topk": 2}, timeout=10)
    assert reply.status_code == 200
    first, second = reply.json()["result"]
    assert [d["id"] for d in first] == ["1", "0"] and first[0] == DOCUMENTS[1]
    assert [d["id"] for d in second] == ["0", "3"]
    scored = requests.post(server.url, json={"query": "Paris", "topk": 1, "return_scores": True}, timeout=10).json()
    assert scored == {"result": [[{"document": DOCUMENTS[0], "score": 1.0}]]}
    assert requests.post(server.url.replace("/retrieve", "/search"), json={}, timeout=10).status_code == 404
    assert requests.post(server.url, json={"topk": 1}, timeout=10).status_code == 422


def test_typed_settings_have_skyrl_defaults():
    """``search`` and ``text2sql`` settings over SkyRL's defaults (its trainer config types them), as their
    environments read every key by attribute."""
    from mlora.rollout.gym import env_config

    search = env_config({"search_url": "http://127.0.0.1:9/retrieve"}, "search")
    assert (search.search_url, search.topk, search.timeout, search.log_requests) == (
        "http://127.0.0.1:9/retrieve", 3, 30, False)
    assert env_config({}, "text2sql").db_path == "/home/ray/default/sql_data"
    with pytest.raises(ValueError, match="environment.skyrl_gym.text2sql.db: not a setting of 'text2sql'; valid: db_path"):
        env_config({"db": "/x"}, "text2sql")
    assert dict(env_config({"anything": 1}, "gsm8k")) == {"anything": 1}  # untyped: passed as given
