"""GPU figures of issue 22 (run by tests/gpu/run_all.sh on a lent GPU; never run yet). Writes $OUT/gpu_bench.json.

On a ~1B-shaped random Llama (hidden 2048, 16 layers, 32 heads / 8 KV heads, FFN 8192, vocab 32000), bf16:
1. LoRA (r 16, all linears) forward + backward tokens/s: mlora vs transformers + PEFT (goal >= 1.2x PEFT);
   the same with fp8="torch" (mlora only).
2. Which SDPA kernel the model's attention runs (profiler kernel names; flash / efficient / cudnn / math).
3. The memory planner's predicted peak of an actor update vs torch.cuda.max_memory_allocated (goal +-15%).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPE = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
BATCH, SEQ, RANK, ITERS = 4, 2048, 16, 5


def _build(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPE, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(root / "llama1b")
    return root / "llama1b"


def _best(step) -> float:
    step()  # warm-up (kernels chosen, caches filled)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(ITERS):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def _mlora(model_dir: Path, ids: torch.Tensor, fp8: str | None):
    import mlora

    mesh = mlora.init_parallel(tp=1, pp=1)
    model = mlora.from_pretrained(model_dir, mesh, dtype=torch.bfloat16, fp8=fp8)
    model.add_adapter("policy", mlora.LoraConfig(rank=RANK, alpha=2 * RANK, target_modules="all-linear"))
    mask = torch.ones_like(ids)
    lo, hi = model.vocab_shard_range()

    def loss_fn(logits, mb):
        return logits[..., : hi - lo].float().logsumexp(-1).mean(), {}

    def step():
        model.forward_backward([{"input_ids": ids, "attention_mask": mask}], loss_fn)
        for p in model.adapter_parameters("policy"):
            p.grad = None

    return model, step


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("tests/gpu/bench_gpu.py needs a CUDA GPU")
    out = Path(os.environ.get("OUT", "."))
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "shape": SHAPE, "batch": BATCH, "seq": SEQ, "rank": RANK}
    tokens = BATCH * SEQ
    root = Path(tempfile.mkdtemp())
    model_dir = _build(root)
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    def record(key, fn):
        try:
            results[key] = fn()
        except Exception as exc:  # noqa: BLE001 - a stage that fails is recorded; the others still run
            results[key + "_error"] = f"{type(exc).__name__}: {exc}"
        (out / "gpu_bench.json").write_text(json.dumps(results, indent=2))
        print(key, json.dumps(results.get(key, results.get(key + "_error"))), flush=True)

    def peft_tokens_s() -> float:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa")
        hf = get_peft_model(hf.cuda(), LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear"))
        x = ids.cuda()

        def step():
            hf(input_ids=x).logits.float().logsumexp(-1).mean().backward()
            hf.zero_grad(set_to_none=True)

        return tokens / _best(step)

    record("peft_bf16_tokens_per_s", peft_tokens_s)
    torch.cuda.empty_cache()  # PEFT's model went with its function

    def mlora_tokens_s(fp8):
        def run():
            model, step = _mlora(model_dir, ids, fp8)
            t = _best(step)
            del model
            torch.cuda.empty_cache()
            return tokens / t
        return run

    record("mlora_bf16_tokens_per_s", mlora_tokens_s(None))
    record("mlora_fp8_torch_tokens_per_s", mlora_tokens_s("torch"))
    if "peft_bf16_tokens_per_s" in results and "mlora_bf16_tokens_per_s" in results:
        results["mlora_over_peft"] = results["mlora_bf16_tokens_per_s"] / results["peft_bf16_tokens_per_s"]

    def sdpa_kernels() -> dict:
        from torch.profiler import ProfilerActivity, profile

        model, step = _mlora(model_dir, ids, None)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        names = {e.key for e in prof.key_averages()}
        found = {kind: sorted(n for n in names if kind in n.lower())[:3]
                 for kind in ("flash", "efficient", "cudnn", "fmha", "softmax")}
        del model
        torch.cuda.empty_cache()
        return found

    record("sdpa_kernels", sdpa_kernels)

    def planner_vs_measured() -> dict:
        from mlora.formats.hf_config import load_hf_config, model_spec
        from mlora.plan import Layout, Workload, plan_memory

        model, step = _mlora(model_dir, ids, None)
        opt = torch.optim.AdamW(model.adapter_parameters("policy"), lr=1e-5)
        mask = torch.ones_like(ids)
        lo, hi = model.vocab_shard_range()

        def update():
            model.forward_backward([{"input_ids": ids, "attention_mask": mask}],
                                   lambda logits, mb: (logits[..., : hi - lo].float().logsumexp(-1).mean(), {}))
            opt.step()
            opt.zero_grad(set_to_none=True)

        update()  # AdamW moments exist from here, as in the planner's steady state
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        update()
        measured = torch.cuda.max_memory_allocated()
        plan = plan_memory(model_spec(load_hf_config(model_dir)), Layout(),
                           Workload(micro_batch=BATCH, seq=SEQ, rank=RANK, critic=False, dtype=torch.bfloat16))
        predicted = plan.ranks[0].phases
        actor = max(v for k, v in predicted.items() if k.startswith("actor"))
        return {"measured_bytes": measured, "predicted_actor_bytes": actor, "predicted_over_measured": actor / measured}

    record("planner_vs_measured", planner_vs_measured)
    goals = {"mlora_over_peft >= 1.2": results.get("mlora_over_peft", 0) >= 1.2,
             "planner within 15%": abs(results.get("planner_vs_measured", {}).get("predicted_over_measured", 0) - 1)
             <= 0.15}
    results["goals"] = goals
    (out / "gpu_bench.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(goals), flush=True)


if __name__ == "__main__":
    main()
