"""The colocated engine's memory decision of issue 34 (fault 2) on a real GPU, without vLLM (it cannot be carried).

    OUT=... python tests/gpu/check_engine_memory.py [--rehearse]

A trainer loads the ~1B-shaped random Llama of gpu_common in bf16 at TP1 with ``policy`` and ``critic`` LoRA r 16
and their AdamW states (one update made them), as a colocated run has when its engines start. Then
:func:`mlora.plan.engines.size_engine` decides the engine's share from the measured free memory and the planner's
resident bytes of the trainer (what ``Rollouts`` does), for a 2,048-token context and 256 sequences.

``engine_start_rule``: vLLM's start-up check (vllm/v1/worker/utils.py ``request_memory``: free >= share x total)
holds for mlora's share and fails for vLLM's default 0.92 beside the trainer (figures: both shares, free GiB).
``engine_generate_fits``: the engine simulated by allocating its weights + KV cache + workspace (what vLLM would
take) beside the trainer: the allocation succeeds and leaves free memory (figure: GiB left, goal >= 0).
``engine_wakes_after_update``: the engine "sleeps" (its allocation freed), the trainer runs one PPO update, the
trainer's cached blocks are released (``release_cached_memory``), and the engine "wakes" (the same allocation
again): it succeeds (the failure mode of waking after the trainer grew).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import finish, llama_1b, start  # noqa: E402

REPORT = "engine_memory"
CHECKS = ("engine_start_rule", "engine_generate_fits", "engine_wakes_after_update")
GIB = 1 << 30


def main() -> None:
    report, device = start(REPORT, CHECKS)
    cuda = device.type == "cuda"
    import mlora
    from mlora.formats.hf_config import load_hf_config, model_spec
    from mlora.plan import Layout, Workload, plan_memory
    from mlora.plan.engines import DeviceMemory, size_engine
    from mlora.testing.memory_probe import ProbeConfig, synthetic_batch
    from mlora.train.config import PPOConfig
    from mlora.train.engine import ActorCriticEngine

    model_dir = llama_1b(device)
    spec = model_spec(load_hf_config(model_dir))
    mesh = mlora.init_parallel(tp=1, pp=1)
    model = mlora.from_pretrained(model_dir, mesh, dtype=torch.bfloat16)
    probe = ProbeConfig(name="engine memory", model=str(model_dir), seq=1024, micro_batch=2, micro_batches=2, rank=16,
                        critic=True, extra={"dtype": "bfloat16"})
    ppo = PPOConfig(advantage_estimator="gae", mini_batch_size=4, micro_train_batch_size=2, micro_forward_batch_size=2)
    engine = ActorCriticEngine(model, ppo, policy_lora=mlora.LoraConfig(rank=16, alpha=32),
                               critic_lora=mlora.LoraConfig(rank=16, alpha=32, seed=1))
    engine.step(synthetic_batch(probe, spec.vocab_size, 1, 16, seed=1))  # the AdamW states exist from here on
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = (int(x) for x in torch.cuda.mem_get_info())
    else:  # rehearsal: an 80 GiB GPU holding the trainer's parameters, to run the decision's code
        total = 80 * GIB
        free = total - sum(p.numel() * p.element_size() for p in model.gpt.parameters())
    workload = Workload(micro_batch=2, seq=1024, rank=16, critic=True, dtype=torch.bfloat16)
    resident = max(r.base + r.adapters + r.heads + r.optimizer for r in plan_memory(spec, Layout(), workload).ranks)
    sizing = size_engine(spec, DeviceMemory(total=total, free=free, cuda=True), tp=1, dtype=torch.bfloat16,
                         lora_rank=16, max_model_len=2048, sequences=256, trainer_bytes=resident)
    share = sizing.gpu_memory_utilization
    print(sizing.line(), flush=True)
    try:
        report.record("engine_start_rule", {"mlora_share": share, "free_gib": free / GIB, "total_gib": total / GIB},
                      passed=free >= share * total,
                      note=f"vLLM's default 0.92 would {'start' if free >= 0.92 * total else 'refuse'}")
    except Exception as exc:  # noqa: BLE001  (each check is reported, the next one runs)
        report.error("engine_start_rule", exc)
    engine_bytes = sizing.weights + sizing.kv_cache_memory_bytes + sizing.workspace
    if not cuda:
        for check in CHECKS[1:]:
            report.skip(check, "rehearsal on the CPU: this check allocates GPU memory")
        finish(report)
    try:
        held = torch.empty(engine_bytes, dtype=torch.uint8, device=device)
        left = torch.cuda.mem_get_info()[0]
        report.record("engine_generate_fits", left / GIB, passed=True,
                      note=f"GiB free with the engine's {engine_bytes / GIB:.1f} GiB beside the trainer")
        del held
    except Exception as exc:  # noqa: BLE001
        report.error("engine_generate_fits", exc)
    try:
        torch.cuda.empty_cache()  # asleep: vLLM's sleep frees its KV cache and moves its weights to the host
        engine.step(synthetic_batch(probe, spec.vocab_size, 1, 1024, seed=2))
        torch.cuda.synchronize()
        from mlora.train.rollouts import release_cached_memory

        release_cached_memory()
        held = torch.empty(engine_bytes, dtype=torch.uint8, device=device)
        report.record("engine_wakes_after_update", torch.cuda.mem_get_info()[0] / GIB, passed=True,
                      note="GiB free after waking beside the trainer")
        del held
    except Exception as exc:  # noqa: BLE001
        report.error("engine_wakes_after_update", exc)
    finish(report)


if __name__ == "__main__":
    main()
