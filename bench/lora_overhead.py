"""LoRA overhead: forward+backward of one Llama-7B-shaped stack of linears, four ways, side by side.

    .venv/bin/python bench/lora_overhead.py [--tokens 2048] [--reps 3] [--isa native|avx2] [--q-only]
                                            [--threads N] [--clock wall|cpu]

- ``mlora``: megatron column/row-parallel linears with mlora's LoRA (r 32, all seven projections,
  q/k/v and gate/up as canonical adapters with one stacked A GEMM per fused layer);
- ``base``: the same linears with the adapters switched off (frozen base alone);
- ``peft``: PEFT LoRA (same r and targets) on ``torch.nn.Linear`` of the same shapes;
- ``hf``: that ``torch.nn.Linear`` stack with PEFT's adapters disabled (PEFT's own frozen base).

Stack: qkv (4096 -> 3x4096) -> q + k + v per head (a stand-in for attention that, like it, uses
every projection) -> o (4096 -> 4096) -> gate/up (4096 -> 2x11008) -> SiLU·mul -> down
(11008 -> 4096), float32 on CPU, input requiring grad as inside a network. Variants run
alternately (rotating order). Prints the ratios of the fastest runs (the least disturbed on a
noisy machine) and, for reference, of the medians: mlora / base and mlora / PEFT (the goals), and
each library's LoRA against its own frozen stack (mlora / base vs PEFT / hf).

``--q-only`` runs the bench's earlier stack: o reads q alone, k and v are left unused, so PEFT's
autograd skips their backward (~8% of the stack's base FLOPs) while mlora's fused qkv GEMM runs its
whole backward: that comparison favours PEFT by construction.

It first prints the machine: CPU model, the ISA flags that matter, torch's kernel capability and
BLAS. ``--isa avx2`` re-runs the bench with an AVX2-only CPU emulated on an AVX-512 one
(``ATEN_CPU_CAPABILITY=avx2``: torch's own vectorized kernels; ``MKL_ENABLE_INSTRUCTIONS=AVX2``:
the float32 GEMMs, which are MKL's ``sgemm``; ``ONEDNN_MAX_CPU_ISA=AVX2``, unused by this float32
stack but set for completeness). On AMD EPYC (Zen 4) MKL runs its AVX2 Zen ``sgemm`` kernel either way
and most of torch's elementwise kernels have no AVX-512 build, so the emulation changes little there;
the memory system (first-touch page faults of fresh buffers, bandwidth) differs more between machines.

On a machine shared with other work, wall-clock best-of-N still swings by ±10%; ``--threads 1
--clock cpu`` times this process's CPU instead, which other tenants do not inflate.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F

HIDDEN, INTER, HEADS, RANK, ALPHA = 4096, 11008, 32, 32, 64


def mlora_stack(seed: int = 0):
    """The four megatron LoRA linears of one layer at TP 1, with adapter ``policy``."""
    import mlora
    from mlora.formats.hf_config import ModelSpec
    from mlora.lora.layers import LoraBranch, LoraColumnParallelLinear, LoraRowParallelLinear
    from mlora.lora.sites import model_sites
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


def mlora_forward(layers, x, q_only: bool = False):
    h, _ = layers["qkv"](x)
    if q_only:
        h = h[..., :HIDDEN].contiguous()
    else:  # megatron's fused layout at TP 1, MHA: [q, k, v] of each head
        h = h.view(*h.shape[:-1], HEADS, 3, HIDDEN // HEADS).sum(-2).flatten(-2)
    h, _ = layers["proj"](h)
    h, _ = layers["fc1"](h)
    gate, up = h.chunk(2, dim=-1)
    out, _ = layers["fc2"](F.silu(gate) * up)
    return out


class HFBlock(torch.nn.Module):
    def __init__(self, q_only: bool = False) -> None:
        super().__init__()
        self.q_only = q_only
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = lin(HIDDEN, HIDDEN), lin(HIDDEN, HIDDEN), lin(HIDDEN, HIDDEN)
        self.o_proj = lin(HIDDEN, HIDDEN)
        self.gate_proj, self.up_proj, self.down_proj = lin(HIDDEN, INTER), lin(HIDDEN, INTER), lin(INTER, HIDDEN)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        h = self.o_proj(q if self.q_only else q + k + v)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


def peft_stack(q_only: bool = False):
    from peft import LoraConfig, get_peft_model

    block = HFBlock(q_only)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(block, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.01)
    return model


AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def machine() -> str:
    """The CPU (model name, family/model: a VM may report only "AMD EPYC"), its vector ISA flags, what
    torch dispatches to, and the BLAS behind its float32 GEMMs."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    mkl = re.search(r"Math Kernel Library Version ([\d.]+)", torch.__config__.show())
    blas = f"MKL {mkl.group(1) if mkl else ''}".strip() if torch.backends.mkl.is_available() else "non-MKL BLAS"
    env = " ".join(f"{k}={os.environ[k]}" for k in AVX2_ENV if k in os.environ)
    return (f"cpu: {info.get('model name', platform.processor() or platform.machine())} (family "
            f"{info.get('cpu family', '?')} model {info.get('model', '?')}), {os.cpu_count()} cores, flags "
            f"{' '.join(isa) or '?'}; torch {torch.__version__} capability "
            f"{torch.backends.cpu.get_cpu_capability()}, float32 GEMM: {blas}"
            f"{'; emulation: ' + env if env else ''}")


