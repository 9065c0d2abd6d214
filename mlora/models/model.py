"""MLoraModel: this rank's shard of a frozen HF decoder on megatron-core, with the mlora API."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from mlora.models.attention import attention_mask as build_attention_mask
from mlora.models.hf_config import ModelSpec
from mlora.models.safetensors_writer import SafetensorsWriter
from mlora.models.weight_map import is_export_copy, stage_param_maps
from mlora.parallel.mesh import Mesh

# Files copied verbatim from the source checkpoint by save_merged.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
              "chat_template.jinja")


class MLoraModel(torch.nn.Module):
    """The frozen base of one rank (a megatron ``GPTModel`` shard) and its facade.

    Build it with :func:`mlora.from_pretrained`.
    """

    def __init__(self, gpt: torch.nn.Module, spec: ModelSpec, mesh: Mesh, hf_dir: Path, dtype: torch.dtype,
                 bytes_read: int = 0) -> None:
        super().__init__()
        self.gpt = gpt
        self.spec = spec
        self.mesh = mesh
        self.hf_dir = Path(hf_dir)
        self.dtype = dtype
        self.bytes_read = bytes_read  # checkpoint bytes this rank read while loading

    @property
    def config(self):
        """The megatron TransformerConfig."""
        return self.gpt.config

    # ------------------------------------------------------------------ forward
    def _prepare(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.spec.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.spec.vocab_size}); got "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        batch, seq = input_ids.shape
        pad = (-seq) % self.mesh.tp if self.mesh.sp else 0
        if pad:  # sequence parallel splits tokens over TP: right-pad, causal attention keeps the rest exact
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            if attention_mask is not None:
                attention_mask = torch.nn.functional.pad(attention_mask, (0, pad))
        device = self.mesh.device
        ids = input_ids.to(device)
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
        mask = build_attention_mask(batch, ids.shape[1], attention_mask, self.spec.sliding_window, device)
        return ids, positions, mask, seq

    def _forward_stage(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Run the pipeline (megatron's schedule, forward only); vocab-parallel logits on the last stage."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        ids, positions, mask, seq = self._prepare(input_ids, attention_mask)

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            return model(batch["ids"], batch["positions"], batch["mask"]), None

        seq_len = ids.shape[1] // (self.mesh.tp if self.mesh.sp else 1)
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([{"ids": ids, "positions": positions, "mask": mask}]),
            model=self.gpt,
            num_microbatches=1,
            seq_length=seq_len,
            micro_batch_size=ids.shape[0],
            forward_only=True,
        )
        if not self.mesh.is_last_stage:
            return None
        return outputs[0][:, :seq]

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Full-vocabulary logits ``[batch, seq, vocab_size]`` on the last PP stage, None elsewhere.

        Logits are gathered over TP and cut to the HF vocabulary (padding rows never show).
        With a right-padded batch and HF's ``attention_mask``, non-pad positions equal HF's.
        """
        local = self._forward_stage(input_ids, attention_mask)
        if local is None:
            return None
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        return gather_from_tensor_model_parallel_region(local)[..., : self.spec.vocab_size].float()

    # ------------------------------------------------------------------ export
    def _hf_tensors(self, adapters: Iterable[str]) -> Iterable[tuple[str, torch.Tensor]]:
        """This stage's HF tensors, gathered over TP one parameter at a time (collective over TP)."""
        params = dict(self.gpt.named_parameters())
        group = self.mesh.tp_group
        for pm in stage_param_maps(self.spec, self.mesh.pp, self.mesh.pp_rank):
            if is_export_copy(pm, self.spec):
                continue
            local = params[pm.megatron_name].detach()
            if self.mesh.tp > 1 and pm.kind != "replicated":
                shards = [torch.empty_like(local) for _ in range(self.mesh.tp)]
                dist.all_gather(shards, local.contiguous(), group=group)
            else:
                shards = [local]
            yield from pm.to_hf([s.cpu() for s in shards], self.spec).items()

    def _hf_layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        layout = {}
        for pm in stage_param_maps(self.spec, self.mesh.pp, self.mesh.pp_rank):
            if not is_export_copy(pm, self.spec):
                for name, shape in pm.hf_shapes(self.spec).items():
                    layout[name] = (self.dtype, shape)
        return layout

    def save_merged(self, out_dir: str | os.PathLike, adapters: Iterable[str] = ()) -> None:
        """Write an HF checkpoint from the shards (collective: call on every rank).

        One safetensors file per pipeline stage (``model.safetensors`` when PP is 1) plus
        ``model.safetensors.index.json``, config and tokenizer files copied from the source.
        Each stage streams its tensors, gathered over TP one at a time.
        """
        adapters = list(adapters)
        known = sorted(getattr(self, "adapters", {}) or {})
        unknown = [a for a in adapters if a not in known]
        if unknown:
            raise ValueError(f"unknown adapters {unknown}; this model has {known or 'no adapters'}")
        out = Path(out_dir)
        pp, stage = self.mesh.pp, self.mesh.pp_rank
        file_name = "model.safetensors" if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"
        writer_rank = self.mesh.tp_rank == 0 and self.mesh.dp_rank == 0
        layout = self._hf_layout()
        if self.mesh.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        if self.mesh.dp_rank == 0:
            writer = SafetensorsWriter(out / file_name, layout) if writer_rank else None
            try:
                for name, tensor in self._hf_tensors(adapters):
                    if writer is not None:
                        writer.write(name, tensor.to(self.dtype))
            except BaseException:
                if writer is not None:
                    writer.abort()
                raise
            if writer is not None:
                writer.close()
        # Stage layouts go to rank 0 for the index.
        layouts: list = [None] * self.mesh.world_size
        dist.all_gather_object(layouts, (file_name, layout) if writer_rank else None)
        if self.mesh.rank == 0:
            weight_map, total = {}, 0
            for item in filter(None, layouts):
                fname, lay = item
                for name, (dtype, shape) in lay.items():
                    weight_map[name] = fname
                    total += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            tmp = out / "model.safetensors.index.json.tmp"
            tmp.write_text(json.dumps(index, indent=2))
            os.replace(tmp, out / "model.safetensors.index.json")
            for name in SIDE_FILES:
                if (self.hf_dir / name).is_file():
                    shutil.copyfile(self.hf_dir / name, out / name)
        dist.barrier()
