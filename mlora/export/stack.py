"""Stacked LoRA adapters as one PEFT adapter: the exact sum of their updates, for servers that take one adapter.

An adapter trained on top of a frozen one (``trainer.policy.model.frozen_adapter_path``, e.g. RLHF over SFT) is
served with the frozen one underneath. vLLM applies one LoRA adapter per request, so the pair is written as one
adapter whose update is their sum: per module ``A = [A_1; A_2; ...]`` (rank ``r_1 + r_2 + ...``) and
``B = [s_1·B_1, s_2·B_2, ...]`` with each adapter's scaling ``s_i`` (``alpha/r``, or ``alpha/sqrt(r)`` with
rsLoRA) folded into its block and the stacked adapter's own scaling 1 (``lora_alpha`` = its rank). Then
``B·A = Σ s_i·B_i·A_i``: PEFT and vLLM compute what the stack computes, up to float rounding.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Sequence

import torch

from mlora.export.peft_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, write_peft_adapter

_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])\.weight$")
# adapter_config.json fields a stack cannot carry: each changes what the update is beyond B·A
_REFUSED = {"use_dora": "DoRA rescales the merged weight", "lora_bias": "a LoRA bias is not a B·A update",
            "modules_to_save": "fully trained modules cannot be summed", "bias": "trained biases cannot be summed"}


def _scaling(config: dict, module: str) -> tuple[int, float]:
    """(rank, scaling) of ``module`` under a PEFT config, its rank_pattern and alpha_pattern (PEFT's matching:
    a pattern key matches a module name ending in it)."""
    def pattern(name: str, default):
        for key, value in (config.get(name) or {}).items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    r = int(pattern("rank_pattern", config["r"]))
    alpha = float(pattern("alpha_pattern", config["lora_alpha"]))
    return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def _read(adapter: Path) -> tuple[dict, dict[str, dict[str, torch.Tensor]]]:
    from safetensors.torch import load_file

    if not (adapter / ADAPTER_CONFIG).is_file() or not (adapter / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{adapter}: not a PEFT adapter directory (needs {ADAPTER_CONFIG} and "
                                f"{ADAPTER_WEIGHTS})")
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{adapter}: peft_type {config.get('peft_type')!r}; only LoRA adapters can be stacked")
    for key, why in _REFUSED.items():
        if config.get(key) not in (None, False, "none", [], {}):
            raise ValueError(f"{adapter}: {key}={config[key]!r} cannot be stacked ({why})")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(adapter / ADAPTER_WEIGHTS).items():
        m = _KEY.match(name)
        if m is None:
            raise ValueError(f"{adapter}: tensor {name!r} is not a LoRA A or B weight (embedding LoRA and other "
                             f"tensors cannot be stacked)")
        modules.setdefault(m["module"], {})[m["factor"]] = tensor
    return config, modules


def stack_adapters(adapters: Sequence[str | os.PathLike], out_dir: str | os.PathLike) -> Path:
    """Write one PEFT adapter to ``out_dir`` whose update is the sum of ``adapters``' (PEFT LoRA directories of one
    base and task type, bottom first); returns ``out_dir``. See the module docstring."""
    if len(adapters) < 2:
        raise ValueError(f"stack_adapters needs at least two adapters, got {len(adapters)}")
    read = [(Path(a), *_read(Path(a))) for a in adapters]
    first = read[0][1]
    for path, config, _ in read[1:]:
        for key in ("task_type", "base_model_name_or_path"):
            if config.get(key) != first.get(key):
                raise ValueError(f"{path}: {key}={config.get(key)!r}, but {read[0][0]} has {first.get(key)!r}: "
                                 f"stacked adapters must be of one base and task")
    tensors, ranks = {}, {}
    for module in sorted(set().union(*(m for _, _, m in read))):
        a_blocks, b_blocks = [], []
        for path, config, mods in read:
            if module not in mods:
                continue
            pair = mods[module]
            if set(pair) != {"A", "B"}:
                raise ValueError(f"{path}: module {module!r} has lora_{'A' if 'A' in pair else 'B'} only")
            r, s = _scaling(config, module)
            if pair["A"].shape[0] != r or pair["B"].shape[1] != r:
                raise ValueError(f"{path}: module {module!r} has A {tuple(pair['A'].shape)} and B "
                                 f"{tuple(pair['B'].shape)}, not rank {r} as its adapter_config.json says")
            a_blocks.append(pair["A"])
            b_blocks.append(pair["B"] * s)
        shapes = {(a.shape[1], b.shape[0]) for a, b in zip(a_blocks, b_blocks)}
        if len(shapes) != 1:
            raise ValueError(f"module {module!r}: the adapters' (in, out) shapes differ: {sorted(shapes)}")
        tensors[f"{module}.lora_A.weight"] = torch.cat(a_blocks, 0).contiguous()
        tensors[f"{module}.lora_B.weight"] = torch.cat(b_blocks, 1).contiguous()
        ranks[module] = sum(a.shape[0] for a in a_blocks)
    r = max(set(ranks.values()), key=list(ranks.values()).count)  # the most common; the others by pattern
    # PEFT matches a pattern key as a suffix of the module's name under the model (drop PEFT's prefix)
    other = {m.removeprefix("base_model.model."): k for m, k in ranks.items() if k != r}
    targets = _targets([c for _, c, _ in read])
    config = {**first, "r": r, "lora_alpha": r, "rank_pattern": other, "alpha_pattern": dict(other),
              "use_rslora": False, "lora_dropout": 0.0, "target_modules": targets, "inference_mode": True}
    return write_peft_adapter(out_dir, tensors, config)


def _targets(configs: list[dict]) -> str | list[str]:
    """The stacked adapter's ``target_modules``: the union of the lists, or the one regex all of them give."""
    given = [c.get("target_modules") for c in configs]
    if any(isinstance(t, str) for t in given):
        if len({str(t) for t in given}) != 1:
            raise ValueError(f"target_modules {given}: adapters given as a regex (or 'all-linear') stack only with "
                             f"the same one")
        return given[0]
    return sorted(set().union(*(set(t or ()) for t in given)))