def step(fn, x, clock=time.perf_counter) -> float:
    x = x.detach().requires_grad_(True)
    t0 = clock()
    out = fn(x)
    out.sum().backward()
    return clock() - t0


def side_by_side(variants: dict, x: torch.Tensor, reps: int, clock, params: list) -> dict[str, list[float]]:
    """Seconds per forward+backward (:func:`step`) of each variant, after one warm-up each, alternating in
    rotating order; ``params``' gradients are dropped after each run."""
    names = list(variants)
    times: dict[str, list[float]] = {k: [] for k in names}
    for name in names:  # warm-up
        step(variants[name], x)
    for rep in range(reps):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            times[name].append(step(variants[name], x, clock))
            for p in params:
                p.grad = None
    return times


def start(args) -> Callable[[], float]:
    """What a bench does first: re-run itself with an AVX2-only CPU emulated (``--isa avx2``), print the
    machine, set ``--threads``; returns the ``--clock`` (wall or this process's CPU time)."""
    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        # the ISA is picked once, when torch/MKL load: only a fresh process can change it
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})
    print(machine())
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return time.perf_counter if args.clock == "wall" else time.process_time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--isa", choices=("native", "avx2"), default="native",
                    help="avx2: re-run with torch, MKL and oneDNN limited to AVX2 (an AVX2-only CPU emulated)")
    ap.add_argument("--q-only", action="store_true", help="the earlier stack: k and v computed but unused")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time, which other tenants of a shared machine do not inflate "
                         "(use with --threads 1: idle threads spinning at a barrier count as CPU time)")
    args = ap.parse_args()
    clock = start(args)
    layers = mlora_stack()
    peft_model = peft_stack(args.q_only)
    x = torch.randn(args.tokens, 1, HIDDEN) * 0.1  # [seq, batch, hidden], megatron's layout

    def run_mlora(inp):
        for layer in layers.values():
            layer.active_adapters = ("policy",)
        return mlora_forward(layers, inp, args.q_only)

    def run_base(inp):
        for layer in layers.values():
            layer.active_adapters = ()
        return mlora_forward(layers, inp, args.q_only)

    def run_hf(inp):
        with peft_model.disable_adapter():
            return peft_model(inp)

    variants = {"mlora": run_mlora, "base": run_base, "peft": lambda inp: peft_model(inp), "hf": run_hf}
    params = list(peft_model.parameters()) + [p for layer in layers.values() for p in layer.parameters()]
    times = side_by_side(variants, x, args.reps, clock, params)
    names = list(variants)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"tokens {args.tokens}, hidden {HIDDEN}, intermediate {INTER}, r {RANK}, float32, "
          f"{torch.get_num_threads()} threads, {args.reps} reps, {'q-only' if args.q_only else 'q+k+v'} stack "
          f"({'wall-clock' if args.clock == 'wall' else 'CPU'} seconds per forward+backward)")
    for k in names:
        print(f"  {k:6s} best {best[k]:.3f} s, median {med[k]:.3f} s   "
              f"(runs: {', '.join(f'{t:.3f}' for t in times[k])})")
    print(f"mlora LoRA / frozen base alone = {best['mlora'] / best['base']:.3f}x best, "
          f"{med['mlora'] / med['base']:.3f}x median   (goal <= 1.10)")
    print(f"mlora LoRA / PEFT LoRA         = {best['mlora'] / best['peft']:.3f}x best, "
          f"{med['mlora'] / med['peft']:.3f}x median   (goal <= 1.00)")
    print(f"PEFT LoRA / its frozen base    = {best['peft'] / best['hf']:.3f}x best, "
          f"{med['peft'] / med['hf']:.3f}x median   (compare with mlora / base)")


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="LoRA compute")
