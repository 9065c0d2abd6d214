"""SkyRL-Gym environments on mlora, through the real ``skyrl_gym`` package: a user-style environment (tool
groups, numpy results, ``postprocessed_action``, per-episode metrics and their aggregation, attribute-read
``env_config``) run by entry point and by id with ``register(..., kwargs)``, environment failures stopping the
run with a report or (tolerated) counted and logged, and SkyRL's shipped ``gsm8k`` envs next to mlora's."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import numpy as np
import pytest
import skyrl_gym
from omegaconf import DictConfig
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.tools.core import ToolGroup, tool

from mlora.rollout.data import Prompt, prompt_ids
from mlora.rollout.envs import LastNumberEnv, env_class, is_multi_turn
from mlora.rollout.generator import Generation, SamplingConfig
from mlora.rollout.gym import check_step_output, make_text_env
from mlora.rollout.multi_turn import EnvironmentFailure, TurnFormat, episode_metrics, run_episodes
from mlora.train.rollouts import Rollouts

pytestmark = pytest.mark.quick

ENTRY = f"{__name__}:ArithmeticToolEnv"


class MathTools(ToolGroup):
    """SkyRL's tool-group pattern (skyrl_gym/tools/sql.py): methods marked ``@tool``."""

    def __init__(self):
        super().__init__(name="MathTools")

    @tool
    def add(self, a: str, b: str) -> str:
        return str(int(a) + int(b))


class ArithmeticToolEnv(BaseTextEnv):
    """As a SkyRL user writes one: ``<add>a,b</add>`` calls the tool; ``<marker> N`` answers. Rewards, done
    and metrics come back as numpy scalars; the answer turn is rewritten to just the answer
    (``postprocessed_action``); ``env_config.bonus`` is read by attribute."""

    def __init__(self, env_config=None, extras=None, marker: str = "####"):
        super().__init__()
        self.truth = int(extras["reward_spec"]["ground_truth"])
        self.bonus = float(env_config.bonus)  # SkyRL's envs read attributes (env_config.db_path)
        self.max_turns = extras.get("max_turns", 3)
        self.marker, self.calls, self.solved = marker, 0, False
        self.init_tool_groups([MathTools()])

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        call = re.search(r"<add>(\d+),(\d+)</add>", action)
        if call:
            self.calls += 1
            result = self._execute_tool("MathTools", "add", [call.group(1), call.group(2)])
            return BaseTextEnvStepOutput(observations=[{"role": "user", "content": f"<result>{result}</result>"}],
                                         reward=np.float32(0.0), done=np.bool_(self.turns >= self.max_turns),
                                         metadata={})
        answer = re.search(re.escape(self.marker) + r"\s*(-?\d+)", action)
        self.solved = bool(answer) and int(answer.group(1)) == self.truth
        return BaseTextEnvStepOutput(observations=[], reward=np.float32(float(self.solved) + self.bonus),
                                     done=np.bool_(True), metadata={},
                                     postprocessed_action=answer.group(0) if answer else None)

    def get_metrics(self):
        return {"tool_calls": np.int64(self.calls), "solved": np.bool_(self.solved), "note": "dropped"}

    @staticmethod
    def aggregate_metrics(metrics):
        return {"tool_calls_max": max(m["tool_calls"] for m in metrics),
                "solve_rate": sum(m["solved"] for m in metrics) / len(metrics)}


class FlakyEnv(BaseTextEnv):
    """Raises on the step of a prompt whose reward_spec says so (a tool server that is down)."""

    def __init__(self, env_config=None, extras=None):
        super().__init__()
        self.broken = extras["reward_spec"].get("broken", False)

    def step(self, action):
        if self.broken:
            raise ConnectionError("retriever at http://localhost:8000 refused the connection")
        return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})


skyrl_gym.register(id="t_arith_kw", entry_point=ENTRY, kwargs={"marker": "ANSWER:"})
skyrl_gym.register(id="t_flaky", entry_point=FlakyEnv)


