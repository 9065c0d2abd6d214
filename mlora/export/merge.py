"""Offline merge of a PEFT LoRA adapter into an HF checkpoint, tensor by tensor.

Peak memory is a few tensors, not the model: each base tensor is read, merged in place
(``W += s·B·A`` in float32 when W is lower precision) and streamed to its output file.
The output keeps the input's file layout (which tensor goes in which file), side files (config,
tokenizer) and an index (``model.safetensors.index.json``) that lists exactly the tensors written.

A Hub FP8 base (block-quantized e4m3 with ``weight_scale_inv``, :mod:`mlora.formats.fp8_checkpoint`)
is written as a plain, *unquantized* checkpoint: every FP8 weight -- merged or not -- is dequantized
with its block scales (``fp8 · scale`` exactly, in float32), the merged ones get ``s·B·A`` added in
float32, and all are stored in the checkpoint's declared ``torch_dtype`` (bfloat16 for the Hub's
releases; bfloat16 when none is declared); the ``*_scale_inv`` tensors are dropped and
``quantization_config`` is removed from ``config.json``. Why not keep the unmerged weights in FP8
and list the merged ones in ``modules_to_not_convert``: (1) requantizing ``W + s·B·A`` to e4m3 would
round away most of a LoRA delta (e4m3 steps are ~6% of a value), which is what the merge is for;
(2) a checkpoint that mixes FP8 and unquantized projections of one fused vLLM layer (q/k/v,
gate/up) is rejected or mishandled by readers unless every projection of the fusion is merged;
(3) an unquantized checkpoint loads anywhere (transformers on CPU, vLLM, mlora) with no FP8
support. The cost is the size: the merged checkpoint is about twice the FP8 one. An engine can
still run it in FP8 by quantizing on load (vLLM's ``quantization="fp8"``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from mlora.export.peft_files import (
    ADAPTER_WEIGHTS,
    check_peft_shapes,
    peft_modules,
    peft_tensor_name,
    read_peft_config,
)
from mlora.formats.checkpoint_reader import INDEX_FILE, SIDE_FILES, CheckpointError, CheckpointReader
from mlora.formats.fp8_checkpoint import SCALE_SUFFIX, fp8_quantization_config, read_dequantized
from mlora.formats.hf_config import load_hf_config, model_spec
from mlora.formats.safetensors_writer import Layout, SafetensorsWriter
from mlora.lora.sites import model_sites
from mlora.lora.targets import attention_projections, expert_of, hf_module_name

_DECLARED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def merge_adapter(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike, out_dir: str | os.PathLike,
                  progress: bool = True) -> Path:
    """Write ``base + adapter`` as an HF checkpoint in ``out_dir``; returns ``out_dir``.

    A Hub FP8 base comes out dequantized (module docstring): no ``*_scale_inv`` tensors, no
    ``quantization_config``, FP8 weights in the checkpoint's declared dtype with the deltas added."""
    base, adapter, out = Path(base_dir), Path(adapter_dir), Path(out_dir)
    if out.resolve() == base.resolve():
        raise ValueError(f"--out {out} is the base directory; choose another directory")
    spec = model_spec(load_hf_config(base))
    hf_config = json.loads((base / "config.json").read_text())
    quant = fp8_quantization_config(hf_config)  # None, or the block size; ValueError for other methods
    fp8_dtype = dequantized_dtype(hf_config) if quant else None
    cfg = read_peft_config(adapter)
    if not (adapter / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{adapter} has no {ADAPTER_WEIGHTS}")
    with CheckpointReader(base) as reader, CheckpointReader(adapter) as lora:
        modules = peft_modules(lora.entries, spec.num_layers, adapter, spec.moe, attention_projections(spec))
        check_peft_shapes(lora, modules, model_sites(spec, 1), cfg, adapter)
        targets = {f"{hf_module_name(layer, proj)}.weight": (layer, proj) for layer, proj in modules}
        missing = sorted(set(targets) - set(reader.entries))
        if missing:
            raise ValueError(f"the base in {base} lacks weights the adapter adapts: {missing[:3]}")
        files = output_layout(reader, fp8_dtype)

        def read(name: str) -> torch.Tensor:
            if fp8_dtype is not None and reader.entry(name).dtype == torch.float8_e4m3fn:
                return read_dequantized(reader, name, block=quant["weight_block_size"])  # float32
            return reader.read(name)

        out.mkdir(parents=True, exist_ok=True)
        bar = _progress(sum(len(v) for v in files.values()), progress)
        for file, layout in files.items():
            writer = SafetensorsWriter(out / file, layout, metadata={"format": "pt"})
            try:
                for name, (dtype, _) in layout.items():
                    tensor = read(name)
                    if name in targets:
                        layer, proj = targets[name]
                        a = lora.read(peft_tensor_name(layer, proj, "A")).float()
                        b = lora.read(peft_tensor_name(layer, proj, "B")).float()
                        merged = tensor if tensor.dtype == torch.float32 else tensor.float()
                        merged.addmm_(b, a, alpha=cfg.scaling_of(expert_of(proj) is not None))
                        tensor = merged
                    writer.write(name, tensor.to(dtype))
                    del tensor
                    bar.update(1)
            except BaseException:
                writer.abort()
                raise
            writer.close()
        bar.close()
    if (base / INDEX_FILE).is_file():
        index = json.loads((base / INDEX_FILE).read_text())
        (out / INDEX_FILE).write_text(json.dumps(merged_index(index, files), indent=2))
    for name in SIDE_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
    if quant:
        unquantized = {k: v for k, v in hf_config.items() if k != "quantization_config"}
        (out / "config.json").write_text(json.dumps(unquantized, indent=2, sort_keys=True) + "\n")
    (out / "mlora_merge.json").write_text(json.dumps(
        {"base": str(base), "adapter": str(adapter), "r": cfg.rank, "expert_r": cfg.expert_rank,
         "lora_alpha": cfg.alpha, "merged_modules": len(modules),
         "dequantized_fp8": None if fp8_dtype is None else str(fp8_dtype).removeprefix("torch.")}, indent=2))
    return out


def dequantized_dtype(hf_config: dict) -> torch.dtype:
    """The dtype a dequantized FP8 weight is written in: the checkpoint's declared ``torch_dtype``
    (``dtype`` in newer configs) -- the dtype of its unquantized tensors -- else bfloat16."""
    declared = hf_config.get("torch_dtype", hf_config.get("dtype"))
    return _DECLARED_DTYPES.get(str(declared).removeprefix("torch."), torch.bfloat16)


def output_layout(reader: CheckpointReader, fp8_dtype: torch.dtype | None) -> dict[str, Layout]:
    """Output file name -> its layout (name -> (dtype, shape), in the base's on-disk order).

    ``fp8_dtype`` None: every tensor as in the base. Otherwise (a Hub FP8 base) each float8_e4m3fn
    weight becomes ``fp8_dtype`` and its ``<name>_scale_inv`` is dropped; an FP8 tensor without its
    scales is an error before anything is written. A file left with no tensors is not written."""
    files: dict[str, Layout] = {}
    dropped = set()
    if fp8_dtype is not None:
        for name, entry in reader.entries.items():
            if entry.dtype == torch.float8_e5m2:
                raise CheckpointError(f"{name} in {reader.directory} is float8_e5m2: only block-quantized e4m3 "
                                      "weights can be dequantized for the merge")
            if entry.dtype == torch.float8_e4m3fn:
                if name + SCALE_SUFFIX not in reader.entries:
                    raise CheckpointError(f"{name} in {reader.directory} is float8_e4m3fn without "
                                          f"{name + SCALE_SUFFIX}: cannot dequantize it for the merge")
                dropped.add(name + SCALE_SUFFIX)
    for name, entry in sorted(reader.entries.items(), key=lambda kv: (kv[1].file, kv[1].offset)):
        if name in dropped:
            continue
        dtype = fp8_dtype if fp8_dtype is not None and entry.dtype == torch.float8_e4m3fn else entry.dtype
        files.setdefault(entry.file.name, {})[name] = (dtype, tuple(entry.shape))
    return files


def merged_index(base_index: dict, files: dict[str, Layout]) -> dict:
    """The base's ``model.safetensors.index.json`` rewritten for the written files: ``weight_map``
    lists exactly the written tensors (base order), ``metadata.total_size`` their bytes."""
    where = {name: file for file, layout in files.items() for name in layout}
    total = sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                for layout in files.values() for dtype, shape in layout.values())
    order = [n for n in base_index.get("weight_map", {}) if n in where]
    order += sorted(set(where) - set(order))
    return {**base_index, "metadata": {**base_index.get("metadata", {}), "total_size": total},
            "weight_map": {n: where[n] for n in order}}


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="tensor", desc="merge", disable=not enabled)
