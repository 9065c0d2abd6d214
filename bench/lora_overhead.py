"""LoRA overhead: forward+backward of one Llama-7B-shaped stack of linears, three ways, side by side.

    .venv/bin/python bench/lora_overhead.py [--tokens 2048] [--reps 3]

- ``mlora``: megatron column/row-parallel linears with mlora's LoRA (r 32, all seven projections,
  q/k/v and gate/up as canonical adapters with one stacked A GEMM per fused layer);
- ``base``: the same linears with the adapters switched off (frozen base alone);
- ``peft``: PEFT LoRA (same r and targets) on ``torch.nn.Linear`` of the same shapes.

Stack: qkv (4096 -> 3x4096) -> o (4096 -> 4096) -> gate/up (4096 -> 2x11008) -> SiLU·mul ->
down (11008 -> 4096), float32 on CPU, input requiring grad as inside a network. Variants run
alternately (rotating order). Prints the two ratios of the fastest runs (the least disturbed on a
noisy machine) and, for reference, of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

HIDDEN, INTER, HEADS, RANK, ALPHA = 4096, 11008, 32, 32, 64


def mlora_stack(seed: int = 0):
    """The four megatron LoRA linears of one layer at TP 1, with adapter ``policy``."""
    import mlora
    from mlora.lora.layers import LoraBranch, LoraColumnParallelLinear, LoraRowParallelLinear
    from mlora.lora.sites import model_sites
    from mlora.models.hf_config import ModelSpec
    from mlora.models.megatron_build import transformer_config

    mesh = mlora.init_parallel(tp=1, pp=1)
    spec = ModelSpec("LlamaForCausalLM", 1, HIDDEN, HEADS, HEADS, HIDDEN // HEADS, INTER, 32000, 1e-5, 1e4,
                     False, False, 4096, None, None)
    cfg = transformer_config(spec, mesh, torch.float32)
    g = torch.Generator().manual_seed(seed)
    init = lambda w: None  # noqa: E731  (weights are filled below)
    common = dict(config=cfg, init_method=init, bias=False, skip_bias_add=False)
    layers = {
        "qkv": LoraColumnParallelLinear(HIDDEN, 3 * HIDDEN, gather_output=False, **common),
        "proj": LoraRowParallelLinear(HIDDEN, HIDDEN, input_is_parallel=True, **common),
        "fc1": LoraColumnParallelLinear(HIDDEN, 2 * INTER, gather_output=False, **common),
        "fc2": LoraRowParallelLinear(INTER, HIDDEN, input_is_parallel=True, **common),
    }
    sites = model_sites(spec, 1)
    for key, sub in (("qkv", "q_proj"), ("proj", "o_proj"), ("fc1", "gate_proj"), ("fc2", "down_proj")):
        layer = layers[key]
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g) * 0.02)
        layer.weight.requires_grad_(False)
        site = layer.lora_site = sites[(0, sub)]
        a = torch.randn(len(site.subs) * RANK, site.in_local, generator=g) * 0.01
        bs = [torch.randn(site.out_full[k], RANK, generator=g) * 0.01 for k in range(len(site.subs))]
        layer.lora["policy"] = LoraBranch(site.subs, RANK, ALPHA / RANK, 0.0, a, bs, trainable=True)
    return layers


def mlora_forward(layers, x):
    h, _ = layers["qkv"](x)
    h, _ = layers["proj"](h[..., :HIDDEN].contiguous())
    h, _ = layers["fc1"](h)
    gate, up = h.chunk(2, dim=-1)
    out, _ = layers["fc2"](F.silu(gate) * up)
    return out


class HFBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = lin(HIDDEN, HIDDEN), lin(HIDDEN, HIDDEN), lin(HIDDEN, HIDDEN)
        self.o_proj = lin(HIDDEN, HIDDEN)
        self.gate_proj, self.up_proj, self.down_proj = lin(HIDDEN, INTER), lin(HIDDEN, INTER), lin(INTER, HIDDEN)

    def forward(self, x):
        q, _k, _v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        h = self.o_proj(q)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def peft_stack():
    from peft import LoraConfig, get_peft_model

    block = HFBlock()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(block, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.01)
    return model


def step(fn, x) -> float:
    x = x.detach().requires_grad_(True)
    t0 = time.perf_counter()
    out = fn(x)
    out.sum().backward()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    layers = mlora_stack()
    peft_model = peft_stack()
    x = torch.randn(args.tokens, 1, HIDDEN) * 0.1  # [seq, batch, hidden], megatron's layout

    def run_mlora(inp):
        for layer in layers.values():
            layer.active_adapters = ("policy",)
        return mlora_forward(layers, inp)

    def run_base(inp):
        for layer in layers.values():
            layer.active_adapters = ()
        return mlora_forward(layers, inp)

    variants = {"mlora": run_mlora, "base": run_base, "peft": lambda inp: peft_model(inp)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for name in names:  # warm-up
        step(variants[name], x)
    for rep in range(args.reps):
        for name in names[rep % 3:] + names[:rep % 3]:
            times[name].append(step(variants[name], x))
            for p in list(peft_model.parameters()) + [p for layer in layers.values() for p in layer.parameters()]:
                p.grad = None
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"tokens {args.tokens}, hidden {HIDDEN}, intermediate {INTER}, r {RANK}, float32, "
          f"{torch.get_num_threads()} threads, {args.reps} reps (seconds per forward+backward)")
    for k in names:
        print(f"  {k:6s} best {best[k]:.3f} s, median {med[k]:.3f} s   "
              f"(runs: {', '.join(f'{t:.3f}' for t in times[k])})")
    print(f"mlora LoRA / frozen base alone = {best['mlora'] / best['base']:.3f}x best, "
          f"{med['mlora'] / med['base']:.3f}x median   (goal <= 1.10)")
    print(f"mlora LoRA / PEFT LoRA         = {best['mlora'] / best['peft']:.3f}x best, "
          f"{med['mlora'] / med['peft']:.3f}x median   (goal <= 1.00)")


if __name__ == "__main__":
    main()
