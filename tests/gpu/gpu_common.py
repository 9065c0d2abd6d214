"""What the GPU check scripts share: the "no CUDA" exit, the random models, the error measure, the rehearsal.

Every script lists its checks in a literal ``CHECKS`` tuple and its report name in ``REPORT`` (tests/
test_gpu_dry_run.py reads both without importing the script). Without CUDA a script records each check as
``SKIP no CUDA`` and exits 0 (:func:`start`), before importing anything heavier than torch, so that the dry mode
of run_all.sh is quick. ``--rehearse`` runs the same code on the CPU with small shapes instead: not a figure
of anything, only a way to exercise the scripts' code on a machine without a GPU before a device run
(CUDA-only measurements are skipped with a note).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for path in (ROOT, HERE, ROOT / "tests"):  # mlora (not installed on the device), report.py, peft_refs.py
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from report import Report  # noqa: E402

# A ~1B-parameter Llama (1.1B with untied embeddings): the shape of issue 22's throughput figure.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
# Its stand-in under --rehearse: the same structure (GQA 4:1, gated MLP 4x, untied), CPU-sized.
LLAMA_1B_REHEARSAL = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=1, vocab_size=4000, max_position_embeddings=512)


def rehearsing() -> bool:
    return "--rehearse" in sys.argv[1:]


def start(report_name: str, checks: tuple[str, ...]) -> tuple[Report, torch.device]:
    """The report and the device. Without CUDA (and without ``--rehearse``): every check is recorded as skipped
    with "no CUDA" and the process exits 0."""
    report = Report(report_name)
    if rehearsing():
        print(f"{report_name}: REHEARSAL on the CPU with small shapes; no figure below is a GPU figure", flush=True)
        return report, torch.device("cpu")
    if not torch.cuda.is_available():
        for check in checks:
            report.skip(check, "no CUDA")
        sys.exit(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 in every comparison below
    torch.backends.cudnn.allow_tf32 = False
    print(f"{report_name}: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}",
          flush=True)
    return report, torch.device("cuda")


def finish(report: Report) -> None:
    """Exit 1 when a check failed (its goal missed or it raised), else 0."""
    sys.exit(1 if report.failed else 0)


def work_dir() -> Path:
    """Where the random models are written, shared by the scripts of one run_all.sh run (``MLORA_GPU_WORK``)."""
    path = Path(os.environ.get("MLORA_GPU_WORK") or Path(tempfile.gettempdir()) / "mlora_gpu_work")
    path.mkdir(parents=True, exist_ok=True)
    return path


def tiny_llama() -> Path:
    """The tests' tiny random Llama (mlora.testing: GQA, llama3 RoPE, sharded safetensors), built once per run."""
    from mlora.testing import build_tiny_model

    path = work_dir() / "tiny-llama"
    if not (path / "config.json").exists():
        build_tiny_model("llama", path)
    return path


def llama_1b(device: torch.device) -> Path:
    """A random ~1B-shaped Llama in bf16 (std 0.02, transformers' initialisation), built once per run; on a GPU it
    is initialised there (seconds, not a minute of CPU init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = LLAMA_1B_REHEARSAL if rehearsing() else LLAMA_1B
    path = work_dir() / ("llama-1b-rehearsal" if rehearsing() else "llama-1b")
    if (path / "config.json").exists():
        return path
    t0 = time.perf_counter()
    torch.manual_seed(0)
    cfg = LlamaConfig(**shape, tie_word_embeddings=False, rms_norm_eps=1e-5)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tmp.rename(path)  # a script killed mid-write leaves no half model for the next one
    print(f"built {path.name} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters) in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    del model
    return path


def rel_error(got: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor | None = None) -> float:
    """``||got - ref||_F / ||ref||_F`` over the valid (non-padding) positions, in float32: the error of ``got``
    relative to the size of the reference logits, one number for the whole batch."""
    got, ref = got.float().cpu(), ref.float().cpu()
    if valid is not None:
        got, ref = got[valid.cpu()], ref[valid.cpu()]
    return ((got - ref).norm() / ref.norm()).item()


def top1_agreement(got: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor) -> float:
    """Share of valid positions whose argmax token is the same."""
    same = got.float().argmax(-1).cpu() == ref.float().argmax(-1).cpu()
    return same[valid.cpu()].float().mean().item()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def best_time(step, device: torch.device, iters: int) -> float:
    """Best wall time of ``iters`` calls of ``step`` after one warm-up call (kernels chosen, caches filled)."""
    step()
    sync(device)
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best
