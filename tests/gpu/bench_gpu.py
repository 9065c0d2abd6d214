"""LoRA training throughput on the GPU (issue 22): mlora vs transformers + PEFT on the same GPU, and which SDPA kernel.

    OUT=... python tests/gpu/bench_gpu.py [--rehearse]

On the ~1B-shaped random Llama of gpu_common (hidden 2048, 16 layers, 32/8 heads, FFN 8192, vocab 32000) in
bf16, LoRA r 16 (alpha 32) on all seven linears, adapters in float32 in both libraries (PEFT's default on a
bf16 base, mlora's masters), a batch of 4 x 2048 tokens, loss = mean log-sum-exp of the float32 logits;
forward + backward (no optimizer step), best of 5 after a warm-up, in one process on one GPU:

1. ``lora_fwd_bwd_bf16_vs_peft``: mlora tokens/s / PEFT tokens/s (goal >= 1.2).
2. ``lora_fwd_bwd_fp8_torch``: the same with ``fp8="torch"`` (the frozen linears in e4m3): tokens/s and the ratio
   to mlora bf16 (a figure, no goal).
3. ``sdpa_kernels``: the attention kernels one mlora step launches (profiler names: flash / efficient / cudnn
   / math softmax); the memory planner assumes a fused (flash-like) kernel.

The planner's peak vs torch.cuda.max_memory_allocated is check_plan_gpu.py's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import best_time, finish, llama_1b, rehearsing, start, sync  # noqa: E402

REPORT = "gpu_bench"
CHECKS = ("lora_fwd_bwd_bf16_vs_peft", "lora_fwd_bwd_fp8_torch", "sdpa_kernels")
GOAL = 1.2
RANK = 16


def sizes() -> tuple[int, int, int]:
    """batch, sequence, timed iterations"""
    return (1, 64, 1) if rehearsing() else (4, 2048, 5)


def batch(vocab: int) -> torch.Tensor:
    b, s, _ = sizes()
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(1))


def peft_step(model_dir: Path, ids: torch.Tensor, device: torch.device):
    """(step, model) for transformers + PEFT: SDPA attention, no KV cache."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = get_peft_model(hf.to(device), LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear"))
    hf.train()
    x = ids.to(device)

    def step() -> None:
        hf(input_ids=x, use_cache=False).logits.float().logsumexp(-1).mean().backward()
        hf.zero_grad(set_to_none=True)

    return step, hf


def mlora_step(model_dir: Path, ids: torch.Tensor, fp8: str | None):
    """(step, model) for mlora: the same adapter on megatron's GPT with the local spec."""
    import mlora

    model = mlora.from_pretrained(model_dir, mlora.init_parallel(tp=1, pp=1), dtype=torch.bfloat16, fp8=fp8)
    model.add_adapter("policy", mlora.LoraConfig(rank=RANK, alpha=2 * RANK, target_modules="all-linear"))
    mask = torch.ones_like(ids)
    lo, hi = model.vocab_shard_range()

    def loss_fn(logits, mb):
        return logits[..., : hi - lo].float().logsumexp(-1).mean(), {}

    def step() -> None:
        model.forward_backward([{"input_ids": ids, "attention_mask": mask}], loss_fn)
        for p in model.adapter_parameters("policy"):
            p.grad = None

    return step, model


def release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    report, device = start(REPORT, CHECKS)
    b, s, iters = sizes()
    tokens = b * s
    try:
        model_dir = llama_1b(device)
    except Exception as e:  # noqa: BLE001 - nothing below can run without the model
        for check in CHECKS:
            report.error(check, e)
        finish(report)
    import json

    ids = batch(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    rates: dict[str, float] = {}
    for name, make in (("peft", lambda: peft_step(model_dir, ids, device)),
                       ("mlora", lambda: mlora_step(model_dir, ids, None))):
        try:
            step, model = make()
            rates[name] = tokens / best_time(step, device, iters)
            del step, model
        except Exception as e:  # noqa: BLE001
            report.error("lora_fwd_bwd_bf16_vs_peft", e)
        release(device)
    if len(rates) == 2:
        ratio = rates["mlora"] / rates["peft"]
        report.record("lora_fwd_bwd_bf16_vs_peft", ratio, None if rehearsing() else ratio >= GOAL,  # CPU: no verdict
                      f"mlora {rates['mlora']:.0f} tokens/s, PEFT {rates['peft']:.0f} tokens/s ({b} x {s} tokens, "
                      f"r {RANK}, best of {iters}; goal >= {GOAL})")
    try:
        step, model = mlora_step(model_dir, ids, "torch")
        fp8_rate = tokens / best_time(step, device, iters)
        del step, model
        report.record("lora_fwd_bwd_fp8_torch", {"tokens_per_s": fp8_rate,
                                                 "over_bf16": fp8_rate / rates["mlora"] if "mlora" in rates else None},
                      None, "fp8='torch': frozen linears in e4m3 through torch._scaled_mm, LoRA in float32")
    except Exception as e:  # noqa: BLE001
        report.error("lora_fwd_bwd_fp8_torch", e)
    release(device)
    try:
        from torch.profiler import ProfilerActivity, profile

        step, model = mlora_step(model_dir, ids, None)
        step()  # warm-up outside the profile
        sync(device)
        activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            step()
            sync(device)
        names = {e.key for e in prof.key_averages()}
        found = {kind: sorted(n for n in names if kind in n.lower())[:2]
                 for kind in ("flash", "efficient", "cudnn", "fmha", "softmax")}
        fused = any(found[k] for k in ("flash", "efficient", "cudnn", "fmha"))
        report.record("sdpa_kernels", {k: v for k, v in found.items() if v} or "none found", None,
                      "fused attention kernel" if fused else "no fused attention kernel seen: the planner's "
                                                             "flash assumption does not hold here")
        del step, model
    except Exception as e:  # noqa: BLE001
        report.error("sdpa_kernels", e)
    finish(report)


if __name__ == "__main__":
    main()
