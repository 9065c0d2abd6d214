"""LoRA on every expert: forward+backward of a mixture-of-experts model, against the frozen MoE base, side by side,
and the local experts as grouped GEMMs against megatron's sequential loop.

    .venv/bin/python bench/moe_lora.py [--tokens 1024] [--reps 5] [--rank 16] [--isa native|avx2]
                                       [--threads N] [--clock wall|cpu]

A Qwen3-MoE-shaped model (4 sparse layers, hidden 512, 8 heads / 4 kv heads of 64, 16 experts of FFN 256, top-2;
random, float32, one CPU rank, mlora's megatron build: router, all-to-all dispatcher, the 16 local experts grouped),
four ways on the same tokens:

- ``forward``: the frozen base's forward alone (what serving it costs);
- ``attention``: forward+backward with a LoRA on q/k/v/o only; its gradient runs back through every frozen
  expert (what a run that leaves the experts alone pays);
- ``experts``: forward+backward with a LoRA on every linear, each expert's gate/up/down with an adapter of its
  own (rank ``--rank``, B non-zero so every branch computes), the local experts' GEMMs grouped
  (:mod:`mlora.models.grouped_experts`);
- ``sequential``: the same with megatron's loop over the experts (``GroupedLoraExperts.grouped = False``).

Then one MoE layer's experts alone (forward+backward of the 16 local experts with their LoRA on the tokens the
dispatcher hands them, ``--tokens`` x top-2 copies routed at random), grouped vs sequential, at ``--tokens`` and
at a quarter of it. Variants alternate in rotating order; the ratios of the fastest runs (and of the medians) are
printed: experts / attention is what adapting the experts adds to a LoRA step, experts / forward the step against
the frozen base, experts / sequential what grouping saves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from lora_overhead import start  # noqa: E402  (the machine line and the --isa/--threads/--clock handling)

SHAPE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=2,
             mlp_only_layers=[], max_position_embeddings=2048)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per step (4 sequences)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--isa", choices=("native", "avx2"), default="native")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    clock = start(args)

    import mlora
    from mlora.models.grouped_experts import GroupedLoraExperts
    from mlora.testing import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model("qwen3_moe", Path(tmp) / "moe", **SHAPE)
        model = mlora.from_pretrained(Path(tmp) / "moe", mlora.init_parallel(), dtype=torch.float32)
    spec = model.spec
    print(f"model: Qwen3-MoE shape, {spec.num_layers} sparse layers, hidden {spec.hidden_size}, "
          f"{spec.moe.num_experts} experts of FFN {spec.moe.ffn_size}, top-{spec.moe.top_k}; "
          f"{args.tokens} tokens per step, LoRA rank {args.rank}, float32, {torch.get_num_threads()} threads")
    model.add_adapter("attention", mlora.LoraConfig(rank=args.rank, alpha=2 * args.rank,
                                                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model.add_adapter("experts", mlora.LoraConfig(rank=args.rank, alpha=2 * args.rank, target_modules="all-linear"))
    with torch.no_grad():  # B non-zero: every branch's GEMMs run as in training
        for name in ("attention", "experts"):
            for p in model.adapter_parameters(name):
                p.normal_(std=0.01)
    ids = torch.randint(0, spec.vocab_size, (4, args.tokens // 4), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    lo, hi = model.vocab_shard_range()

    def loss(logits, mb):
        return logits[..., :hi - lo].float().logsumexp(-1).mean(), {}

    def forward() -> None:
        with torch.no_grad(), model.use_adapters():
            model.logits(ids)

    experts = [m for m in model.gpt.modules() if isinstance(m, GroupedLoraExperts)]

    def train(name: str, grouped: bool = True):
        def run() -> None:
            for m in experts:
                m.grouped = grouped
            with model.use_adapters(name):
                model.forward_backward([batch], loss)
            model.zero_grad(set_to_none=True)
        return run

    variants = {"forward": forward, "attention": train("attention"), "experts": train("experts"),
                "sequential": train("experts", grouped=False)}
    _measure(variants, args.reps, clock, (("experts", "attention"), ("experts", "forward"),
                                          ("attention", "forward"), ("experts", "sequential")))
    layer = experts[0]
    for tokens in (args.tokens, args.tokens // 4):
        print(f"one MoE layer's {layer.num_local_experts} local experts alone, {tokens} tokens x top-"
              f"{spec.moe.top_k} copies:")
        _measure(_layer_variants(model, layer, tokens * spec.moe.top_k), args.reps, clock,
                 (("grouped", "sequential"),))


def _layer_variants(model, layer, copies: int) -> dict:
    """Forward+backward of ``layer`` (a GroupedLoraExperts) with the ``experts`` adapter on ``copies`` dispatched
    token copies, each routed to a random local expert, grouped and sequential."""
    g = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.randint(0, layer.num_local_experts, (copies,), generator=g),
                            minlength=layer.num_local_experts)
    x = torch.randn(copies, model.spec.hidden_size, generator=g).requires_grad_()
    probs = torch.rand(copies, generator=g).requires_grad_()
    grad = torch.randn(copies, model.spec.hidden_size, generator=g)

    def run(grouped: bool):
        def step() -> None:
            layer.grouped = grouped
            with model.use_adapters("experts"):
                out, _ = layer(x, counts, probs)
            out.backward(grad)
            x.grad = probs.grad = None
            model.zero_grad(set_to_none=True)
        return step

    return {"grouped": run(True), "sequential": run(False)}


def _measure(variants: dict, reps: int, clock, ratios) -> None:
    """Each variant once to warm up, then ``reps`` rounds in rotating order; best and median times and ``ratios``."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up
        fn()
    names = list(variants)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = clock()
            variants[name]()
            times[name].append(clock() - t0)
    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    for k in names:
        print(f"{k:>10}: best {best[k] * 1e3:8.1f} ms   median {median[k] * 1e3:8.1f} ms")
    for a, b in ratios:
        print(f"{a} / {b}: {best[a] / best[b]:.2f}x (medians {median[a] / median[b]:.2f}x)")


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="LoRA compute")