class PerTrajectoryEngine:
    """Scripted engines: trajectory ``i`` of the batch answers ``scripts[i][turn]`` (its end-of-turn token
    appended), log-prob -0.5 per token."""

    def __init__(self, tokenizer, scripts: list[list[str]]):
        self.tok, self.scripts, self.turn = tokenizer, scripts, 0

    def __call__(self, sequences, sampling: SamplingConfig) -> list[Generation]:
        out, active = [], [s for s in self.scripts if len(s) > self.turn]
        for i, script in enumerate(active[:len(sequences)]):
            ids = self.tok(script[self.turn], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(Generation(i, ids, [-0.5] * len(ids), script[self.turn], "stop"))
        self.turn += 1
        return out


@pytest.fixture(scope="module")
def tok(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


def _run(tok, rows: list[dict], scripts: list[list[str]], settings: dict | None = None, max_turns: int = 3):
    """mlora's episodes as its trainer runs them (mlora/train/rollouts.py ``_episodes``)."""
    prompts = [Prompt(r, prompt_ids(r, tok), r["env_class"]) for r in rows]

    def make(p):
        return make_text_env(p.env_class, (settings or {}).get(p.env_class), {**p.row, "max_turns": max_turns})

    def ids_of(p, conversation):
        return prompt_ids({**p.row, "prompt": conversation}, tok)

    gens = run_episodes(PerTrajectoryEngine(tok, scripts), prompts, SamplingConfig(n_samples_per_prompt=1, seed=0),
                        make, TurnFormat(tok), max_turns, 4096, ids_of)
    return prompts, gens


def _row(env: str, truth, **spec) -> dict:
    return {"prompt": [{"role": "user", "content": "What is 3 + 4?"}], "env_class": env,
            "reward_spec": {"ground_truth": truth, **spec}}


def test_user_environment_by_entry_point(tok):
    """Tool call through the tool group, numpy results, the rewritten answer turn, attribute env_config, and the
    class's own metric aggregation (SkyRL's environment/<key>)."""
    assert is_multi_turn(ENTRY) and env_class(ENTRY) is ArithmeticToolEnv
    settings = {ENTRY: {"bonus": 0.5}}
    rows = [_row(ENTRY, 7), _row(ENTRY, 7)]
    _, gens = _run(tok, rows, [["<add>3,4</add>", "#### 7 because the tool said so"], ["#### 8"]], settings)
    solved, wrong = gens
    assert solved.extra["end_reason"] == "done" and solved.extra["turn_rewards"] == [0.0, 1.5]
    assert all(type(r) is float for r in solved.extra["turn_rewards"])
    assert wrong.extra["turn_rewards"] == [0.5] and wrong.extra["turns"] == 1
    assert "<result>7</result>" in solved.text
    # postprocessed_action: the model's last turn is what the environment rewrote, still the model's tokens;
    # past the common prefix there is no engine log-prob
    last = [t for t, m in zip(solved.token_ids, solved.extra["model_mask"]) if m]
    assert tok.decode(last).endswith("<|im_end|>#### 7<|im_end|>") and "because" not in solved.text
    kept = len(tok("#### 7", add_special_tokens=False)["input_ids"])  # a prefix of what the engine sampled
    assert len(solved.logprobs) == len(solved.token_ids)
    assert solved.logprobs[-kept - 1:] == [-0.5] * kept + [0.0]  # the end-of-turn token moved: no engine log-prob
    assert solved.extra["turn_ends"][-1] == len(solved.token_ids) - 1
    assert solved.extra["env_metrics"] == {"tool_calls": 1, "solved": True, "note": "dropped"}
    assert episode_metrics(gens) == {"environment/tool_calls_max": 1.0, "environment/solve_rate": 0.5}


def test_registered_id_with_kwargs_and_dictconfig(tok):
    """register(id, entry_point, kwargs): the kwargs reach the constructor; env_config is an OmegaConf
    DictConfig as SkyRL's generator passes it."""
    env = make_text_env("t_arith_kw", {"bonus": 0.0}, _row("t_arith_kw", 7))
    assert isinstance(env, ArithmeticToolEnv) and env.marker == "ANSWER:" and env.spec.id == "t_arith_kw"
    assert env.tool_to_toolgroup == {"add": "MathTools"}
    _, (gen,) = _run(tok, [_row("t_arith_kw", 7)], [["ANSWER: 7"]], {"t_arith_kw": {"bonus": 0.0}})
    assert gen.extra["turn_rewards"] == [1.0]
    seen = {}

    class Probe(ArithmeticToolEnv):
        def __init__(self, env_config=None, extras=None):
            seen["config"] = env_config
            super().__init__(env_config, extras)

    skyrl_gym.register(id="t_probe", entry_point=Probe)
    make_text_env("t_probe", {"bonus": 1.0, "db": {"path": "/x"}}, _row("t_probe", 7))
    assert isinstance(seen["config"], DictConfig) and seen["config"].db.path == "/x"


def test_step_output_checks():
    step = check_step_output({"observations": [], "reward": np.float32(0.25), "done": np.bool_(True)})
    assert step.reward == 0.25 and type(step.reward) is float and step.done is True and type(step.done) is bool
    # an integer done, as SkyRL reads it (a truth value)
    assert check_step_output({"observations": [], "reward": 1.0, "done": 1}).done is True
    assert check_step_output({"observations": [], "reward": 1.0, "done": np.int64(0)}).done is False
    for bad, message in (({"observations": [], "reward": float("nan"), "done": True}, "finite number"),
                         ({"observations": [], "reward": 1.0, "done": 2}, "done must be a bool"),
                         ({"observations": [], "reward": 1.0, "done": True, "postprocessed_action": 3},
                          "postprocessed_action must be a str")):
        with pytest.raises(ValueError, match=message):
            check_step_output(bad)
    with pytest.raises(ValueError, match="'collections:OrderedDict' is .*not a subclass of skyrl_gym"):
        env_class("collections:OrderedDict")
    with pytest.raises(ValueError, match="unknown env_class 'nope'; registered: .*calculator.*text2sql.*entry point"):
        env_class("nope")


def _rollouts(ratio: float) -> Rollouts:
    r = Rollouts.__new__(Rollouts)  # only what _turn_metrics reads: the config and the rank
    r.cfg = SimpleNamespace(environment=SimpleNamespace(max_env_error_ratio=ratio))
    r.mesh = SimpleNamespace(rank=0)
    return r


def test_environment_failure_stops_the_run_with_a_report(tok, caplog):
    """One of four environments raises: with the default environment.max_env_error_ratio=0 the trainer's
    rollout metrics stop the run with the env id, the trajectory and the traceback; at 0.25 the failure is
    counted and logged, and the trajectory scores 0."""
    rows = [_row("t_flaky", 1, broken=i == 2) for i in range(4)]
    prompts, gens = _run(tok, rows, [["my answer is 1"]] * 4)
    assert [g.extra["turn_rewards"] for g in gens] == [[1.0], [1.0], [0.0], [1.0]]
    with pytest.raises(EnvironmentFailure) as err:
        Rollouts._turn_metrics(_rollouts(0.0), gens)
    report = str(err.value)
    assert "1 of 4 trajectories ended by an environment fault" in report
    assert "environment 't_flaky' failed at turn 1" in report and "my answer is 1" in report
    assert "Traceback" in report and 'raise ConnectionError("retriever' in report and "refused the connection" in report
    with caplog.at_level(logging.WARNING, logger="mlora"):
        metrics = Rollouts._turn_metrics(_rollouts(0.25), gens)
    assert metrics["multi_turn/ended_env_error"] == 1.0 and metrics["multi_turn/env_failure_ratio"] == 0.25
    assert "training: 1 of 4 trajectories ended by an environment fault" in caplog.text and "ConnectionError" in caplog.text
    # evaluation episodes are checked alike (a failing environment would otherwise score 0 unseen)
    strict = _rollouts(0.0)
    with pytest.raises(EnvironmentFailure, match="environment 't_flaky' failed at turn 1"):
        Rollouts._env_failures(strict, gens, strict.cfg, "evaluation")


def test_gsm8k_is_skyrl_gym_gsm8k(tok):
    """The id ``gsm8k`` is SkyRL's shipped GSM8kEnv (strict ``#### N``), a one-turn episode; mlora's lenient
    last-number reward is ``arithmetic``; ``gsm8k_multi_turn`` runs by its id with its own metric aggregation."""
    assert is_multi_turn("gsm8k") and env_class("gsm8k").__module__ == "skyrl_gym.envs.gsm8k.env"
    assert env_class("arithmetic") is LastNumberEnv and not is_multi_turn("arithmetic")
    _, gens = _run(tok, [_row("gsm8k", "7")] * 3, [["The answer is 7"], ["#### 7"], ["#### 8"]], max_turns=1)
    assert [g.extra["turn_rewards"] for g in gens] == [[0.0], [1.0], [0.0]]
    assert all(g.extra["end_reason"] == "done" for g in gens)
    _, gens = _run(tok, [_row("gsm8k_multi_turn", "7")] * 2, [["#### 5", "#### 7"], ["#### 7"]])
    assert [len(g.extra["turn_rewards"]) for g in gens] == [2, 1] and gens[0].extra["turn_rewards"][1] == 1.0
    assert episode_metrics(gens) == {"environment/avg_steps": 1.5}


def test_mlora_text_envs_are_skyrl_gym_envs():
    """calculator and guess_number are in skyrl_gym's registry; the calculator's tool is a SkyRL tool group."""
    assert skyrl_gym.registry["calculator"].entry_point == "mlora.rollout.tool_envs:CalculatorEnv"
    env = skyrl_gym.make("calculator", env_config=DictConfig({"max_turns": 2}),
                         extras={"reward_spec": {"ground_truth": "133", "expression": "47 + 86"}})
    assert env.max_turns == 2 and env.tool_to_toolgroup == {"calculate": "CalculatorToolGroup"}
    assert env.step("<tool>47 + 86</tool>")["observations"] == [{"role": "user", "content": "<result>133</result>"}]
    assert env.step("#### 133")["reward"] == 1.0 and env.get_metrics() == {"tool_calls": 1, "turns": 2}
    assert is_multi_turn("guess_number")
