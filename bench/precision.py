"""Frozen-base precision: forward+backward of one Llama-7B-shaped LoRA layer stack with an fp32, bf16 and FP8 base.

    .venv/bin/python bench/precision.py [--tokens 2048] [--reps 3] [--device cpu|cuda]

Stack as in ``bench/lora_overhead.py``: qkv (4096 -> 3x4096) -> o (4096 -> 4096) -> gate/up
(4096 -> 2x11008) -> SiLU·mul -> down (11008 -> 4096), LoRA r 32 (alpha 64) on every projection
(q/k/v and gate/up as separate adapters with one stacked A GEMM per fused layer), input requiring
grad as inside a network, the base frozen (no weight gradient). Variants:

- ``fp32``: base, adapters and activations in float32;
- ``bf16``: base, adapters and activations in bfloat16;
- ``fp8``: base weights float8_e4m3fn with one float32 scale per output row, inputs quantized per
  token, ``torch._scaled_mm`` with float32 accumulation and bf16 output (mlora's
  ``mlora.fp8.fp8_linear`` when importable, else — or with ``--fp8-impl local`` — a local copy of that
  forward recipe whose input gradient is ``(grad · row scales) @ W_fp8.to(bf16)``, which materializes
  only a bf16 copy of W); adapters and activations in bfloat16.

All three hold the same weights (bf16 and FP8 are roundings of the fp32 ones). Variants run
alternately, rotating the order each repetition. Prints seconds per forward+backward (best and
median), time ratios against fp32, the bytes of the frozen weights (+ scales) and adapters, and
the peak memory of one step above what was resident before it: on CPU the process's RSS
high-water mark (reset through ``/proc/self/clear_refs`` before each step; the script re-executes
itself with ``MALLOC_MMAP_THRESHOLD_`` fixed so that freed tensors leave the RSS), on CUDA
``torch.cuda.max_memory_allocated``.

On CPU the FP8 step peak is dominated by ``torch._scaled_mm`` itself: the CPU kernel materializes
float32 copies of its operands (~780 MiB transient for the 22016 x 4096 gate/up weight, measured), so
it says nothing about GPU FP8 memory; the frozen-weight bytes are the figure that carries over.

Cost: all three variants hold their weights at once (~1.4 GB on CPU). Measured on the 2-core CPU machine
(while other jobs shared it): ``--tokens 256 --reps 2`` ~1 min wall, ``--tokens 512 --reps 3`` ~4 min;
the default (``--tokens 2048 --reps 3``, plus one warm-up) is estimated at ~15 min there (not run).
CPU FP8 timings say nothing about GPU FP8 speed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
    # a fixed mmap threshold makes glibc return every large freed block to the OS, so the RSS
    # high-water mark of a step measures that step's tensors, not allocator caching
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HIDDEN, INTER, RANK, ALPHA = 4096, 11008, 32, 64
# (name, in, [out of each sub-projection]) of one decoder layer's frozen linears
LINEARS = (("qkv", HIDDEN, (HIDDEN, HIDDEN, HIDDEN)), ("proj", HIDDEN, (HIDDEN,)),
           ("fc1", HIDDEN, (INTER, INTER)), ("fc2", INTER, (HIDDEN,)))

try:  # prefer mlora's FP8 recipe when the package provides it
    from mlora.fp8 import fp8_linear as _mlora_fp8_linear
    from mlora.fp8 import quantize_weight as _mlora_quantize_weight
except ImportError:
    _mlora_fp8_linear = _mlora_quantize_weight = None

FP8_MAX = 448.0


def _local_quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], float32 scale [N]): one scale per output row, amax / 448."""
    scale = w.abs().amax(dim=-1).float().clamp(min=1e-12) / FP8_MAX
    return (w.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class _LocalFP8Linear(torch.autograd.Function):
    """Same recipe as mlora.fp8.fp8_linear: per-token e4m3 inputs, rowwise e4m3 weights, _scaled_mm."""

    @staticmethod
    def forward(ctx, x, wq, sw):
        x2 = x.reshape(-1, x.shape[-1])
        sx = x2.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
        xq = (x2.detach().float() / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.view(1, -1), out_dtype=x.dtype)
        ctx.save_for_backward(wq, sw)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        wq, sw = ctx.saved_tensors
        # (grad · sw) @ W_fp8: the per-output-row scale applied to the gradient's columns, so that only a
        # grad-dtype copy of W (exact: e4m3 values fit bf16) is materialized, never a float32 one
        return (grad * sw.to(grad.dtype)) @ wq.to(grad.dtype), None, None


fp8_linear = _mlora_fp8_linear or _LocalFP8Linear.apply
quantize_weight = _mlora_quantize_weight or _local_quantize_weight
FP8_IMPL = "mlora.fp8.fp8_linear" if _mlora_fp8_linear is not None else "local _scaled_mm recipe"


def use_local_fp8() -> None:
    global fp8_linear, quantize_weight, FP8_IMPL
    fp8_linear, quantize_weight, FP8_IMPL = _LocalFP8Linear.apply, _local_quantize_weight, "local _scaled_mm recipe"


class Layer:
    """One frozen linear (several fused sub-projections) with a LoRA adapter per sub-projection."""

    def __init__(self, w: torch.Tensor, subs: tuple[int, ...], a: torch.Tensor, bs: list[torch.Tensor],
                 kind: str, device: torch.device) -> None:
        self.kind = kind
        dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        if kind == "fp8":
            wq, scale = quantize_weight(w.to(device))
            self.base = (wq, scale)
        else:
            self.base = (w.to(device, dtype),)
        self.subs = subs
        self.a = a.to(device, dtype).requires_grad_(True)
        self.bs = [b.to(device, dtype).requires_grad_(True) for b in bs]
        self.scaling = ALPHA / RANK

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp8":
            base = fp8_linear(x, *self.base)
        else:
            base = x @ self.base[0].t()
        h = (x @ self.a.t()).split(RANK, dim=-1)
        lora = torch.cat([hk @ bk.t() for hk, bk in zip(h, self.bs)], dim=-1)
        return base + lora * self.scaling

    def weight_bytes(self) -> tuple[int, int]:
        base = sum(t.numel() * t.element_size() for t in self.base)
        adapters = sum(t.numel() * t.element_size() for t in [self.a, *self.bs])
        return base, adapters

    def params(self) -> list[torch.Tensor]:
        return [self.a, *self.bs]


def build(device: torch.device, seed: int = 0) -> dict[str, dict[str, Layer]]:
    g = torch.Generator().manual_seed(seed)
    stacks: dict[str, dict[str, Layer]] = {k: {} for k in ("fp32", "bf16", "fp8")}
    for name, inp, subs in LINEARS:
        w = torch.randn(sum(subs), inp, generator=g) * 0.02
        a = torch.randn(len(subs) * RANK, inp, generator=g) * 0.01
        bs = [torch.randn(o, RANK, generator=g) * 0.01 for o in subs]
        for kind in stacks:
            stacks[kind][name] = Layer(w, subs, a, bs, kind, device)
        del w
    return stacks


def forward(layers: dict[str, Layer], x: torch.Tensor) -> torch.Tensor:
    h = layers["qkv"](x)
    h = layers["proj"](h[..., :HIDDEN].contiguous())
    h = layers["fc1"](h)
    gate, up = h.chunk(2, dim=-1)
    return layers["fc2"](F.silu(gate) * up)


def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, val = line.split(":")
                out[key] = int(val.split()[0]) * 1024
    return out


class PeakMemory:
    """Peak bytes of one step above the memory resident before it (CPU: RSS high-water; CUDA: allocator)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu_ok = device.type == "cpu" and os.path.exists("/proc/self/clear_refs")

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        elif self.cpu_ok:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.before = _proc_status()["VmRSS"]
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.before
        elif self.cpu_ok:
            self.peak = _proc_status()["VmHWM"] - self.before
        else:
            self.peak = float("nan")


def step(layers: dict[str, Layer], x: torch.Tensor, device: torch.device) -> tuple[float, float]:
    x = x.detach().requires_grad_(True)
    with PeakMemory(device) as mem:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = forward(layers, x)
        out.float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        del out
    for layer in layers.values():
        for p in layer.params():
            p.grad = None
    return elapsed, mem.peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--fp8-impl", choices=("auto", "local"), default="auto",
                    help="auto: mlora.fp8.fp8_linear when importable; local: the bench's own copy of the recipe")
    args = ap.parse_args()
    if args.fp8_impl == "local":
        use_local_fp8()
    device = torch.device(args.device)
    torch.manual_seed(0)
    stacks = build(device)
    x32 = torch.randn(args.tokens, HIDDEN, device=device) * 0.1
    inputs = {"fp32": x32, "bf16": x32.bfloat16(), "fp8": x32.bfloat16()}
    names = list(stacks)
    for name in names:  # warm-up
        step(stacks[name], inputs[name], device)
    times: dict[str, list[float]] = {k: [] for k in names}
    peaks: dict[str, list[float]] = {k: [] for k in names}
    for rep in range(args.reps):
        for name in names[rep % 3:] + names[:rep % 3]:
            t, p = step(stacks[name], inputs[name], device)
            times[name].append(t)
            peaks[name].append(p)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    wbytes = {k: [sum(b) for b in zip(*(layer.weight_bytes() for layer in stacks[k].values()))] for k in names}
    peak = {k: max(v) for k, v in peaks.items()}
    where = (f"{torch.get_num_threads()} threads" if device.type == "cpu"
             else torch.cuda.get_device_name(device))
    print(f"tokens {args.tokens}, hidden {HIDDEN}, intermediate {INTER}, r {RANK}, {device.type} ({where}), "
          f"torch {torch.__version__}, {args.reps} reps, FP8 via {FP8_IMPL} (seconds per forward+backward)")
    mem_kind = "RSS high-water" if device.type == "cpu" else "max_memory_allocated"
    for k in names:
        base_b, ad_b = wbytes[k]
        print(f"  {k:5s} best {best[k]:.3f} s, median {med[k]:.3f} s  (runs: {', '.join(f'{t:.3f}' for t in times[k])})"
              f"   frozen weights {base_b / 2**20:.1f} MiB, adapters {ad_b / 2**20:.2f} MiB, "
              f"step peak ({mem_kind} above resident) {peak[k] / 2**20:.1f} MiB")
    for k in ("bf16", "fp8"):
        print(f"{k:4s} / fp32 time = {best[k] / best['fp32']:.3f}x best, {med[k] / med['fp32']:.3f}x median;"
              f"  frozen weight bytes {wbytes[k][0] / wbytes['fp32'][0]:.3f}x;"
              f"  step peak {peak[k] / peak['fp32']:.3f}x")
    print(f"fp8  / bf16 time = {best['fp8'] / best['bf16']:.3f}x best, {med['fp8'] / med['bf16']:.3f}x median;"
          f"  frozen weight bytes {wbytes['fp8'][0] / wbytes['bf16'][0]:.3f}x;"
          f"  step peak {peak['fp8'] / peak['bf16']:.3f}x")


if __name__ == "__main__":
    main()
