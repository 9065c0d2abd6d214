"""GPU checks (run only where a GPU is lent; see tests/gpu/README.md). Writes $OUT/gpu_checks.json.

1. NCCL mesh, tiny Llama on CUDA: mlora logits == transformers (float32, TF32 off) within 1e-4.
2. A random PEFT adapter loaded with load_adapter: logits == HF+PEFT within 1e-4; LoRA gradients
   of a summed-logits loss == PEFT's within 1e-4 relative.
3. Mixed-adapter micro-batch (issue 25): rows routed to two adapters (``adapter_rows``) give each row the
   logits of its adapter alone within 1e-4.
4. bench: forward+backward of the Llama-7B-shaped LoRA stack in bf16 on the GPU (mlora LoRA vs
   frozen base alone vs PEFT), best of 10, printed as ratios.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (peft_refs)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("tests/gpu/check_gpu.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    out_dir = Path(os.environ.get("OUT", "."))
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    from peft_refs import build_refs

    import mlora
    from mlora.testing import build_tiny_model

    work = Path(tempfile.mkdtemp())
    model_dir = build_tiny_model("llama", work / "llama")
    refs_dir = build_refs(model_dir, work / "refs")
    refs = torch.load(refs_dir / "refs.pt")
    mesh = mlora.init_parallel(tp=1, pp=1)
    results["backend"] = mesh.backend
    model = mlora.from_pretrained(model_dir, mesh)
    ids, mask = refs["ids"], refs["mask"]
    valid = mask.bool()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        base_ref = hf(input_ids=ids, attention_mask=mask).logits
    results["base_logits_max_abs_diff"] = (model.logits(ids, mask).cpu() - base_ref)[valid].abs().max().item()
    model.load_adapter("policy", refs_dir / "policy", trainable=True)
    results["lora_logits_max_abs_diff"] = (model.logits(ids, mask).cpu() - refs["policy_logits"])[valid].abs().max().item()
    lo, hi = model.vocab_shard_range()
    model.forward_backward([{"input_ids": ids, "attention_mask": mask}],
                           lambda logits, mb: ((logits[..., : hi - lo] * mask.to(logits.device)[..., None]).sum(), {}))
    grads = model.adapter_tensors("policy", grads=True)
    results["lora_grad_max_rel"] = max(((grads[k] - v).norm() / v.norm()).item() for k, v in refs["policy_grads"].items())

    model.load_adapter("other", refs_dir / "policy", trainable=False)
    with torch.no_grad():  # another adapter: the policy's factors, B negated and halved
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
    results["mixed_adapter_logits_max_abs_diff"] = worst

    import lora_overhead as bench

    layers = bench.mlora_stack()
    for layer in layers.values():
        layer.cuda().to(torch.bfloat16)
    peft_model = bench.peft_stack().cuda().to(torch.bfloat16)
    x = torch.randn(8192, 1, bench.HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.1

    def timed(fn, active) -> float:
        best = float("inf")
        for _ in range(10):
            for layer in layers.values():
                layer.active_adapters = active
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            inp = x.detach().requires_grad_(True)
            fn(inp).float().sum().backward()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        return best

    t_lora = timed(lambda i: bench.mlora_forward(layers, i), ("policy",))
    t_base = timed(lambda i: bench.mlora_forward(layers, i), ())
    t_peft = timed(lambda i: peft_model(i), ())
    results["bench_bf16_8192_tokens"] = {"mlora_s": t_lora, "base_s": t_base, "peft_s": t_peft,
                                         "lora_over_base": t_lora / t_base, "lora_over_peft": t_lora / t_peft}
    ok = (results["base_logits_max_abs_diff"] < 1e-4 and results["lora_logits_max_abs_diff"] < 1e-4
          and results["lora_grad_max_rel"] < 1e-4 and results["mixed_adapter_logits_max_abs_diff"] < 1e-4)
    results["pass"] = ok
    (out_dir / "gpu_checks.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
