"""Client models on one base: each a named LoRA adapter with its own AdamW, trained in mixed-adapter batches.

A Tinker ``create_model`` becomes an adapter of any rank on attention and/or MLP projections (``train_attn``,
``train_mlp``; the MLP names reach a mixture of experts' experts) and/or the output layer (``train_unembed``:
``lm_head``). ``forward_backward`` requests of several
clients that are ready together run as one batch: the frozen base once over every row, each client's LoRA over its
own rows only (``adapter_rows``, :mod:`mlora.lora.routing`), the rows packed into micro-batches of a token budget and
split over the DP replicas; a client's gradients accumulate until its ``optim_step``. Collective over the mesh:
every rank makes the same calls in the same order.

With ``max_resident``, at most that many clients' adapters live in the model (beyond the clients of the call at hand):
the least recently used others move to host memory, factors, gradients and AdamW state alike, and come back exactly
when their client calls again (the same decisions on every rank: they follow the calls alone).
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from mlora.checkpoint.optim_state import (
    OptimizerStateReader,
    adapter_pieces,
    load_optimizer_state,
    write_optimizer_state,
)
from mlora.lora.config import LoraConfig
from mlora.lora.grads import clip_grads, finalize_grads
from mlora.models.packing import PackedRows, balanced_shares, pack_bins
from mlora.rl.vocab_parallel import vocab_parallel_logprobs
from mlora.service.losses import check_loss, datum_loss
from mlora.service.wire import ForwardBackward

LORA_ALPHA = 32  # whatever the rank (scaling alpha / rank): tinker-cookbook's weights/README.md gives 32 for Tinker's adapters
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
INIT_KEY = "tinker"  # the name A's initial draw is keyed by: equal seeds give equal adapters, whatever the model id
ROLE = "tinker"  # the optimizer state's role in checkpoint files


@dataclass
class ClientModel:
    """One client's adapter and optimizer."""

    adapter: str
    config: LoraConfig
    optimizer: torch.optim.Optimizer | None
    steps: int = 0
    host: dict | None = None  # while offloaded: factors, gradients and optimizer state in host memory


def lora_config(rank: int, seed: int | None, train_attn: bool, train_mlp: bool, train_unembed: bool,
                model_id: str) -> LoraConfig:
    """The adapter of a Tinker ``lora_config``; ValueError for one that trains nothing or a bad rank."""
    targets = (ATTENTION if train_attn else ()) + (MLP if train_mlp else ()) + (UNEMBED if train_unembed else ())
    if not targets:
        raise ValueError("lora_config trains nothing: set train_attn, train_mlp and/or train_unembed")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora rank {rank!r} must be a positive integer")
    seed = seed if seed is not None else zlib.crc32(model_id.encode())
    return LoraConfig(rank=rank, alpha=LORA_ALPHA, seed=int(seed), target_modules=list(targets))


