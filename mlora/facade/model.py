"""MLoraModel: this rank's shard of a frozen HF decoder on megatron-core, with the mlora API, and
:func:`from_pretrained`, which builds it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from mlora.facade.adapters import AdapterHost
from mlora.formats.checkpoint_reader import SIDE_FILES  # copied verbatim from the source by save_merged
from mlora.formats.fused_experts import fuse_gpt_oss_experts, gpt_oss_layout
from mlora.formats.hf_config import ModelSpec
from mlora.formats.safetensors_writer import SafetensorsWriter
from mlora.formats.weight_map import ParamMap, is_export_copy, stage_param_maps
from mlora.lora.config import master_dtype
from mlora.lora.routing import Route, check_rows, expert_routing, routed, row_route, sequence_route
from mlora.models.attention import SDPAttention, is_right_padded, sdpa_mask
from mlora.models.attention import attention_mask as build_attention_mask
from mlora.models.loader import load_shard
from mlora.parallel.mesh import Mesh


class ScalarHead(torch.nn.Linear):
    """A ``[hidden] -> 1`` head (value, reward score) in float32 under a 16-bit base: it trains like the
    adapters (float32 master weights and AdamW state) and reads the hidden states upcast."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden.to(self.weight.dtype))


class MLoraModel(AdapterHost, torch.nn.Module):
    """The frozen base of one rank (a megatron ``GPTModel`` shard), its adapters, and the facade.

    Build it with :func:`mlora.from_pretrained`. Adapter methods (``add_adapter``,
    ``load_adapter``, ``use_adapters`` ...) come from :class:`mlora.facade.adapters.AdapterHost`.
    """

    def __init__(self, gpt: torch.nn.Module, spec: ModelSpec, mesh: Mesh, hf_dir: Path, dtype: torch.dtype,
                 bytes_read: int = 0, fp8: str | None = None, lora_compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.lora_compute_dtype = lora_compute_dtype or master_dtype(dtype)
        self.fp8 = fp8  # None, "torch" or "te": how the frozen linears are stored and multiplied
        self.gpt = gpt
        self.spec = spec
        self.mesh = mesh
        self.hf_dir = Path(hf_dir)
        self.dtype = dtype
        self.bytes_read = bytes_read  # checkpoint bytes this rank read while loading
        self.adapters = {}
        self._active: tuple[str, ...] | None = None  # None: every adapter, in the order added
        self.heads = torch.nn.ModuleDict()  # scalar heads (value, reward) on the last stage only
        # The mask convention follows the modules actually built (a patched spec included): SDPA
        # layers take the minimal mask of sdpa_mask, anything else (megatron's unfused
        # DotProductAttention, TE's, which reads it with attn_mask_type=arbitrary) the full [b, 1, s, s] bool mask.
        self._full_mask = not all(isinstance(layer.self_attention.core_attention, SDPAttention)
                                  for layer in gpt.decoder.layers)

    @property
    def config(self):
        """The megatron TransformerConfig."""
        return self.gpt.config

    # ------------------------------------------------------------------ forward
    def _prepare(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 shared: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """``(ids, positions, mask, seq)`` for megatron's forward: ids and positions on the device
        (right-padded to a multiple of TP under SP and, with ``fp8="te"``, to a token count that TE's FP8
        GEMMs take: :meth:`_padded_length`), the attention mask, the unpadded length.

        ``mask`` is what the core attention of this model takes: with SDPA (the default) None for a
        batch without padding or with right padding only and no window shorter than the sequence
        (SDPA then runs causal), else the smallest additive mask of :func:`sdpa_mask`; with the
        unfused or TE core attention the full ``[b, 1, s, s]`` boolean mask. Logits at padding
        positions are unspecified. A mask that depends on the shape alone (the window) is built once
        per ``shared`` dict, so the micro-batches of one call hold one copy.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")
        self._check_token_ids(input_ids)
        batch, seq = input_ids.shape
        pad = self._padded_length(batch, seq) - seq
        if pad:  # right-pad (SP splits tokens over TP; TE's FP8 shapes): causal attention keeps the rest exact
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            if attention_mask is not None:
                attention_mask = torch.nn.functional.pad(attention_mask, (0, pad))
        device = self.mesh.device
        ids = input_ids.to(device)
        positions = torch.arange(ids.shape[1], device=device).expand_as(ids)
        if self._full_mask:
            mask = build_attention_mask(batch, ids.shape[1], attention_mask, self.spec.sliding_window, device)
        elif attention_mask is None or is_right_padded(attention_mask):  # the mask depends on the shape alone
            shared = {} if shared is None else shared
            key = (ids.shape[1], self.dtype, device)
            if key not in shared:
                shared[key] = sdpa_mask(ids.shape[1], None, self.spec.sliding_window, self.dtype, device)
            mask = shared[key]
        else:
            mask = sdpa_mask(ids.shape[1], attention_mask, self.spec.sliding_window, self.dtype, device)
        return ids, positions, mask, seq

    def _padded_length(self, batch: int, seq: int) -> int:
        """The sequence length a micro-batch of ``batch`` rows of ``seq`` tokens is right-padded to: a multiple
        of TP under sequence parallelism (megatron splits the sequence over TP) and, with ``fp8="te"``, one
        whose token count ``batch * length`` TE's FP8 GEMMs accept (8 per-tensor, 32 MXFP8:
        :func:`mlora.models.te.te_token_multiple`). Padded positions are masked (right padding under causal
        attention: no real token sees them) and their logits dropped."""
        from mlora.models.te import te_padded_length, te_token_multiple

        seq_multiple = self.mesh.tp if self.mesh.sp else 1
        token_multiple = 1
        if self.fp8 == "te" and self.config.fp8:
            token_multiple = te_token_multiple(self.config.fp8_recipe)
        return te_padded_length(batch, seq, seq_multiple, token_multiple)

    def _check_token_ids(self, input_ids: torch.Tensor) -> None:
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.spec.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.spec.vocab_size}); got "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")

    def _prepare_packed(self, micro_batches: Sequence[dict]) -> list[tuple]:
        """Packed micro-batches (``mlora.models.packing``) for megatron's ``thd`` format: each one's
        ``input_ids`` is ``[1, width]`` and ``packed`` its :class:`~mlora.models.packing.PackedRows`. The
        row is right-padded with a padding segment to :meth:`_padded_length` (a multiple of TP under SP,
        TE's FP8 token multiple with ``fp8="te"``) and, with pipeline stages (whose point-to-point buffers
        have one shape per schedule), to the longest of the call."""
        if not all("packed" in mb for mb in micro_batches):
            raise ValueError("either every micro-batch of a call is packed or none is")
        if self._full_mask and self.fp8 != "te":
            raise ValueError("sequence packing needs the fused core attention (attention='sdpa', "
                             "trainer.flash_attn=true) or Transformer Engine's; megatron's unfused attention "
                             "takes no packed sequences")
        widths = [mb["packed"].width for mb in micro_batches]
        common = self._padded_length(1, max(widths))
        device, out = self.mesh.device, []
        for mb, width in zip(micro_batches, widths):
            ids = mb["input_ids"]
            if tuple(ids.shape) != (1, width):
                raise ValueError(f"a packed micro-batch's input_ids must be [1, {width}], got {tuple(ids.shape)}")
            self._check_token_ids(ids)
            target = common if self.mesh.pp > 1 else self._padded_length(1, width)
            packed = mb["packed"].widened(target)
            ids = torch.nn.functional.pad(ids, (0, target - width)).to(device)
            out.append((mb, ids, packed.positions(device), None, width, packed.packed_seq_params(device)))
        return out

    def vocab_shard_range(self) -> tuple[int, int]:
        """Columns ``[start, stop)`` of the real vocabulary held by this TP rank's logits shard."""
        per = self.spec.padded_vocab_size(self.mesh.tp) // self.mesh.tp
        start = self.mesh.tp_rank * per
        return start, max(start, min(start + per, self.spec.vocab_size))

    def add_value_head(self, name: str = "critic", seed: int = 0, init_std: float = 0.0,
                       bias: bool = True) -> torch.nn.Module | None:
        """A scalar head ``[hidden] -> 1`` on the last stage (None elsewhere), trainable.

        Weight ~ N(0, init_std²) from ``seed`` alone (so every mesh builds the same head), bias 0
        (``bias=False``: no bias, like HF's sequence-classification ``score`` head, which a reward
        adapter exports to; see :mod:`mlora.export.reward_adapter`).
        The default 0 starts every value at 0: a random head's values (order 1 per token) would
        swamp small rewards in the whitened advantages until the critic caught up. Every TP rank
        holds the head whole and computes its full gradient from the same hidden states: the
        gradient is summed over DP only and counted once in the grad norm.
        """
        if name in self.heads:
            raise ValueError(f"a head named {name!r} already exists")
        if not self.mesh.is_last_stage:
            return None
        from mlora.lora.layers import mark_tp_replicated

        g = torch.Generator().manual_seed(seed)
        head = ScalarHead(self.spec.hidden_size, 1, bias=bias, dtype=self.adapter_dtype)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=g, dtype=torch.float64) * init_std)
            if bias:
                head.bias.zero_()
        for p in head.parameters():
            mark_tp_replicated(p, partial_grad=False)
        self.heads[name] = head.to(self.mesh.device)
        return self.heads[name]

    @contextlib.contextmanager
    def _hidden_states_output(self):
        """Make the last stage return final hidden states (after the final norm) instead of logits."""
        post = self.gpt.post_process
        self.gpt.post_process = False
        try:
            yield
        finally:
            self.gpt.post_process = post

    def forward_backward(self, micro_batches: Sequence[dict], loss_fn: Callable | None = None,
                         forward_only: bool = False, hidden_states: bool = False) -> list | None:
        """Run micro-batches through megatron's pipeline schedule (collective over TP and PP).

        Each micro-batch is a dict with ``input_ids`` ``[b, s]`` (the same shape for all) and
        optionally ``attention_mask`` plus anything ``loss_fn`` needs; or, packed, ``input_ids``
        ``[1, width]`` and ``packed`` (:class:`mlora.models.packing.PackedRows`), whose per-token
        results ``loss_fn`` brings back to the padded layout with ``packed.unpack``. On the last stage
        ``loss_fn(logits, micro_batch) -> (loss, metrics)`` gets this TP rank's vocab-parallel
        logits ``[b, s, padded_vocab / TP]`` (see :meth:`vocab_shard_range`); ``loss`` is the
        micro-batch's share of the step's loss, and gradients accumulate as the plain sum of
        them. Returns the metrics per micro-batch (or, without ``loss_fn``, the logits) on the
        last stage and None elsewhere. With ``hidden_states`` the last stage hands ``loss_fn`` the
        final hidden states ``[b, s, hidden]`` (whole sequence on every TP rank) instead of logits.

        Mixed-adapter micro-batches: ``adapter_rows`` (``{adapter: row indices}``) restricts active
        adapters to some rows of the micro-batch (padded: rows of ``input_ids``; packed: the sequences in
        ``packed``'s order), e.g. one experiment's adapter per row. The frozen base runs once over all
        rows, each routed adapter's LoRA GEMMs over its rows only (:mod:`mlora.lora.routing`), forward and
        backward. Active adapters not named apply to every row (frozen stacked adapters); one named with
        no rows applies nowhere and gets no gradient from this micro-batch. Every named adapter must be
        active (``use_adapters``) and its rows distinct and in range, else ValueError.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not micro_batches:
            raise ValueError("forward_backward needs at least one micro-batch")
        if any("packed" in mb for mb in micro_batches):
            prepared = self._prepare_packed(micro_batches)
        else:
            shape = tuple(micro_batches[0]["input_ids"].shape)
            for mb in micro_batches:
                if tuple(mb["input_ids"].shape) != shape:
                    raise ValueError(f"all micro-batches must have the same [batch, seq] shape; got {shape} and "
                                     f"{tuple(mb['input_ids'].shape)}")
            shared: dict = {}  # one window mask for all micro-batches (same shape)
            prepared = [(mb, *self._prepare(mb["input_ids"], mb.get("attention_mask"), shared), None)
                        for mb in micro_batches]

        prepared = [(*p, self._routes(p[0])) for p in prepared]
        last = self.mesh.is_last_stage
        # TE linears (fp8="te"): recast the FP8 weights at this call's first micro-batch, as megatron's
        # schedules do (forward_step(is_first_microbatch=i == 0)) -- also when config.fp8 is unset (an external
        # fp8_autocast), where megatron's set_is_first_microbatch does nothing; delayed scaling's scales move
        from mlora.models.te import reset_fp8_weight_cache

        reset_fp8_weight_cache(self.gpt)

        def forward_step(data_iterator, model):
            mb, ids, positions, mask, seq, packed_seq, routes = next(data_iterator)
            with routed(routes):  # this micro-batch's rows of each routed adapter, for its model call only
                if hidden_states and last:
                    with self._hidden_states_output():
                        output = self._batch_major_hidden(model(ids, positions, mask, packed_seq_params=packed_seq))
                else:
                    output = model(ids, positions, mask, packed_seq_params=packed_seq)
            if loss_fn is None:
                return output[:, :seq], None

            def loss_func(output_tensor):
                loss, metrics = loss_fn(output_tensor[:, :seq], mb)
                return loss, torch.tensor(1, dtype=torch.int), metrics

            return output, loss_func

        ids = prepared[0][1]
        with expert_routing(self._expert_routed(prepared)):
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(prepared),
                model=self.gpt,
                num_microbatches=len(prepared),
                seq_length=ids.shape[1],  # megatron divides by TP itself under sequence parallelism
                micro_batch_size=ids.shape[0],
                forward_only=forward_only,
            )
        return outputs if self.mesh.is_last_stage else None

    def _expert_routed(self, prepared: list) -> tuple[str, ...]:
        """The adapters whose routes a MoE base's dispatchers carry in this call (:mod:`mlora.models.moe_routes`):
        every active one when a micro-batch here, or on another rank of this rank's EP group (their all-to-alls
        exchange the same columns), routes adapters; else none."""
        if self.spec.moe is None or not self.active_adapters:
            return ()
        routed_here = any(p[-1] for p in prepared)
        if self.mesh.ep > 1:
            flag = torch.tensor([int(routed_here)], device=self.mesh.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.mesh.ep_group)
            routed_here = bool(flag.item())
        return self.active_adapters if routed_here else ()

    def _routes(self, mb: dict) -> dict[str, Route] | None:
        """The token routes (:mod:`mlora.lora.routing`) of a micro-batch's ``adapter_rows``, checked: only
        restricted adapters (an adapter given every row applies to every token, as if not named); None
        without ``adapter_rows``."""
        rows = mb.get("adapter_rows")
        if rows is None:
            return None
        if not isinstance(rows, Mapping):
            raise ValueError(f"adapter_rows must map adapter names to row indices, got {type(rows).__name__}")
        active = self.active_adapters
        inactive = [name for name in rows if name not in active]
        if inactive:
            raise ValueError(f"adapter_rows names adapters {inactive} that are not active; active: {list(active)} "
                             "(route only adapters inside model.use_adapters(...))")
        packed = mb.get("packed")
        count = len(packed.lengths) if packed is not None else mb["input_ids"].shape[0]
        routes = {}
        for name, picked in rows.items():
            picked = check_rows(picked, count, f"adapter_rows[{name!r}]")
            route = (row_route(picked, count) if packed is None
                     else sequence_route(picked, packed.starts, packed.lengths))
            if route is not None:
                routes[name] = route
        return routes

    def _batch_major_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s(/TP), b, h]`` -> ``[b, s, h]``, gathering the sequence under SP. Every TP rank then
        computes the same head output; the gather's backward keeps (does not sum) the local slice."""
        if self.mesh.sp:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False,
                                                          group=self.mesh.tp_group)
        return hidden.transpose(0, 1)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Full-vocabulary logits ``[batch, seq, vocab_size]`` on the last PP stage, None elsewhere.

        Logits are gathered over TP and cut to the HF vocabulary (padding rows never show).
        With a right-padded batch and HF's ``attention_mask``, non-pad positions equal HF's.
        """
        outputs = self.forward_backward([{"input_ids": input_ids, "attention_mask": attention_mask}],
                                        forward_only=True)
        if outputs is None:
            return None
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        return gather_from_tensor_model_parallel_region(outputs[0])[..., : self.spec.vocab_size].float()

    def parameter_bytes(self) -> dict[str, int]:
        """This rank's ``{"base", "adapters", "heads"}`` in bytes as held in memory.

        ``base``: the frozen parameters of this stage's shard plus the float32 row scales of FP8
        weights (other buffers, e.g. the RoPE frequencies, are not counted); ``adapters``: every
        LoRA factor; ``heads``: the scalar heads."""
        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        base = adapters = 0
        for name, p in self.gpt.named_parameters():
            if ".lora." in f".{name}":
                adapters += nbytes(p)
            else:
                base += nbytes(p)
        for name, b in self.gpt.named_buffers():
            if name.rsplit(".", 1)[-1] == "weight_scale":
                base += nbytes(b)
        heads = sum(nbytes(p) for p in self.heads.parameters())
        return {"base": base, "adapters": adapters, "heads": heads}

    def base_weight(self, linear: torch.nn.Module) -> torch.Tensor:
        """This rank's frozen weight of ``linear`` in ``dtype`` (an FP8 weight dequantized: W_fp8 · scale)."""
        scale = getattr(linear, "weight_scale", None)
        if scale is None:
            return linear.weight.detach()
        from mlora.fp8.quant import dequantize_rows

        return dequantize_rows(linear.weight.detach(), scale, self.dtype)

    # ------------------------------------------------------------------ export
    def _hf_tensors(self, adapters: list[str], only: set[str] | None = None, per_expert: bool = False
                    ) -> Iterable[tuple[str, torch.Tensor]]:
        """This stage's HF tensors, gathered over TP one parameter at a time (collective over TP) and,
        with EP, every expert of the stage gathered over the EP group (collective over EP); the weights of
        adapted linears come merged with ``adapters``. ``only``: the HF names wanted (None: all); a parameter
        none of whose names is wanted is not gathered at all. gpt-oss's experts come stacked as its checkpoints
        hold them, or (``per_expert``) expert by expert (:func:`~mlora.formats.fused_experts.fuse_gpt_oss_experts`)."""
        return fuse_gpt_oss_experts(self._per_expert_hf_tensors(adapters, only), self.spec, per_expert)

    def _per_expert_hf_tensors(self, adapters: list[str], only: set[str] | None) -> Iterable[tuple[str, torch.Tensor]]:
        params = dict(self.gpt.named_parameters())
        modules = dict(self.gpt.named_modules())
        group, mesh = self.mesh.tp_group, self.mesh
        for pm, sources in self._export_maps():
            if only is not None and not any(n in only for source in sources for n in source.hf_shapes(self.spec)):
                continue  # the same answer on every rank that gathers it: every EP rank's maps are in sources
            owner = modules.get(pm.megatron_name.rsplit(".", 1)[0])
            merge = adapters and pm.megatron_name.endswith(".weight") and getattr(owner, "lora_site", None) is not None
            if pm.expert:  # whole on its EP rank (expert TP 1): no TP gather
                local = self.merged_weight(owner, adapters) if merge else params[pm.megatron_name].detach()
                parts = [local]
                if mesh.ep > 1:
                    parts = [torch.empty_like(local) for _ in range(mesh.ep)]
                    dist.all_gather(parts, local.contiguous(), group=mesh.ep_group)
                for source, part in zip(sources, parts):
                    yield from _wanted(source.to_hf([part.cpu()], self.spec), only)
                continue
            if merge:
                local = self.merged_weight(owner, adapters)
            elif pm.megatron_name.endswith(".weight") and getattr(owner, "weight_scale", None) is not None:
                local = self.base_weight(owner)  # FP8: dequantized
            else:
                local = params[pm.megatron_name].detach()
            if self.mesh.tp > 1 and pm.kind != "replicated":
                shards = [torch.empty_like(local) for _ in range(self.mesh.tp)]
                dist.all_gather(shards, local.contiguous(), group=group)
            else:
                shards = [local]
            yield from _wanted(pm.to_hf([s.cpu() for s in shards], self.spec), only)

    def _export_maps(self) -> Iterator[tuple[ParamMap, list[ParamMap]]]:
        """This rank's exported parameters in file order, each with the maps its HF tensors come from: itself,
        or for an expert that expert position on every EP rank, in EP rank order (the all-gather's)."""
        mesh = self.mesh
        # each EP rank's maps, aligned: the same position holds the same local expert of every EP rank
        per_ep = [stage_param_maps(self.spec, mesh.pp, mesh.pp_rank, mesh.ep, r) for r in range(mesh.ep)]
        for i, pm in enumerate(per_ep[mesh.ep_rank]):
            if not is_export_copy(pm, self.spec):
                yield pm, [maps[i] for maps in per_ep] if pm.expert else [pm]

    def _hf_layout(self, only: set[str] | None = None, per_expert: bool = False
                   ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return gpt_oss_layout({name: (self.dtype, shape) for _, sources in self._export_maps() for source in sources
                               for name, shape in source.hf_shapes(self.spec).items() if only is None or name in only},
                              self.spec, per_expert)

    def adapted_weight_names(self, adapters: Iterable[str]) -> set[str]:
        """The HF weight names of the attention projections of every layer where one of ``adapters`` adapts one,
        and of the MLP's linears (every expert's) where it adapts one of those, and of a shared expert's where it
        adapts one of its, and a MoE router's (its correction bias too) where it adapts that: whole blocks, because
        an engine fuses q/k/v, gate/up, a layer's experts and the shared expert's gate/up into one weight each and
        reloads such a weight whole (:mod:`mlora.rollout.vllm_weights`)."""
        from mlora.lora.targets import (
            LM_HEAD,
            PARENT,
            attention_projections,
            expert_of,
            hf_module_name,
            is_router,
            model_projections,
        )

        def block(proj: str) -> str:  # the shared expert (mlp.shared_expert(s).*) is an MLP apart from the experts
            if is_router(proj) or proj == LM_HEAD:  # a weight of its own
                return proj
            return PARENT.get(proj, "mlp" if expert_of(proj) is not None else "shared_expert")

        blocks = {(layer, block(proj)) for name in adapters for layer, proj in self.adapters[name].modules}
        names = {f"{hf_module_name(layer, proj)}.weight" for layer, proj in model_projections(
            self.spec.num_layers, self.spec.moe, attention_projections(self.spec))
                 if (layer, block(proj)) in blocks}
        if self.spec.linear_bias:  # gpt-oss: every linear's bias comes with its weight (the engine reloads them whole)
            names |= {name[:-len("weight")] + "bias" for name in names}
        if self.spec.attention_sinks:  # and the sinks with the attention (vLLM's attention layer holds them)
            names |= {f"model.layers.{layer}.self_attn.sinks" for layer, b in blocks if b == "self_attn"}
        if self.spec.moe is not None and self.spec.moe.expert_bias:  # the router's other weight: its correction bias
            names |= {f"{hf_module_name(layer, proj)}.e_score_correction_bias" for layer, proj in blocks
                      if is_router(proj)}
        return names

    def _check_tied_lm_head(self, adapters: list[str]) -> None:
        from mlora.lora.targets import LM_HEAD

        adapted = [a for a in adapters if (self.spec.num_layers - 1, LM_HEAD) in self.adapters[a].modules]
        if adapted and self.spec.tied_embeddings:
            raise ValueError(f"adapters {adapted} adapt lm_head, whose weight this model ties to its input embeddings: "
                             "a merged checkpoint has one tensor for both, and merging the delta would change the "
                             "embeddings too; serve such adapters as LoRA (vLLM and PEFT load lm_head LoRA) instead")

    def save_merged(self, out_dir: str | os.PathLike, adapters: Iterable[str] = (), only_adapted: bool = False) -> None:
        """Write an HF checkpoint from the shards, with ``W + s·B·A`` of ``adapters`` merged in
        (collective: call on every rank).

        One safetensors file per pipeline stage (``model.safetensors`` when PP is 1) plus
        ``model.safetensors.index.json``, config and tokenizer files copied from the source.
        Each stage streams its tensors, gathered over TP one at a time. ``only_adapted``: only the weights
        of the linears ``adapters`` adapt (what the engines of a base they cannot serve LoRA on reload after
        each update, :mod:`mlora.rollout.vllm_weights`; gpt-oss's experts then expert by expert, as vLLM reloads
        them); nothing else is gathered.
        """
        adapters = list(adapters)
        self._require(*adapters)
        self._check_tied_lm_head(adapters)
        out = Path(out_dir)
        pp, stage = self.mesh.pp, self.mesh.pp_rank
        file_name = "model.safetensors" if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"
        writer_rank = self.mesh.tp_rank == 0 and self.mesh.dp_rank == 0
        only = self.adapted_weight_names(adapters) if only_adapted else None
        layout = self._hf_layout(only, per_expert=only_adapted)
        if self.mesh.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        if self.mesh.dp_rank == 0 or self.mesh.ep > 1:  # EP groups span DP ranks: all gather the experts
            writer = SafetensorsWriter(out / file_name, layout) if writer_rank else None
            try:
                for name, tensor in self._hf_tensors(adapters, only, per_expert=only_adapted):
                    if writer is not None:
                        writer.write(name, tensor.to(self.dtype))
            except BaseException:
                if writer is not None:
                    writer.abort()
                raise
            if writer is not None:
                writer.close()
        # Stage layouts (tensor name -> bytes) go to rank 0 for the index, as JSON bytes (no pickle).
        from mlora.parallel.small_collectives import gather_json

        sizes = {name: torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
                 for name, (dtype, shape) in layout.items()}
        layouts = gather_json([file_name, sizes] if writer_rank else None, dst=0)
        if self.mesh.rank == 0:
            weight_map, total = {}, 0
            for item in filter(None, layouts):
                fname, lay = item
                for name, nbytes in lay.items():
                    weight_map[name] = fname
                    total += nbytes
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            tmp = out / "model.safetensors.index.json.tmp"
            tmp.write_text(json.dumps(index, indent=2))
            os.replace(tmp, out / "model.safetensors.index.json")
            for name in SIDE_FILES:
                if (self.hf_dir / name).is_file():
                    shutil.copyfile(self.hf_dir / name, out / name)
        dist.barrier()


def _wanted(tensors: dict[str, torch.Tensor], only: set[str] | None) -> Iterable[tuple[str, torch.Tensor]]:
    return ((n, t) for n, t in tensors.items() if only is None or n in only)


def from_pretrained(hf_dir: str | os.PathLike, mesh: Mesh, dtype: torch.dtype = torch.float32,
                    fp8: str | None = None, fp8_recipe: str = "delayed", attention: str = "sdpa",
                    recompute: str = "none", recompute_method: str | None = None,
                    recompute_num_layers: int | None = None,
                    recompute_modules: Sequence[str] | None = None,
                    lora_compute_dtype: torch.dtype | None = None) -> MLoraModel:
    """This rank's shard of the HF model in ``hf_dir``, frozen, on ``mesh``.

    Supports LlamaForCausalLM, Qwen2ForCausalLM and MistralForCausalLM from safetensors
    (single file or sharded with ``model.safetensors.index.json``). Each rank reads only the
    tensors of its pipeline stage and only its TP slices of them.

    ``dtype`` is the compute dtype of the frozen base. Adapters and heads are held in float32 under a
    16-bit ``dtype`` (master weights: AdamW updates of LoRA factors at real learning rates round away
    in bf16) and in ``dtype`` otherwise; ``lora_compute_dtype`` is the dtype the LoRA branches compute
    in (default: the adapters' own, i.e. float32 on a bf16 base, as PEFT does; ``dtype`` casts the
    masters down per forward instead, cheaper on GPUs). ``fp8`` says how the frozen linears
    (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) are stored and multiplied:
    None (in ``dtype``), ``"torch"`` (float8_e4m3fn, one float32 scale per output row over the whole
    unsharded row, GEMMs through ``torch._scaled_mm``; see :mod:`mlora.fp8.quant`) or ``"te"``
    (Transformer Engine, GPU; ``fp8_recipe`` delayed | current | mxfp8; unverified: no TE run has
    happened yet). With ``"torch"`` each linear is quantized as soon as its shard is read.

    ``attention`` is the core attention of the local spec: ``"sdpa"`` (default; torch's fused
    ``scaled_dot_product_attention``, no ``[b, 1, s, s]`` mask unless the batch has left padding or
    a sliding window shorter than the sequence; see :mod:`mlora.models.attention`) or ``"unfused"``
    (megatron's ``DotProductAttention`` with the full boolean mask: scores materialised; the
    reference). ``fp8="te"`` uses Transformer Engine's core attention whatever ``attention`` says.
    Logits at padding positions are unspecified (as in HF) and may differ between the two.

    ``recompute`` is megatron's activation recompute in training mode, a property of the build shared
    by every adapter (actor and critic ride on this one base): ``"none"`` (keep every activation),
    ``"selective"`` (recompute ``recompute_modules`` of each layer: ``core_attn`` by default, ``mlp``)
    or ``"full"`` (keep only the input of each group of layers and rerun it in backward;
    ``recompute_method`` ``"uniform"`` (default: groups of ``recompute_num_layers``, default 1, which
    must divide the layers of a stage) or ``"block"`` (the first ``recompute_num_layers`` layers of each
    stage)). Gradients equal those without recompute, LoRA dropout included; see
    :mod:`mlora.models.recompute`.
    """
    shard = load_shard(hf_dir, mesh, dtype, fp8=fp8, fp8_recipe=fp8_recipe, attention=attention,
                       recompute=recompute, recompute_method=recompute_method,
                       recompute_num_layers=recompute_num_layers, recompute_modules=recompute_modules,
                       lora_compute_dtype=lora_compute_dtype)
    return MLoraModel(shard.gpt, shard.spec, mesh, Path(hf_dir), dtype, bytes_read=shard.bytes_read, fp8=shard.fp8,
                      lora_compute_dtype=lora_compute_dtype).eval()  # like HF: eval mode
