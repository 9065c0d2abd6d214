"""from_pretrained: build this rank's megatron shard and fill it from an HF checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mlora.models.checkpoint_reader import CheckpointError, CheckpointReader
from mlora.models.hf_config import check_layout, load_hf_config, model_spec
from mlora.models.megatron_build import build_gpt_model
from mlora.models.model import MLoraModel
from mlora.models.weight_map import stage_layers, stage_param_maps
from mlora.parallel.mesh import Mesh


def from_pretrained(hf_dir: str | os.PathLike, mesh: Mesh, dtype: torch.dtype = torch.float32) -> MLoraModel:
    """This rank's shard of the HF model in ``hf_dir``, frozen, on ``mesh``.

    Supports LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM from safetensors
    (single file or sharded with ``model.safetensors.index.json``). Each rank reads only the
    tensors of its pipeline stage and only its TP slices of them.
    """
    spec = model_spec(load_hf_config(hf_dir))
    check_layout(spec, mesh.tp, mesh.pp)
    with CheckpointReader(hf_dir) as reader:  # validate the files before allocating anything
        maps = stage_param_maps(spec, mesh.pp, mesh.pp_rank)
        missing = [n for pm in maps for n in pm.hf_names if n not in reader]
        if missing:
            raise CheckpointError(f"{Path(hf_dir)} lacks tensors the model needs: {', '.join(missing[:5])}"
                                  + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        wrong = [f"{name} is {reader.entry(name).shape}, config.json implies {shape}"
                 for pm in maps for name, shape in pm.hf_shapes(spec).items() if reader.entry(name).shape != shape]
        if wrong:
            raise CheckpointError(f"{Path(hf_dir)} does not match its config: " + "; ".join(wrong[:3]))
        gpt = build_gpt_model(spec, mesh, dtype)
        local_layers = [layer.layer_number - 1 for layer in gpt.decoder.layers]
        expected = list(stage_layers(spec, mesh.pp, mesh.pp_rank))
        if local_layers != expected:  # our HF mapping and megatron must agree on who holds which layer
            raise RuntimeError(
                f"megatron placed layers {local_layers} on stage {mesh.pp_rank}, mlora expected {expected}")
        params = dict(gpt.named_parameters())
        for pm in maps:
            param = params.pop(pm.megatron_name)
            shard = pm.load(reader, spec, mesh.tp, mesh.tp_rank)
            if shard.shape != param.shape:
                raise CheckpointError(f"{pm.hf_names} give a shard of shape {tuple(shard.shape)} for "
                                      f"{pm.megatron_name}, which has shape {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(shard.to(dtype))
        if params:
            raise RuntimeError(f"parameters without an HF mapping: {sorted(params)}")
        bytes_read = reader.bytes_read
    return MLoraModel(gpt, spec, mesh, Path(hf_dir), dtype, bytes_read=bytes_read).eval()  # like HF: eval mode