class Tenants:
    """Every client model of the served base (``model``: an :class:`mlora.MLoraModel`)."""

    def __init__(self, model, max_resident: int | None = None, max_tokens: int = 0, strict: bool = True) -> None:
        """``max_resident``: the clients whose adapters stay in the model (None: all); ``max_tokens``: the tokens
        of one micro-batch of a ``forward_backward`` batch (0: the whole batch in one); ``strict``: a datum longer
        than ``max_tokens`` is refused (the user's budget), else it runs in a micro-batch of its own (the service's
        default budget, :func:`mlora.service.sizing.microbatch_sizing`)."""
        if max_resident is not None and max_resident < 1:
            raise ValueError(f"max_resident={max_resident} must be >= 1 (or None: every client resident)")
        if max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens} must be >= 0 (0: each batch in one micro-batch)")
        self.model = model
        self.max_resident = max_resident
        self.max_tokens, self.strict = max_tokens, strict
        self.clients: OrderedDict[str, ClientModel] = OrderedDict()  # least recently used first

    # ------------------------------------------------------------------ lifecycle
    def create(self, model_id: str, config: LoraConfig) -> None:
        """A fresh adapter (B = 0) for ``model_id`` and its AdamW."""
        if model_id in self.clients:
            raise ValueError(f"model {model_id!r} exists already")
        name = _adapter_name(model_id)
        self.model.add_adapter(name, config, key=INIT_KEY)
        params = self.model.adapter_parameters(name)
        opt = torch.optim.AdamW(params, lr=0.0, foreach=False)
        self.clients[model_id] = ClientModel(name, config, opt)
        self._evict({model_id})

    def delete(self, model_id: str) -> None:
        """Free ``model_id``'s adapter and optimizer state (a client that finished or disappeared)."""
        client = self.clients.pop(model_id, None)
        if client is not None and client.host is None:
            self.model.delete_adapter(client.adapter)

    def client(self, model_id: str, keep: set[str] = frozenset()) -> ClientModel:
        """``model_id``'s client, resident (brought back from host memory if it was offloaded), now the most recently
        used; others beyond ``max_resident`` go to host memory, never those in ``keep`` (the call's other clients)."""
        if model_id not in self.clients:
            raise KeyError(model_id)
        client = self.clients[model_id]
        self.clients.move_to_end(model_id)
        if client.host is not None:
            self._restore(client)
        self._evict({model_id, *keep})
        return client

    # ------------------------------------------------------------------ residency
    def _evict(self, keep: set[str]) -> None:
        if self.max_resident is None:
            return
        resident = [m for m, c in self.clients.items() if c.host is None]
        for model_id in resident[:max(len(resident) - self.max_resident, 0)]:
            if model_id not in keep:
                self._offload(self.clients[model_id])

    def _offload(self, client: ClientModel) -> None:
        """The client's factors, gradients and AdamW state to host memory; its adapter leaves the model."""
        params = self.model.adapter_parameters(client.adapter)
        state = client.optimizer.state_dict()
        for slot in state["state"].values():
            for key, value in slot.items():
                if torch.is_tensor(value):
                    slot[key] = value.to("cpu", copy=True)
        client.host = {"factors": [p.detach().to("cpu", copy=True) for p in params],
                       "grads": [None if p.grad is None else p.grad.to("cpu", copy=True) for p in params],
                       "optimizer": state}
        client.optimizer = None
        self.model.delete_adapter(client.adapter)

    def _restore(self, client: ClientModel) -> None:
        """Undo :meth:`_offload`: the same adapter, values, gradients and optimizer state as before it."""
        host, client.host = client.host, None
        self.model.add_adapter(client.adapter, client.config, key=INIT_KEY)
        params = self.model.adapter_parameters(client.adapter)
        with torch.no_grad():
            for p, value, grad in zip(params, host["factors"], host["grads"]):
                p.copy_(value)
                p.grad = None if grad is None else grad.to(p.device)
        client.optimizer = torch.optim.AdamW(params, lr=0.0, foreach=False)
        client.optimizer.load_state_dict(host["optimizer"])

    def resident(self) -> list[str]:
        """The clients whose adapters are in the model, least recently used first."""
        return [m for m, c in self.clients.items() if c.host is None]

    # ------------------------------------------------------------------ training
    def forward_backward(self, requests: list[ForwardBackward]) -> list[tuple[list[torch.Tensor], dict[str, float]]]:
        """Run ``requests`` (of distinct client models) as one mixed-adapter batch: per request, each datum's
        learner log-probs ``[N]`` and its metrics (``loss:sum``). All requests forward-only, or none.

        The rows are split over the DP replicas (near-equal tokens, :func:`balanced_shares`); each replica packs
        its rows into micro-batches of at most ``max_tokens`` tokens (:func:`pack_bins`; 0: one micro-batch) that
        run through the pipeline schedule, gradients accumulating. Losses are sums over datums, so the gradient is
        the same whatever the split: :func:`finalize_grads` sums the replicas' at ``optim_step``."""
        forward_only = requests[0].forward_only
        if any(r.forward_only != forward_only for r in requests):
            raise ValueError("forward-only and training requests cannot share a batch")
        configs = []
        for r in requests:
            if not r.data:
                raise ValueError("forward_backward with no data: send at least one datum")
            names = {frozenset(d.inputs) for d in r.data}
            if len(names) > 1:
                raise ValueError(f"the datums of one request carry different loss_fn_inputs: {sorted(map(sorted, names))}")
            configs.append(check_loss(r.loss_fn, r.config, set(r.data[0].inputs)))
        rows = [d for r in requests for d in r.data]
        owner = [k for k, r in enumerate(requests) for _ in r.data]
        lengths = [d.tokens.shape[0] for d in rows]
        if self.strict and self.max_tokens and max(lengths) > self.max_tokens:
            raise ValueError(f"a datum of {max(lengths)} tokens is longer than this server's "
                             f"--max-tokens-per-microbatch={self.max_tokens}")
        vocab = self.model.spec.vocab_size
        for d in rows:
            ids = torch.cat([d.tokens, d.inputs["target_tokens"].long().flatten()])
            if bool(((ids < 0) | (ids >= vocab)).any()):
                bad = sorted({int(t) for t in ids if not 0 <= t < vocab})
                raise ValueError(f"token ids {bad[:5]} are outside this model's vocabulary [0, {vocab})")
        in_batch = {r.model_id for r in requests}
        names = [self.client(r.model_id, keep=in_batch).adapter for r in requests]
        mesh = self.model.mesh
        mine = balanced_shares(lengths, mesh.dp)[mesh.dp_rank]
        # K targets per position ((N, K) target_tokens: top-K distillation): the batch's log-probs are taken for its
        # largest K, a row of fewer using its first columns
        widths = [d.inputs["target_tokens"].shape[1] if d.inputs["target_tokens"].dim() == 2 else 0 for d in rows]
        width = max(widths)
        per_row: dict[int, torch.Tensor] = {}
        losses = [0.0] * len(requests)
        if mine:  # a DP replica with no rows (fewer rows than replicas) has nothing to run
            bins = pack_bins([lengths[i] for i in mine], max(self.max_tokens, max(lengths)) if self.max_tokens
                             else sum(lengths),
                             "--max-tokens-per-microbatch")
            micro_batches = [self._micro_batch([mine[j] for j in b], rows, owner, names, width) for b in bins]
            lo, hi = self.model.vocab_shard_range()
            group = mesh.tp_group if mesh.tp > 1 else None

            def loss_fn(logits, mb):
                logp = vocab_parallel_logprobs(logits, mb["targets"].to(logits.device), lo, hi - lo, group)[0][0]
                total = logits.new_zeros(())
                for i, start in zip(mb["rows"], mb["packed"].starts):
                    d, k = rows[i], owner[i]
                    row = logp[start:start + d.tokens.shape[0]].float()
                    if width:
                        row = row[:, :widths[i]] if widths[i] else row[:, 0]
                    inputs = {key: v.to(logp.device, torch.float32) for key, v in d.inputs.items()
                              if key != "target_tokens"}
                    loss = datum_loss(requests[k].loss_fn, row, inputs, configs[k])
                    per_row[i] = row.detach().cpu()
                    losses[k] += float(loss.detach())
                    total = total + loss
                return total, {}

            # a batch that fails after some micro-batches' backward leaves each client's gradients as before it:
            # the scheduler then runs its requests one by one, and none is counted twice
            before = None if forward_only else {
                p: None if p.grad is None else p.grad.clone() for n in names for p in self.model.adapter_parameters(n)}
            try:
                with self.model.use_adapters(*names):
                    self.model.forward_backward(micro_batches, loss_fn, forward_only=forward_only)
            except BaseException:
                for param, grad in (before or {}).items():
                    param.grad = grad
                raise
        if mesh.pp > 1 or mesh.dp > 1:  # the loss ran on each replica's last stage: its values, from its first rank,
            # everywhere (TP ranks alone all hold every value already: the vocab-parallel log-probs are all-reduced)
            parts: list = [None] * mesh.world_size
            first = mesh.is_last_stage and mesh.tp_rank == 0
            dist.all_gather_object(parts, (per_row, losses) if first else None)
            per_row, losses = {}, [0.0] * len(requests)
            for part in parts:
                if part is not None:
                    per_row.update(part[0])
                    losses = [a + b for a, b in zip(losses, part[1])]
        out = []
        for k, r in enumerate(requests):
            logprobs = [per_row[i] for i in range(len(rows)) if owner[i] == k]
            out.append((logprobs, {"loss:sum": losses[k]}))
        return out

    @staticmethod
    def _micro_batch(indices: list[int], rows: list, owner: list[int], names: list[str], width: int = 0) -> dict:
        """One packed micro-batch of ``rows[indices]``: ids and targets back to back, each client's LoRA routed to
        its own rows (``adapter_rows``: every client of the batch named, with no rows here if it has none).
        ``width`` > 0: targets ``[1, T, width]``, a row's own targets in its first columns (the rest repeat its
        first, and no loss reads them)."""
        lengths = tuple(rows[i].tokens.shape[0] for i in indices)
        layout = PackedRows(lengths, max(lengths), sum(lengths))
        ids = torch.cat([rows[i].tokens for i in indices])[None]

        def padded(t: torch.Tensor) -> torch.Tensor:
            t = t.long() if t.dim() == 2 else t.long()[:, None]
            return torch.cat([t, t[:, :1].expand(-1, width - t.shape[1])], 1)
        targets = torch.cat([padded(rows[i].inputs["target_tokens"]) if width else rows[i].inputs["target_tokens"].long()
                             for i in indices])[None]
        adapter_rows = {name: [j for j, i in enumerate(indices) if owner[i] == k] for k, name in enumerate(names)}
        return {"input_ids": ids, "packed": layout, "targets": targets, "rows": indices, "adapter_rows": adapter_rows}

    def optim_step(self, model_id: str, adam: dict) -> dict[str, float]:
        """One AdamW step of ``model_id``'s adapter on its accumulated gradients (Tinker's ``adam_params``:
        learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm; 0 or absent: no clipping)."""
        client = self.client(model_id)
        params = self.model.adapter_parameters(client.adapter)
        finalize_grads(params)
        clip = float(adam.get("grad_clip_norm") or 0.0)
        norm = clip_grads(params, clip if clip > 0 else None)
        for group in client.optimizer.param_groups:
            group.update(lr=float(adam["learning_rate"]), betas=(float(adam["beta1"]), float(adam["beta2"])),
                         eps=float(adam["eps"]), weight_decay=float(adam["weight_decay"]))
        client.optimizer.step()
        for p in params:
            p.grad = None
        client.steps += 1
        return {"grad_norm:mean": float(norm), "learning_rate:mean": float(adam["learning_rate"])}

    # ------------------------------------------------------------------ checkpoints
    def save(self, model_id: str, directory: Path, optimizer: bool) -> None:
        """``directory/adapter`` (PEFT files) and, with ``optimizer``, ``directory/optim`` (AdamW moments, mesh
        independent) and ``directory/state.json`` (its step count). Collective."""
        client = self.client(model_id)
        self.model.save_adapter(client.adapter, directory / "adapter")
        if optimizer:
            mesh = self.model.mesh
            groups = {ROLE: (client.optimizer, adapter_pieces(self.model, client.adapter))}
            write_optimizer_state(directory / "optim" / f"pp{mesh.pp_rank}-tp{mesh.tp_rank}.safetensors", groups, mesh)
            if mesh.rank == 0:
                (directory / "state.json").write_text(json.dumps({"steps": client.steps}))

    def load(self, model_id: str, directory: Path, optimizer: bool) -> None:
        """Overwrite ``model_id``'s factors (and, with ``optimizer``, its AdamW state) from :meth:`save`'s files."""
        client = self.client(model_id)
        self.model.load_adapter_weights(client.adapter, directory / "adapter")
        for p in self.model.adapter_parameters(client.adapter):
            p.grad = None
        client.optimizer.state.clear()
        if optimizer and (directory / "optim").is_dir():
            reader = OptimizerStateReader(directory / "optim")
            try:
                load_optimizer_state(reader, ROLE, client.optimizer, adapter_pieces(self.model, client.adapter),
                                     self.model.mesh)
            finally:
                reader.close()
            state = directory / "state.json"
            client.steps = json.loads(state.read_text())["steps"] if state.is_file() else 0


def _adapter_name(model_id: str) -> str:
    """An adapter name for a model id (adapter names take no dots)."""
    return "t_" + model_id.replace(".", "_")
