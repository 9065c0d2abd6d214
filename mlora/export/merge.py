"""Offline merge of a PEFT LoRA adapter into an HF checkpoint, tensor by tensor.

Peak memory is a few tensors, not the model: each base tensor is read, merged in place
(``W += s·B·A`` in float32 when W is lower precision) and streamed to its output file.
The output keeps the input's file layout, index and side files (config, tokenizer).
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
from mlora.lora.sites import model_sites
from mlora.lora.targets import hf_module_name
from mlora.models.checkpoint_reader import INDEX_FILE, CheckpointReader
from mlora.models.hf_config import load_hf_config, model_spec
from mlora.models.model import SIDE_FILES
from mlora.models.safetensors_writer import SafetensorsWriter


def merge_adapter(base_dir: str | os.PathLike, adapter_dir: str | os.PathLike, out_dir: str | os.PathLike,
                  progress: bool = True) -> Path:
    """Write ``base + adapter`` as an HF checkpoint in ``out_dir``; returns ``out_dir``."""
    base, adapter, out = Path(base_dir), Path(adapter_dir), Path(out_dir)
    if out.resolve() == base.resolve():
        raise ValueError(f"--out {out} is the base directory; choose another directory")
    spec = model_spec(load_hf_config(base))
    cfg = read_peft_config(adapter)
    if not (adapter / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{adapter} has no {ADAPTER_WEIGHTS}")
    with CheckpointReader(base) as reader, CheckpointReader(adapter) as lora:
        modules = peft_modules(lora.entries, spec.num_layers, adapter)
        check_peft_shapes(lora, modules, model_sites(spec, 1), cfg.rank, adapter)
        targets = {f"{hf_module_name(layer, proj)}.weight": (layer, proj) for layer, proj in modules}
        missing = sorted(set(targets) - set(reader.entries))
        if missing:
            raise ValueError(f"the base in {base} lacks weights the adapter adapts: {missing[:3]}")
        files: dict[Path, list[str]] = {}
        for name, entry in sorted(reader.entries.items(), key=lambda kv: (kv[1].file, kv[1].offset)):
            files.setdefault(entry.file, []).append(name)
        out.mkdir(parents=True, exist_ok=True)
        bar = _progress(sum(len(v) for v in files.values()), progress)
        for file, names in files.items():
            layout = {n: (reader.entries[n].dtype, reader.entries[n].shape) for n in names}
            writer = SafetensorsWriter(out / file.name, layout, metadata={"format": "pt"})
            try:
                for name in names:
                    tensor = reader.read(name)
                    if name in targets:
                        layer, proj = targets[name]
                        a = lora.read(peft_tensor_name(layer, proj, "A")).float()
                        b = lora.read(peft_tensor_name(layer, proj, "B")).float()
                        merged = tensor if tensor.dtype == torch.float32 else tensor.float()
                        merged.addmm_(b, a, alpha=cfg.scaling)
                        tensor = merged.to(tensor.dtype)
                    writer.write(name, tensor)
                    del tensor
                    bar.update(1)
            except BaseException:
                writer.abort()
                raise
            writer.close()
        bar.close()
    if (base / INDEX_FILE).is_file():
        shutil.copyfile(base / INDEX_FILE, out / INDEX_FILE)
    for name in SIDE_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, out / name)
    (out / "mlora_merge.json").write_text(json.dumps(
        {"base": str(base), "adapter": str(adapter), "r": cfg.rank, "lora_alpha": cfg.alpha,
         "merged_modules": len(modules)}, indent=2))
    return out


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="tensor", desc="merge", disable=not enabled)
