"""The memory planner's predicted peak of one PPO step vs ``torch.cuda.max_memory_allocated`` on the GPU.

    OUT=... python tests/gpu/check_plan_gpu.py [--rehearse]

``ppo_step_peak_vs_plan``: the ~1B-shaped random Llama of gpu_common in bf16 at TP1, an
:class:`mlora.train.engine.ActorCriticEngine` with GAE (``policy`` and ``critic`` LoRA r 16 on all linears, value
head, two AdamW), micro-batches of 2 sequences of 1024 tokens, 2 micro-batches per update (the grid of
bench/memory_plan.py, on CUDA). As mlora.testing.memory_probe does on the CPU: a first step on 16-token sequences
creates the optimizer states (the planner predicts the steady state), then the peak counter is reset and one step
runs on the real batch; the counter is read and reset at each phase boundary (forward-only passes, actor update,
critic update). Measured = the largest phase peak minus what was allocated before the model was loaded;
predicted = :func:`mlora.plan.plan_memory` from the HF config alone. Goal: predicted / measured within 1 +- 0.15.
The per-phase figures are in the note. (What the planner does not count, the CUDA context and the caching
allocator's reserve, is outside ``max_memory_allocated`` too.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import finish, llama_1b, rehearsing, start  # noqa: E402

REPORT = "plan_peak"
CHECKS = ("ppo_step_peak_vs_plan",)
GOAL = 0.15
MIB = 1 << 20


def measure(model_dir: Path, device: torch.device) -> tuple[dict, dict]:
    """(measured phase peaks, planned rank dict) in bytes."""
    import mlora
    from mlora.testing.memory_probe import PhasePeaks, ProbeConfig, planned, synthetic_batch
    from mlora.train.config import PPOConfig
    from mlora.train.engine import ActorCriticEngine

    seq, micro_batch = (64, 2) if rehearsing() else (1024, 2)
    cfg = ProbeConfig(name="ppo step on CUDA", model=str(model_dir), seq=seq, micro_batch=micro_batch,
                      micro_batches=2, rank=16, critic=True, extra={"dtype": "bfloat16"})
    cuda = device.type == "cuda"

    class CudaPhasePeaks(PhasePeaks):
        """The phase boundaries of memory_probe, read from the CUDA caching allocator instead of RSS."""

        def _close(self, phase: str) -> None:
            if cuda:
                torch.cuda.synchronize()
                self.peaks[phase] = max(self.peaks.get(phase, 0), torch.cuda.max_memory_allocated() - before)
                torch.cuda.reset_peak_memory_stats()

    mesh = mlora.init_parallel(tp=1, pp=1)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() if cuda else 0  # what the model, engine and step add is measured
    model = mlora.from_pretrained(model_dir, mesh, dtype=torch.bfloat16)
    lora = dict(rank=cfg.rank, alpha=2 * cfg.rank)
    per_update = cfg.micro_batch * cfg.micro_batches * mesh.dp
    ppo = PPOConfig(advantage_estimator="gae", mini_batch_size=per_update, micro_train_batch_size=cfg.micro_batch,
                    micro_forward_batch_size=cfg.micro_batch, n_samples_per_prompt=1)
    engine = ActorCriticEngine(model, ppo, policy_lora=mlora.LoraConfig(**lora),
                               critic_lora=mlora.LoraConfig(**lora, seed=1))
    vocab = model.spec.vocab_size
    engine.step(synthetic_batch(cfg, vocab, mesh.dp, 16, seed=1))  # optimizer states, first-call paths
    batch = synthetic_batch(cfg, vocab, mesh.dp, cfg.seq)
    with CudaPhasePeaks() as phases:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        engine.step(batch)
    return phases.peaks, planned(cfg, 1)[(0, 0)]


def main() -> None:
    report, device = start(REPORT, CHECKS)
    try:
        measured, plan = measure(llama_1b(device), device)
        predicted = plan["peak"]
        planned_phases = ", ".join(f"{k} {v / MIB:.0f}" for k, v in plan["phases"].items())
        if not measured:
            report.record("ppo_step_peak_vs_plan", {"predicted_MiB": predicted / MIB}, None,
                          f"rehearsal: no CUDA allocator, nothing measured; planned phases (MiB): {planned_phases}")
        else:
            peak = max(measured.values())
            ratio = predicted / peak
            report.record("ppo_step_peak_vs_plan",
                          {"predicted_over_measured": ratio, "measured_MiB": peak / MIB, "predicted_MiB": predicted / MIB},
                          abs(ratio - 1) <= GOAL,
                          f"goal within +-{GOAL:.0%}; measured phases (MiB): "
                          + ", ".join(f"{k} {v / MIB:.0f}" for k, v in measured.items())
                          + f"; planned phases (MiB): {planned_phases}; planned peak at {plan['phase']}")
    except Exception as e:  # noqa: BLE001
        report.error("ppo_step_peak_vs_plan", e)
    finish(report)


if __name__ == "__main__":
    main()
