"""Build this rank's megatron shard and fill it from an HF checkpoint (what :func:`mlora.from_pretrained` wraps)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from mlora.formats.checkpoint_reader import CheckpointError, CheckpointReader
from mlora.formats.fp8_checkpoint import DequantizingReader, fp8_quantization_config
from mlora.formats.fused_experts import expose_unfused_experts
from mlora.formats.hf_config import ModelSpec, check_layout, load_hf_config, model_spec
from mlora.formats.weight_map import stage_layers, stage_param_maps
from mlora.lora.config import master_dtype
from mlora.models.megatron_build import build_gpt_model, check_fp8_shapes
from mlora.models.recompute import recompute_settings
from mlora.parallel.mesh import Mesh


@dataclass
class LoadedShard:
    """What :func:`load_shard` built: this rank's megatron ``GPTModel`` shard, the model spec, the
    checkpoint bytes this rank read and the FP8 backend (None, "torch" or "te")."""

    gpt: torch.nn.Module
    spec: ModelSpec
    bytes_read: int
    fp8: str | None


def load_shard(hf_dir: str | os.PathLike, mesh: Mesh, dtype: torch.dtype = torch.float32,
               fp8: str | None = None, fp8_recipe: str = "delayed", attention: str = "sdpa",
               recompute: str = "none", recompute_method: str | None = None,
               recompute_num_layers: int | None = None,
               recompute_modules: Sequence[str] | None = None,
               lora_compute_dtype: torch.dtype | None = None) -> LoadedShard:
    """This rank's frozen megatron shard of the HF model in ``hf_dir`` on ``mesh``, filled from the
    checkpoint: every argument is checked before any I/O, each rank reads only its stage's tensors and
    its TP slices of them. The arguments are :func:`mlora.from_pretrained`'s (which wraps the result in
    :class:`mlora.MLoraModel`); ``lora_compute_dtype`` is only checked here."""
    from mlora.fp8.quant import check_adapter_dtype, check_fp8_arg
    from mlora.models.attention import check_attention_arg

    check_attention_arg(attention)
    fp8 = check_fp8_arg(fp8)
    check_adapter_dtype(dtype)
    if lora_compute_dtype is not None and lora_compute_dtype not in (dtype, master_dtype(dtype)):
        raise ValueError(f"lora_compute_dtype={lora_compute_dtype} on a {dtype} base: valid are "
                         f"{master_dtype(dtype)} (the adapters' float32 masters, the default) or {dtype} (the base's)")
    if fp8 == "te":
        from mlora.models.te import require_te  # written alongside; fails naming the `gpu` extra without TE

        require_te(recipe=fp8_recipe)
    elif fp8 == "torch":
        from mlora.fp8.quant import require_scaled_mm

        require_scaled_mm(mesh.device, dtype)
    recompute_settings(recompute, recompute_method, recompute_num_layers, recompute_modules)  # before any I/O
    spec = model_spec(load_hf_config(hf_dir))
    check_layout(spec, mesh.tp, mesh.pp, mesh.ep)
    if fp8 is not None and spec.moe is not None:
        raise ValueError(f"fp8={fp8!r} on {spec.architecture}, a mixture of experts: FP8 experts are not built yet; "
                         "use fp8=None")
    if fp8 == "te" and spec.qk_norm is not None:
        raise ValueError(f"fp8='te' on {spec.architecture}: the Transformer Engine spec has no q/k norm slot in mlora "
                         "yet; use fp8='torch' or None")
    if spec.moe is not None and mesh.tp > 1 and not mesh.sp:
        raise ValueError(f"{spec.architecture} is a mixture of experts: at tp={mesh.tp} megatron's MoE layer needs "
                         "sequence parallelism (init_parallel(..., sp=True); in a run "
                         "trainer.policy.megatron_config.sequence_parallel=true)")
    if fp8 == "torch":  # CUDA's _scaled_mm refuses K or N off multiples of 16: say so now, not at the first forward
        check_fp8_shapes(spec, mesh.tp, mesh.device)
    settings = recompute_settings(recompute, recompute_method, recompute_num_layers, recompute_modules,
                                  layers_per_stage=spec.num_layers // mesh.pp)
    # a Hub FP8 checkpoint (block-scaled e4m3): read dequantized, slice by slice (mlora.formats.fp8_checkpoint)
    quantized = fp8_quantization_config(json.loads((Path(hf_dir) / "config.json").read_text()))
    with CheckpointReader(hf_dir) as reader:  # validate the files before allocating anything
        # transformers 5's fused experts (save_original_format=False): each expert's slices, read in place
        expose_unfused_experts(reader, spec)
        source = reader if quantized is None else DequantizingReader(reader, quantized["weight_block_size"])
        maps = stage_param_maps(spec, mesh.pp, mesh.pp_rank, mesh.ep, mesh.ep_rank)
        missing = [n for pm in maps for n in pm.hf_names if n not in reader]
        if missing:
            raise CheckpointError(f"{Path(hf_dir)} lacks tensors the model needs: {', '.join(missing[:5])}"
                                  + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
        wrong = [f"{name} is {reader.entry(name).shape}, config.json implies {shape}"
                 for pm in maps for name, shape in pm.hf_shapes(spec).items() if reader.entry(name).shape != shape]
        if wrong:
            raise CheckpointError(f"{Path(hf_dir)} does not match its config: " + "; ".join(wrong[:3]))
        gpt = build_gpt_model(spec, mesh, dtype, fp8=fp8, fp8_recipe=fp8_recipe, attention=attention,
                              recompute=settings)
        local_layers = [layer.layer_number - 1 for layer in gpt.decoder.layers]
        expected = list(stage_layers(spec, mesh.pp, mesh.pp_rank))
        if local_layers != expected:  # our HF mapping and megatron must agree on who holds which layer
            raise RuntimeError(
                f"megatron placed layers {local_layers} on stage {mesh.pp_rank}, mlora expected {expected}")
        params = dict(gpt.named_parameters())
        modules = dict(gpt.named_modules())
        for pm in maps:
            param = params.pop(pm.megatron_name)
            shard = pm.load(source, spec, mesh.tp, mesh.tp_rank)
            if shard.shape != param.shape:
                raise CheckpointError(f"{pm.hf_names} give a shard of shape {tuple(shard.shape)} for "
                                      f"{pm.megatron_name}, which has shape {tuple(param.shape)}")
            with torch.no_grad():
                if param.dtype == torch.float8_e4m3fn:
                    _load_fp8(param, modules[pm.megatron_name.rsplit(".", 1)[0]], shard, mesh)
                else:  # into the parameter's dtype: ``dtype``, or float32 where kept so (a router's expert bias)
                    param.copy_(shard)
            del shard
        if params:
            raise RuntimeError(f"parameters without an HF mapping: {sorted(params)}")
        bytes_read = reader.bytes_read
    return LoadedShard(gpt, spec, bytes_read, fp8)


def _load_fp8(param: torch.nn.Parameter, linear: torch.nn.Module, shard: torch.Tensor, mesh: Mesh) -> None:
    """Quantize this rank's shard of a frozen linear into ``param`` (e4m3) and ``linear.weight_scale``.

    A row-parallel linear holds a slice of every row: the per-row amax is all-reduced MAX over TP
    so that the scale covers the whole unsharded row (collective over TP)."""
    from megatron.core.tensor_parallel import RowParallelLinear

    from mlora.fp8.quant import quantize_weight

    group = mesh.tp_group if isinstance(linear, RowParallelLinear) and mesh.tp > 1 else None
    q, scale = quantize_weight(shard.to(param.device), group=group)
    param.copy_(q)
    linear.weight_scale.copy_(scale)
