"""torch FP8 (``torch._scaled_mm``, rowwise e4m3) on odd TP shard shapes and with a float32 output, on the GPU.

    OUT=... python tests/gpu/check_fp8_shapes.py [--rehearse]

For each local GEMM ``x [M, K] @ Wᵀ [K, N]`` below (SmolLM2-135M's four linears at TP8, where K = 576/8 = 72
for linear_proj and N = 120 for linear_qkv; the same at TP3; two synthetic odd dims; M = 37 tokens, no
multiple of 16), one line: what raw ``torch._scaled_mm`` does with rowwise scales for a float32 and a bfloat16
output (runs, with its error relative to the dequantized float32 product, or refuses), and whether mlora's
decision (``mlora.fp8.quant.fp8_shape_problems``, looked up at run time: "not available" in an mlora without
it) agrees: mlora refuses a shape exactly when torch refuses it (mlora then writes bf16 and casts where only a
float32 output is refused, so "torch runs it" means "with a bf16 output at least"). Where mlora accepts, its
own ``fp8_linear`` must match the reference (relative error <= 1e-2: e4m3 inputs are the same, only the
output rounding differs). Then one line for the float32 output on an aligned shape through mlora's
``_scaled_mm``: written directly, or through the bf16 fallback (older cuBLAS / CUTLASS paths).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_common import finish, start  # noqa: E402

REPORT = "fp8_shapes"
M = 37  # tokens: no multiple of 16 (CUDA's rule concerns K and N only)
# (check name, what the shape is, K, N)
SHAPES = (
    ("fp8_shape_smollm2_tp8_proj", "SmolLM2 linear_proj at TP8", 72, 576),
    ("fp8_shape_smollm2_tp8_qkv", "SmolLM2 linear_qkv at TP8", 576, 120),
    ("fp8_shape_smollm2_tp8_fc1", "SmolLM2 linear_fc1 at TP8", 576, 384),
    ("fp8_shape_smollm2_tp8_fc2", "SmolLM2 linear_fc2 at TP8", 192, 576),
    ("fp8_shape_smollm2_tp3_proj", "SmolLM2 linear_proj at TP3", 192, 576),
    ("fp8_shape_smollm2_tp3_qkv", "SmolLM2 linear_qkv at TP3", 576, 320),
    ("fp8_shape_k40_n64", "K=40 (odd inner dim)", 40, 64),
    ("fp8_shape_k64_n40", "N=40 (odd output dim)", 64, 40),
)
CHECKS = tuple(s[0] for s in SHAPES) + ("fp8_float32_output",)
TOL = 1e-2  # relative to the dequantized float32 product; a bf16 output alone is ~2e-3


def operands(k: int, n: int, device: torch.device, seed: int):
    """Per-token quantized x and per-row quantized W, through mlora's own quantizers (so every path below
    multiplies the same e4m3 operands), and their dequantized float32 product, the reference."""
    from mlora.fp8.quant import quantize_tokens, quantize_weight

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, k, generator=g).to(device)
    w = (torch.randn(n, k, generator=g) * 0.05).to(device)
    xq, sx = quantize_tokens(x)
    wq, sw = quantize_weight(w)
    ref = (xq.float() * sx) @ (wq.float() * sw.unsqueeze(-1)).t()
    return x, xq, sx, wq, sw, ref


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).norm() / ref.norm()).item()


def raw(xq, sx, wq, sw, ref, out_dtype) -> tuple[float | None, str]:
    """What torch._scaled_mm itself does: (relative error, text), or (None, why) where it refuses."""
    try:
        out = torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw.view(1, -1), out_dtype=out_dtype)
        out = out[0] if isinstance(out, tuple) else out
    except Exception as e:  # noqa: BLE001 - the refusal is the figure
        return None, f"refused ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})"
    err = rel(out, ref)
    return err, f"rel {err:.2e}"


def mlora_decision(k: int, n: int, device: torch.device) -> tuple[bool | None, str]:
    """(accepts, text) from mlora.fp8.quant.fp8_shape_problems; (None, ...) where this mlora has no such function.
    The rule is CUDA's: off CUDA mlora applies none (check_fp8_shapes returns at once), so every shape is accepted."""
    import mlora.fp8.quant as quant

    decide = getattr(quant, "fp8_shape_problems", None)
    if decide is None:
        return None, "mlora decision not available (no mlora.fp8.quant.fp8_shape_problems)"
    if device.type != "cuda":
        return True, "mlora accepts (no shape rule off CUDA)"
    problems = decide({"gemm": (k, n)})
    return (not problems), ("mlora accepts" if not problems else f"mlora refuses: {problems[0]}")


