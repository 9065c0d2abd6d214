"""Exact checks on CUDA against transformers + PEFT (float32, TF32 off), and the LoRA stack's bf16 overhead.

    OUT=... python tests/gpu/check_gpu.py [--rehearse]

On the tests' tiny random Llama (mlora.testing) with the random PEFT adapters of tests/peft_refs.py:

1. ``tiny_f32_base_vs_hf``: mlora logits (no adapter) = transformers float32 on the CPU within 1e-4 (max abs).
2. ``tiny_f32_lora_vs_peft``: a PEFT adapter loaded with ``load_adapter``: logits = HF+PEFT within 1e-4.
3. ``tiny_f32_lora_grads_vs_peft``: LoRA gradients of a summed-logits loss = PEFT's within 1e-4 relative.
4. ``tiny_f32_mixed_adapters``: a micro-batch whose rows go to two adapters (``adapter_rows``) gives each row the
   logits of its adapter alone within 1e-4.
5. ``lora_stack_bf16_overhead``: forward+backward of one Llama-7B-shaped layer's linears (bench/lora_overhead.py,
   r 32, 8192 tokens) in bf16: mlora with LoRA / its frozen base alone, and / PEFT; best of 10. A figure, no goal
   (the model-level throughput goal is bench_gpu.py's).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import ROOT, finish, rehearsing, start, sync, tiny_llama, work_dir  # noqa: E402

REPORT = "gpu_checks"
CHECKS = ("tiny_f32_base_vs_hf", "tiny_f32_lora_vs_peft", "tiny_f32_lora_grads_vs_peft", "tiny_f32_mixed_adapters",
          "lora_stack_bf16_overhead")
TOL = 1e-4


def exact_checks(report, device: torch.device) -> None:
    from peft_refs import build_refs
    from transformers import AutoModelForCausalLM

    import mlora

    model_dir = tiny_llama()
    refs_dir = work_dir() / "peft-refs"
    if not (refs_dir / "refs.pt").exists():
        build_refs(model_dir, refs_dir)
    refs = torch.load(refs_dir / "refs.pt")
    model = mlora.from_pretrained(model_dir, mlora.init_parallel(tp=1, pp=1))
    ids, mask = refs["ids"], refs["mask"]
    valid = mask.bool()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        base_ref = hf(input_ids=ids, attention_mask=mask).logits

    def record(check: str, diff: float, what: str) -> None:
        report.record(check, diff, diff <= TOL, f"{what} (goal <= {TOL})")

    record("tiny_f32_base_vs_hf", (model.logits(ids, mask).cpu() - base_ref)[valid].abs().max().item(),
           "max |logit diff| vs transformers, valid positions")
    model.load_adapter("policy", refs_dir / "policy", trainable=True)
    record("tiny_f32_lora_vs_peft", (model.logits(ids, mask).cpu() - refs["policy_logits"])[valid].abs().max().item(),
           "max |logit diff| vs HF+PEFT")
    lo, hi = model.vocab_shard_range()
    model.forward_backward([{"input_ids": ids, "attention_mask": mask}],
                           lambda logits, mb: ((logits[..., : hi - lo] * mask.to(logits.device)[..., None]).sum(), {}))
    grads = model.adapter_tensors("policy", grads=True)
    record("tiny_f32_lora_grads_vs_peft",
           max(((grads[k].cpu() - v).norm() / v.norm()).item() for k, v in refs["policy_grads"].items()),
           "largest ||g - g_peft|| / ||g_peft|| over the LoRA factors")

    model.load_adapter("other", refs_dir / "policy", trainable=False)
    with torch.no_grad():  # another adapter: the policy's factors scaled by -0.5
        for p in model.adapter_parameters("other"):
            p.mul_(-0.5)
    rows = {"policy": list(range(0, ids.shape[0], 2)), "other": list(range(1, ids.shape[0], 2))}
    with model.use_adapters("policy", "other"):
        mixed = model.forward_backward([{"input_ids": ids, "attention_mask": mask, "adapter_rows": rows}],
                                       forward_only=True)[0][..., :model.spec.vocab_size].float().cpu()
    worst = 0.0
    for name, picked in rows.items():
        with model.use_adapters(name):
            alone = model.logits(ids, mask).cpu()
        worst = max(worst, (mixed[picked] - alone[picked])[valid[picked]].abs().max().item())
    record("tiny_f32_mixed_adapters", worst, "max |logit diff| of mixed rows vs each adapter alone")


def overhead(report, device: torch.device) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import lora_overhead as bench

    layers = bench.mlora_stack()
    for layer in layers.values():
        layer.to(device=device, dtype=torch.bfloat16)
    peft_model = bench.peft_stack().to(device=device, dtype=torch.bfloat16)
    tokens = 256 if rehearsing() else 8192
    x = torch.randn(tokens, 1, bench.HIDDEN, device=device, dtype=torch.bfloat16) * 0.1

    def timed(fn, active) -> float:
        best = float("inf")
        for _ in range(2 if rehearsing() else 10):
            for layer in layers.values():
                layer.active_adapters = active
            sync(device)
            t0 = time.perf_counter()
            inp = x.detach().requires_grad_(True)
            fn(inp).float().sum().backward()
            sync(device)
            best = min(best, time.perf_counter() - t0)
        return best

    t_lora = timed(lambda i: bench.mlora_forward(layers, i), ("policy",))
    t_base = timed(lambda i: bench.mlora_forward(layers, i), ())
    t_peft = timed(lambda i: peft_model(i), ())
    report.record("lora_stack_bf16_overhead", {"lora_over_base": t_lora / t_base, "lora_over_peft": t_lora / t_peft},
                  None, f"{tokens} tokens, best of 10: mlora {t_lora * 1e3:.2f} ms, frozen base {t_base * 1e3:.2f} ms, "
                        f"PEFT {t_peft * 1e3:.2f} ms")


def main() -> None:
    report, device = start(REPORT, CHECKS)
    try:
        exact_checks(report, device)
    except Exception as e:  # noqa: BLE001 - recorded; the bench still runs
        for check in CHECKS[:4]:
            if check not in report.checks:
                report.error(check, e)
    try:
        overhead(report, device)
    except Exception as e:  # noqa: BLE001
        report.error("lora_stack_bf16_overhead", e)
    finish(report)


if __name__ == "__main__":
    main()