def shape_check(report, check: str, what: str, k: int, n: int, device: torch.device, seed: int) -> None:
    x, xq, sx, wq, sw, ref = operands(k, n, device, seed)
    err32, text32 = raw(xq, sx, wq, sw, ref, torch.float32)
    err16, text16 = raw(xq, sx, wq, sw, ref, torch.bfloat16)
    torch_runs = err32 is not None or err16 is not None
    accepts, decision = mlora_decision(k, n, device)
    figure = {"M": M, "K": k, "N": n, "torch_f32": text32, "torch_bf16": text16}
    ok = all(e <= TOL for e in (err32, err16) if e is not None)  # what torch computes, it computes right
    note = f"{what}; {decision}"
    if accepts is not None:
        figure["mlora"] = "accepts" if accepts else "refuses"
        if accepts != torch_runs:
            ok = False
            note += f"; DISAGREES: torch {'runs' if torch_runs else 'refuses'} it"
        if accepts:
            from mlora.fp8.quant import fp8_linear

            try:
                got = fp8_linear(x, wq, sw)
                figure["mlora_rel"] = rel(got, ref)
                ok = ok and figure["mlora_rel"] <= TOL
            except Exception as e:  # noqa: BLE001 - an accepted shape that fails is this check's failure
                figure["mlora_rel"] = None
                ok = False
                note += f"; mlora fp8_linear raised {type(e).__name__}: {e}"
    report.record(check, figure, ok, note)


def float32_output(report, device: torch.device) -> None:
    """A float32 output through mlora's _scaled_mm on an aligned shape (K = N = 576, SmolLM2's hidden size):
    written directly or through the bf16 fallback; either way within TOL of the reference."""
    import mlora.fp8.quant as quant

    quant.require_scaled_mm(device, torch.float32)  # the build-time probe: FP8Unsupported if it cannot
    _, xq, sx, wq, sw, ref = operands(576, 576, device, seed=99)
    out = quant._scaled_mm(xq, sx, wq, sw, torch.float32)
    fallback = str(xq.device) in getattr(quant, "_BF16_OUTPUT_DEVICES", set())
    _, text32 = raw(xq, sx, wq, sw, ref, torch.float32)
    err = rel(out, ref)
    report.record("fp8_float32_output", {"dtype": str(out.dtype).replace("torch.", ""), "rel": err,
                                         "path": "bf16 output, cast" if fallback else "float32 output"},
                  out.dtype == torch.float32 and err <= TOL, f"raw torch._scaled_mm float32 output: {text32}")


def main() -> None:
    report, device = start(REPORT, CHECKS)
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability()
        if cap < (8, 9):
            for check in CHECKS:
                report.skip(check, f"compute capability {cap[0]}.{cap[1]} has no FP8 tensor cores")
            finish(report)
    for seed, (check, what, k, n) in enumerate(SHAPES):
        try:
            shape_check(report, check, what, k, n, device, seed)
        except Exception as e:  # noqa: BLE001 - recorded; the next shape still runs
            report.error(check, e)
    try:
        float32_output(report, device)
    except Exception as e:  # noqa: BLE001
        report.error("fp8_float32_output", e)
    finish(report)


if __name__ == "__main__":
    main()
