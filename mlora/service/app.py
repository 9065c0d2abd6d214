"""The HTTP surface of Tinker SDK 0.38 (``/api/v1/...``) on FastAPI, over one mlora base.

Every training call returns a future at once (``{"request_id"}``) and runs on the scheduler's worker;
``retrieve_future`` long-polls (the SDK re-polls ``try_again`` at once) and answers protobuf for
``forward_backward`` results, JSON otherwise, ``{"error", "category"}`` for a failed request. The API key
(``X-API-Key``) identifies the owner: a client sees only its own sessions, models, checkpoints and futures.
Checkpoints are ``tinker://<model_id>/weights/<name>`` (adapter and optimizer state) and
``tinker://<model_id>/sampler_weights/<name>`` (the PEFT adapter), directories under ``data_dir``. Sampling runs on
the vLLM engine of :mod:`mlora.service.sampler`; its results are protobuf too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import threading
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from mlora.service.rest import NotFound, Rest, age_recipients, check_ttl, write_external
from mlora.service.sampler import PromptTargets, SampleJob, Sampler, prompt_targets, sampling_params
from mlora.service.scheduler import Job, Scheduler
from mlora.service.store import Store, owner_of
from mlora.service.tenants import Tenants, lora_config
from mlora.service.wire import decode_forward_backward, encode_forward_backward_output

log = logging.getLogger("mlora.service")
LONG_POLL = 10.0  # seconds retrieve_future holds a pending future before answering try_again (SDK timeout: 45)
PROTOBUF = "application/x-protobuf"
CLIENT_CONFIG = {"use_pyqwest_transport": False, "parallel_fwdbwd_chunks": True, "proto_compress_fwdbwd": False,
                 "sample_use_retrieve_futures": False, "sample_join_sampling_session": False,
                 "custom_loss_server_side": False, "pjwt_auth_enabled": False}
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
EPHEMERAL = "ephemeral-"  # the name of sampler weights saved without one (save_weights_and_get_sampling_client)
# Tinker's Dimuon (DimuonOptimizerConfig / DimuonParams) has no public definition to reproduce
NOT_ADAMW = ("this server trains with AdamW only (AdamParams; optimizer_config AdamOptimizerConfig); Tinker's Dimuon "
             "optimizer has no public definition to reproduce")
KEEP_EPHEMERAL = 8  # a model's most recent unnamed sampler checkpoints kept (older ones' samplers expire)
MAX_TOPK = 20  # top-k log-probs per position (vLLM's default max_logprobs)
# target_prompt_logprobs and prompt_alt_tokens_k read the engine's whole next-token distribution at every prompt
# position, num_samples * len(prompt) * vocab cells (each sample's prefill reads its own; vLLM sorts each row): at
# most this many. Measured on SmolLM2 (49k tokens), one CPU core: a 600-token prompt (29.5M cells) took 5.2 s where
# it takes 0.28 s without them, and the engine's peak memory grew 0.8 GB
DISTRIBUTION_CELLS = 1 << 25


class UserError(Exception):
    """A bad request: answered 400 with the message (the SDK raises it to the caller)."""


class Service:
    """The state behind the routes: the store, the client models and the worker."""

    def __init__(self, tenants: Tenants, model_dir: str | Path, data_dir: str | Path, model_name: str | None = None,
                 session_timeout: float = 120.0, batch_window: float = 0.01, sampler: Sampler | None = None) -> None:
        """``tenants``: the client models on the served base (or, on a mesh, :class:`mlora.service.mesh.Broadcast`
        of them); ``sampler``: the engine sampling requests run on (None: the server trains only, sampling is
        refused)."""
        self.model_dir = Path(model_dir)
        self.data_dir = Path(data_dir)
        self.names = {str(model_dir), str(self.model_dir.resolve()), self.model_dir.name} | (
            {model_name} if model_name else set())
        self.model_name = model_name or str(model_dir)
        self.store = Store(self.data_dir / "service.sqlite")
        self.rest = Rest(self.store, self.data_dir)
        self.tenants = tenants
        self.scheduler = Scheduler(self.store, self._run_fb_batch, batch_window)
        self.sampler = sampler
        if sampler is not None:
            sampler.finish = self.store.finish_future
        self.session_timeout = session_timeout
        self._reaper = threading.Thread(target=self._reap, name="mlora-service-reaper", daemon=True)
        self._closing = threading.Event()
        self._reaper.start()

    def close(self) -> None:
        self._closing.set()
        self.scheduler.stop()
        if self.sampler is not None:
            self.sampler.stop()
        self.store.close()

    # ------------------------------------------------------------------ helpers
    def _future(self, owner: str, kind: str, run, model_id: str | None = None, seq_id: int | None = None,
                fb=None) -> dict:
        new = uuid.uuid4().hex
        request_id = self.store.add_future(new, owner, kind, model_id, seq_id)
        if request_id == new:  # not a retried submission of a request already queued or run
            self.scheduler.submit(Job(request_id, run, model_id, seq_id, fb))
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {})}

    def _owned_model(self, owner: str, model_id: str) -> dict:
        row = self.store.model(model_id)
        if row is None or row["owner"] != owner:
            raise UserError(f"model {model_id!r} not found")
        self.store.heartbeat(row["session_id"])  # a client that calls is alive, whatever its heartbeats do
        if row["state"] == "lost":
            raise UserError(f"model {model_id!r} was lost when the server restarted; create a training client from "
                            "one of its checkpoints (load_state / create_training_client_from_state)")
        if row["state"] != "live":
            raise UserError(f"model {model_id!r} was freed (its session finished or stopped sending heartbeats)")
        return row

    def _owned_checkpoint(self, owner: str, path: str, read: bool = False) -> dict:
        """Checkpoint ``path`` of ``owner`` (``read``: or one its owner published)."""
        row = self.store.checkpoint(path)
        if not (self.rest.readable(owner, row) if read else row is not None and row["owner"] == owner):
            raise UserError(f"checkpoint {path!r} not found (paths look like tinker://<model_id>/weights/<name>)")
        return row

    def _check_base(self, base_model: str | None) -> str:
        if base_model is not None and base_model not in self.names:
            raise UserError(f"base_model {base_model!r} is not served here; this server serves {self.model_name!r}")
        return base_model or self.model_name

    # ------------------------------------------------------------------ work run on the worker thread
    def _run_fb_batch(self, jobs: list[Job]) -> list[tuple[str, bytes]]:
        if len(jobs) > 1:
            log.info("%d models' forward_backward in one batch (%d datums)", len(jobs), sum(len(j.fb.data) for j in jobs))
        results = self.tenants.forward_backward([j.fb for j in jobs])
        return [(PROTOBUF, encode_forward_backward_output(logprobs, metrics)) for logprobs, metrics in results]

    def _create(self, model_id: str, config, checkpoint: dict | None = None, optimizer: bool = False):
        def run():
            self.tenants.create(model_id, config)
            if checkpoint is not None:
                self.tenants.load(model_id, Path(checkpoint["directory"]), optimizer)
            return "application/json", json.dumps({"model_id": model_id, "type": "create_model" if checkpoint is None
                                                   else "load_weights"}).encode()
        return run

    def _free(self, model_id: str) -> None:
        """Free a model now (its queued requests fail) and in the store."""
        self.scheduler.forget_model(model_id)
        self.store.set_model_state(model_id, "freed")
        self._prune_ephemeral(model_id, keep=0)

        def run():  # on the worker, between batches: the adapter and its optimizer state go
            self.tenants.delete(model_id)
            return "application/json", b"{}"
        self.scheduler.submit(Job(uuid.uuid4().hex, run))

    def _reap(self) -> None:
        while not self._closing.wait(min(5.0, self.session_timeout / 4)):
            for session_id in self.store.silent_sessions(time.time() - self.session_timeout):
                log.info("session %s sent no heartbeat for %.0f s: freeing its models", session_id,
                         self.session_timeout)
                self.store.finish_session(session_id)
                for model_id in self.store.session_models(session_id):
                    self._free(model_id)
            for path in self.rest.expire(time.time()):
                log.info("checkpoint %s reached its TTL: deleted", path)

    def _prune_ephemeral(self, model_id: str, keep: int) -> None:
        """Remove the unnamed sampler checkpoints of ``model_id`` (files and rows) that no client holds: all but the
        ``keep`` newest, except one sampled after a newer one was saved (a client kept its sampling client: the DPO
        recipe's reference, an off-policy sampler). ``keep=0`` (the model is freed): all of them."""
        rows = sorted((c for c in self.store.model_checkpoints(model_id, "sampler_weights")
                       if c["name"].startswith(EPHEMERAL)), key=lambda c: c["created"])
        for c, newer in zip(rows[:max(len(rows) - keep, 0)], rows[1:]):
            if keep and c["last_sampled"] > newer["created"]:
                continue
            self.store.remove_checkpoint(c["path"])
            shutil.rmtree(c["directory"], ignore_errors=True)

    def _need_sampler(self) -> Sampler:
        if self.sampler is None:
            raise UserError("this server was started without a sampling engine (--no-sampling): it serves training "
                            "calls only")
        return self.sampler

    def _check_sampler_rank(self, rank: int, what: str) -> None:
        if self.sampler is not None and rank > self.sampler.max_lora_rank:
            raise UserError(f"{what} has LoRA rank {rank}, above this server's sampling limit "
                            f"--max-lora-rank={self.sampler.max_lora_rank}; use a rank <= "
                            f"{self.sampler.max_lora_rank} or restart the server with a larger --max-lora-rank")

    # ------------------------------------------------------------------ routes' bodies
    def create_session(self, owner: str, body: dict) -> dict:
        session_id = f"s{uuid.uuid4().hex[:12]}"
        self.store.add_session(session_id, owner, body.get("user_metadata") or {}, body.get("display_name"))
        return {"session_id": session_id, "type": "create_session"}

    def _session(self, owner: str, session_id: str) -> None:
        if self.store.session_owner(session_id) != owner:
            raise UserError(f"session {session_id!r} not found")

    def create_model(self, owner: str, body: dict) -> dict:
        session_id = body["session_id"]
        self._session(owner, session_id)
        base = self._check_base(body.get("base_model"))
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise UserError(f"optimizer_config type {optimizer!r}: {NOT_ADAMW}")
        lora = body.get("lora_config") or {}
        model_id = f"{session_id}:train:{int(body['model_seq_id'])}"
        if self.store.model(model_id) is not None:
            raise UserError(f"model {model_id!r} exists already")
        try:
            config = lora_config(lora.get("rank", 32), lora.get("seed"), lora.get("train_attn", True),
                                 lora.get("train_mlp", True), lora.get("train_unembed", True), model_id)
        except ValueError as e:
            raise UserError(str(e)) from None
        self._check_sampler_rank(config.rank, f"model {model_id!r}")
        self.store.add_model(model_id, session_id, owner, base, {"rank": config.rank, "seed": config.seed,
                                                                 "targets": list(config.target_modules)},
                             body.get("user_metadata") or {})
        self.scheduler.start_model(model_id)
        return self._future(owner, "create_model", self._create(model_id, config))

    def get_info(self, owner: str, body: dict) -> dict:
        row = self._owned_model(owner, body["model_id"])
        return {"model_id": row["model_id"], "type": "get_info", "is_lora": True, "lora_rank": row["config"]["rank"],
                "model_name": row["base_model"],
                "model_data": {"arch": self.tenants.model.spec.architecture, "model_name": row["base_model"],
                               "tokenizer_id": row["base_model"]}}

    def forward_backward(self, owner: str, body: bytes) -> dict:
        try:
            fb = decode_forward_backward(body)
        except ValueError as e:
            raise UserError(str(e)) from None
        self._owned_model(owner, fb.model_id)
        return self._future(owner, "forward_backward", None, fb.model_id, fb.seq_id, fb)

    def optim_step(self, owner: str, body: dict) -> dict:
        model_id = body["model_id"]
        self._owned_model(owner, model_id)
        adam = body.get("adam_params")
        if adam is None:
            kind = (body.get("optimizer_params") or body.get("optim_params") or {}).get("type")
            raise UserError(f"optim_step with {kind!r} optimizer parameters: {NOT_ADAMW}" if kind else
                            "optim_step needs adam_params (this server runs AdamW only)")

        def run():
            metrics = self.tenants.optim_step(model_id, adam)
            return "application/json", json.dumps({"metrics": metrics, "type": "optim_step"}).encode()
        return self._future(owner, "optim_step", run, model_id, int(body["seq_id"]))

    def save(self, owner: str, body: dict, kind: str) -> dict:
        """save_weights (``kind`` weights), save_weights_for_sampler (sampler_weights) and save_weights_external
        (external_weights: the PEFT files, optionally age-encrypted, with a TTL; downloaded through :mod:`rest`)."""
        request_type = {"weights": "save_weights", "sampler_weights": "save_weights_for_sampler",
                        "external_weights": "save_weights_external"}[kind]
        model_id = body["model_id"]
        row = self._owned_model(owner, model_id)
        name = body.get("path")
        sampler_id, expires, recipients = None, None, []
        if kind == "external_weights":
            try:
                expires, recipients = check_ttl(body.get("ttl_seconds")), age_recipients(
                    body.get("age_encryption_recipients"))
            except ValueError as e:
                raise UserError(str(e)) from None
        if name is None:  # save_weights_and_get_sampling_client: sampler weights of a new sampling session
            if kind != "sampler_weights" or body.get("sampling_session_seq_id") is None:
                raise UserError(f"{request_type} needs a name (path)")
            self._need_sampler()
            seq = int(body["sampling_session_seq_id"])
            sampler_id = f"{row['session_id']}:sample:{seq}"
            name = f"{EPHEMERAL}{seq}"
        elif name.startswith(EPHEMERAL) or not _NAME.fullmatch(name) or ".." in name:
            raise UserError(f"checkpoint name {name!r} is invalid: use letters, digits, '_', '-' and '.' (and do not "
                            f"start it with {EPHEMERAL!r})")
        path = f"tinker://{model_id}/{kind}/{name}"
        directory = self.data_dir / "checkpoints" / model_id / kind / name
        if self.store.checkpoint(path) is not None and not body.get("overwrite", True):
            raise UserError(f"checkpoint {path!r} exists; pass overwrite=True to replace it")

        def run():
            if kind == "external_weights":  # the PEFT files alone, at the export's root (what a download takes)
                staging = directory.with_name(f".{name}.adapter")
                self.tenants.save(model_id, staging, optimizer=False)
                size = write_external(staging / "adapter", directory, recipients)
                shutil.rmtree(staging, ignore_errors=True)
            else:
                self.tenants.save(model_id, directory, optimizer=kind == "weights")
            self.store.add_checkpoint(path, model_id, owner, kind, name, str(directory), row["config"], expires)
            if kind == "external_weights":
                return "application/json", json.dumps({"path": path, "size_bytes": size, "type": request_type}).encode()
            if sampler_id is None:
                return "application/json", json.dumps({"path": path, "type": request_type}).encode()
            self.store.add_sampler(sampler_id, row["session_id"], owner, row["base_model"], path)
            self._prune_ephemeral(model_id, KEEP_EPHEMERAL)
            return "application/json", json.dumps({"sampling_session_id": sampler_id, "type": request_type}).encode()
        return self._future(owner, request_type, run, model_id, int(body["seq_id"]))

    def load_weights(self, owner: str, body: dict) -> dict:
        checkpoint = self._owned_checkpoint(owner, body["path"], read=True)
        if checkpoint["kind"] != "weights":
            raise UserError(f"{body['path']!r} is not a training checkpoint; load_weights takes "
                            "tinker://<model_id>/weights/<name>")
        optimizer = bool(body.get("optimizer", False))
        if "model_id" in body:  # into an existing model
            model_id = body["model_id"]
            row = self._owned_model(owner, model_id)
            if row["config"]["rank"] != checkpoint["config"]["rank"]:
                raise UserError(f"{body['path']!r} has LoRA rank {checkpoint['config']['rank']}, model {model_id!r} "
                                f"{row['config']['rank']}")

            def run():
                self.tenants.load(model_id, Path(checkpoint["directory"]), optimizer)
                return "application/json", json.dumps({"path": body["path"], "type": "load_weights"}).encode()
            return self._future(owner, "load_weights", run, model_id, int(body["seq_id"]))
        session_id = body["session_id"]  # a new model from the checkpoint
        self._session(owner, session_id)
        base = self._check_base(body.get("base_model"))
        model_id = f"{session_id}:train:{int(body['model_seq_id'])}"
        saved = checkpoint["config"]
        config = lora_config(saved["rank"], saved["seed"], "q_proj" in saved["targets"], "gate_proj" in saved["targets"],
                             "lm_head" in saved["targets"], model_id)
        self.store.add_model(model_id, session_id, owner, base, saved, body.get("user_metadata") or {})
        self.scheduler.start_model(model_id)
        return self._future(owner, "load_weights", self._create(model_id, config, checkpoint, optimizer))

    async def retrieve_future(self, owner: str, body: dict) -> tuple[int, str, bytes]:
        request_id = body["request_id"]
        row = self.store.future(request_id)
        if row is None or row["owner"] != owner:
            raise UserError(f"request {request_id!r} not found")
        # a client polling its futures is alive: on a loaded machine its heartbeats can queue behind these polls
        # (the SDK sends both on one connection pool), and its session must not be reaped under it
        if row["model_id"] is not None:
            holder = self.store.model(row["model_id"]) or self.store.sampler(row["model_id"])
            if holder is not None:
                self.store.heartbeat(holder["session_id"])
        if row["state"] == "pending":
            worker = self.sampler if row["kind"] == "sample" and self.sampler is not None else self.scheduler
            await asyncio.to_thread(worker.wait, request_id, LONG_POLL)
            row = self.store.future(request_id)
        if row["state"] == "pending":
            return 200, "application/json", json.dumps({"type": "try_again", "request_id": request_id,
                                                        "queue_state": "active"}).encode()
        return 200, row["content_type"], row["payload"]

    def create_sampling_session(self, owner: str, body: dict) -> dict:
        self._need_sampler()
        session_id = body["session_id"]
        self._session(owner, session_id)
        model_path = body.get("model_path")
        if model_path is not None:
            base = self._sampled_checkpoint(owner, model_path)[1]
        elif body.get("base_model") is None:
            raise UserError("create_sampling_session needs a model_path (tinker://...) or a base_model")
        else:
            base = self._check_base(body["base_model"])
        sampler_id = f"{session_id}:sample:{int(body['sampling_session_seq_id'])}"
        self.store.add_sampler(sampler_id, session_id, owner, base, model_path)
        return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}

    def get_sampler(self, owner: str, sampler_id: str) -> dict:
        row = self.store.sampler(sampler_id)
        if row is None or row["owner"] != owner:
            raise UserError(f"sampling session {sampler_id!r} not found")
        return {"sampler_id": sampler_id, "base_model": row["base_model"], "model_path": row["model_path"]}

    def _sampled_checkpoint(self, owner: str, path: str) -> tuple[Path, str, float]:
        """The adapter directory, base model and version of checkpoint ``path`` (sampler or training weights)."""
        checkpoint = self._owned_checkpoint(owner, path, read=True)
        if checkpoint["kind"] == "external_weights":
            raise UserError(f"{path!r} is an export for download; sample from its sampler or training weights")
        directory = Path(checkpoint["directory"]) / "adapter"
        if not directory.is_dir():
            raise UserError(f"checkpoint {path!r} has no adapter files any more (unnamed sampler weights are kept for "
                            f"the {KEEP_EPHEMERAL} latest saves of a model and those a client sampled after a newer "
                            "save, until its session ends)")
        self._check_sampler_rank(checkpoint["config"]["rank"], f"checkpoint {path!r}")
        model = self.store.model(checkpoint["model_id"])
        return directory, model["base_model"], checkpoint["created"]

    def asample(self, owner: str, body: dict) -> dict:
        sampler = self._need_sampler()
        if body.get("record_stability_info"):  # Tinker's unpublished StableReinforce data
            raise UserError(f"sample request field record_stability_info={body['record_stability_info']!r} is not "
                            "supported by this server: it records data for loss_fn='stable_reinforce', whose "
                            "objective Tinker does not publish; sample without it and train with 'ppo' or 'gspo'")
        sampler_id, model_path = body.get("sampling_session_id"), body.get("model_path")
        if sampler_id is not None:
            row = self.store.sampler(sampler_id)
            if row is None or row["owner"] != owner:
                raise UserError(f"sampling session {sampler_id!r} not found")
            model_path = row["model_path"]
        elif model_path is None:
            self._check_base(body.get("base_model") or None)
        adapter = None
        if model_path is not None:
            directory, _, version = self._sampled_checkpoint(owner, model_path)
            adapter = sampler.adapter(directory, str(version))
            self.store.sampled(model_path, time.time())  # held by a client: not pruned (_prune_ephemeral)
        spec = self.tenants.model.spec
        prompt = []
        for chunk in body["prompt"]["chunks"]:
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise UserError(f"prompt chunk of type {chunk.get('type')!r}: this server samples from token chunks "
                                "(encoded_text) only")
            prompt += [int(t) for t in chunk["tokens"]]
        bad = sorted({t for t in prompt if not 0 <= t < spec.vocab_size})
        if not prompt or bad:
            raise UserError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {spec.vocab_size})" if bad
                            else "empty prompt")
        limit = sampler.max_model_len or spec.max_position_embeddings
        if len(prompt) >= limit:
            raise UserError(f"a prompt of {len(prompt)} tokens leaves no room to sample within this server's context "
                            f"of {limit} tokens")
        n = int(body.get("num_samples", 1))
        if n < 1:
            raise UserError(f"num_samples={n} must be >= 1")
        try:
            params = sampling_params(body["sampling_params"], spec.vocab_size)
        except ValueError as e:
            raise UserError(str(e)) from None
        topk = {key: int(body.get(key, 0)) for key in ("topk_prompt_logprobs", "topk_sample_logprobs")}
        for key, k in topk.items():
            if not 0 <= k <= MAX_TOPK:
                raise UserError(f"{key}={k} must be in [0, {MAX_TOPK}]")
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None:
            if not body.get("prompt_logprobs"):
                raise UserError("prompt_logprobs_last_n needs prompt_logprobs=True")
            if not isinstance(last_n, int) or not 1 <= last_n <= len(prompt) - 1:
                raise UserError(f"prompt_logprobs_last_n={last_n!r} must be an integer from 1 to len(prompt) - 1 = "
                                f"{len(prompt) - 1}")
        targets, alt_k = _prompt_distribution(body, len(prompt), n, limit, spec.vocab_size)
        new = uuid.uuid4().hex
        seq_id = body.get("seq_id")
        request_id = self.store.add_future(new, owner, "sample", sampler_id if seq_id is not None else None,
                                           None if seq_id is None else int(seq_id))
        if request_id == new:  # not a retried submission
            sampler.submit(SampleJob(request_id, prompt, n, params, adapter, bool(body.get("prompt_logprobs")),
                                     topk["topk_prompt_logprobs"], topk["topk_sample_logprobs"], last_n,
                                     target_prompt_logprobs=targets, prompt_alt_tokens_k=alt_k))
        return {"request_id": request_id, "sample_sequence_ids": [f"{request_id}:{i}" for i in range(n)]}

    def finish_session(self, owner: str, session_id: str) -> None:
        self._session(owner, session_id)
        self.store.finish_session(session_id)
        for model_id in self.store.session_models(session_id):
            self._free(model_id)


def _prompt_distribution(body: dict, prompt_len: int, num_samples: int, context: int,
                         vocab_size: int) -> tuple[PromptTargets | None, int]:
    """A sample request's ``target_prompt_logprobs`` and ``prompt_alt_tokens_k``, or UserError naming what is wrong.
    Both read the whole next-token distribution (:data:`DISTRIBUTION_CELLS`)."""
    targets = _targets(body.get("target_prompt_logprobs"), prompt_len, context, vocab_size)
    k = _alt_tokens_k(body.get("prompt_alt_tokens_k", 0), prompt_len, context)
    cells = num_samples * prompt_len * vocab_size
    if (targets is not None or k > 0) and cells > DISTRIBUTION_CELLS:
        raise UserError(f"target_prompt_logprobs and prompt_alt_tokens_k read the whole next-token distribution at "
                        f"every prompt position: num_samples * len(prompt) * vocab = {num_samples} * {prompt_len} * "
                        f"{vocab_size} = {cells} passes this server's bound of {DISTRIBUTION_CELLS}; send a shorter "
                        "prompt or fewer samples")
    return targets, k


def _top_cells(context: int) -> int:
    """The SDK says Tinker bounds ``len(prompt) * distinct ids`` and ``len(prompt) * k`` the way it bounds a top-k
    width: here, as much as :data:`MAX_TOPK` at every position of the longest prompt (``context``)."""
    return MAX_TOPK * context


def _targets(tensor, prompt_len: int, context: int, vocab_size: int) -> PromptTargets | None:
    """A request's ``target_prompt_logprobs`` (None: not asked), within :func:`_top_cells` (per row: the most
    distinct ids any row names)."""
    if tensor is None:
        return None
    try:
        targets = prompt_targets(tensor, prompt_len, vocab_size)
    except ValueError as e:
        raise UserError(str(e)) from None
    distinct, bound = targets.most_distinct_in_a_row(), _top_cells(context)
    if prompt_len * distinct > bound:
        raise UserError(f"target_prompt_logprobs names up to {distinct} distinct token ids in a row: len(prompt) * "
                        f"{distinct} = {prompt_len * distinct} passes this server's bound of {bound} (top-k "
                        f"{MAX_TOPK} x context {context}); at most {bound // prompt_len} a row for this prompt")
    return targets


def _alt_tokens_k(k, prompt_len: int, context: int) -> int:
    """A request's ``prompt_alt_tokens_k``, within :func:`_top_cells`."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise UserError(f"prompt_alt_tokens_k={k!r} must be an integer >= 0")
    if k > 0 and prompt_len < 2:
        raise UserError("prompt_alt_tokens_k draws at every prompt position after the first: the prompt needs at "
                        "least 2 tokens")
    bound = _top_cells(context)
    if prompt_len * k > bound:
        raise UserError(f"prompt_alt_tokens_k={k}: len(prompt) * k = {prompt_len * k} passes this server's bound of "
                        f"{bound} (top-k {MAX_TOPK} x context {context}); k is at most {bound // prompt_len} for "
                        "this prompt")
    return k


MALFORMED = (KeyError, TypeError, ValueError, AttributeError)  # a body missing a field, or of the wrong shape


def user_error(message: str, status: int = 400) -> JSONResponse:
    """The SDK's user error (``RequestFailedError`` category ``user``, which it does not retry)."""
    return JSONResponse({"error": message, "category": "user"}, status_code=status)


def malformed(exc: BaseException) -> JSONResponse:
    return user_error(f"malformed request: {type(exc).__name__}: {exc}")


def build_app(service: Service):
    """The FastAPI app of ``service``."""
    app = FastAPI(title="mlora Tinker service")

    def owner(request: Request) -> str:
        return owner_of(request.headers.get("x-api-key"))

    def answer(fn):
        try:
            return JSONResponse(fn())
        except UserError as e:
            return user_error(str(e))
        except NotFound as e:
            return user_error(str(e), 404)
        except MALFORMED as e:
            return malformed(e)

    @app.exception_handler(json.JSONDecodeError)
    async def not_json(request: Request, exc: json.JSONDecodeError):
        # a 500 would be retried by the SDK without end: a body that is not JSON is the client's error
        return user_error(f"malformed request: the body is not JSON ({exc})")

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok", "sampling": "off" if service.sampler is None else service.sampler.state}

    @app.post("/api/v1/client/config")
    async def client_config():
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config():
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        spec = service.tenants.model.spec
        return {"supported_models": [{"model_name": service.model_name, "trainable": True,
                                      "sampleable": service.sampler is not None,
                                      "max_context_length": spec.max_position_embeddings}]}

    @app.post("/api/v1/telemetry")
    async def telemetry(request: Request):
        # the SDK reports a client's own failures here (often only here): they go to the server's log
        try:
            batch = await request.json()
            for event in batch.get("events") or []:
                if isinstance(event, dict) and event.get("error_message") is not None:
                    last = (event.get("traceback") or "").strip().splitlines()[-3:]
                    log.warning("a client of session %s reported: %s | %s", batch.get("session_id"),
                                event["error_message"], " / ".join(line.strip() for line in last))
        except (ValueError, AttributeError, TypeError):
            pass  # telemetry is best-effort: a body this server cannot read is still accepted
        return {"status": "accepted"}

    def json_route(fn):  # a JSON body in, fn(owner, body) out
        async def route(request: Request):
            body = await request.json()
            return answer(lambda: fn(owner(request), body))
        return route

    for name, fn in {"create_session": service.create_session, "create_model": service.create_model,
                     "get_info": service.get_info, "optim_step": service.optim_step,
                     "load_weights": service.load_weights, "asample": service.asample,
                     "create_sampling_session": service.create_sampling_session,
                     "save_weights": lambda who, body: service.save(who, body, "weights"),
                     "save_weights_for_sampler": lambda who, body: service.save(who, body, "sampler_weights"),
                     "save_weights_external": lambda who, body: service.save(who, body, "external_weights"),
                     "weights_info": lambda who, body: service.rest.weights_info(who, body["tinker_path"])}.items():
        app.post(f"/api/v1/{name}")(json_route(fn))

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        body = await request.json()
        session_id = body.get("session_id") if isinstance(body, dict) else None
        if not isinstance(session_id, str):
            return user_error("malformed request: session_id (a string) is missing")
        if service.store.session_owner(session_id) != owner(request) or not service.store.heartbeat(session_id):
            return user_error("session finished or unknown", 410)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        return answer(lambda: service.finish_session(owner(request), session_id) or {})

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        body = await request.body()  # protobuf
        return answer(lambda: service.forward_backward(owner(request), body))

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        body = await request.json()
        try:
            status, content_type, payload = await service.retrieve_future(owner(request), body)
        except UserError as e:
            return user_error(str(e))
        except MALFORMED as e:
            return malformed(e)
        return Response(payload, status_code=status, media_type=content_type)

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        return answer(lambda: service.get_sampler(owner(request), sampler_id))

    add_rest_routes(app, service.rest, owner, answer)
    return app


def add_rest_routes(app: FastAPI, rest: Rest, owner, answer) -> None:
    """The REST API's routes (:mod:`mlora.service.rest`); a checkpoint's own routes before the one they extend."""
    runs, checkpoint = "/api/v1/training_runs", "/api/v1/training_runs/{run}/checkpoints/{checkpoint:path}"

    def no_projects(project_id: str | None) -> None:
        if project_id is not None:
            raise UserError(f"project_id={project_id!r}: this server has no projects")

    @app.get(runs)
    async def training_runs(request: Request, limit: int = 20, offset: int = 0, access_scope: str = "owned",
                            project_id: str | None = None):
        return answer(lambda: no_projects(project_id) or rest.training_runs(owner(request), limit, offset,
                                                                              access_scope))

    @app.get(runs + "/{run}")
    async def training_run(run: str, request: Request, access_scope: str = "owned"):
        return answer(lambda: rest.training_run(owner(request), run, access_scope))

    @app.get(runs + "/{run}/checkpoints")
    async def checkpoints(run: str, request: Request):
        return answer(lambda: rest.checkpoints(owner(request), run))

    @app.get(checkpoint + "/external_weights_urls")
    async def external_urls(run: str, checkpoint: str, request: Request):
        return answer(lambda: rest.external_urls(owner(request), run, checkpoint, str(request.base_url)))

    @app.put(checkpoint + "/ttl")
    async def ttl(run: str, checkpoint: str, request: Request):
        body = await request.json()
        return answer(lambda: rest.set_ttl(owner(request), run, checkpoint, body["ttl_seconds"]) or {})

    @app.post(checkpoint + "/publish")
    async def publish(run: str, checkpoint: str, request: Request):
        return answer(lambda: rest.publish(owner(request), run, checkpoint, True) or {})

    @app.delete(checkpoint + "/publish")
    async def unpublish(run: str, checkpoint: str, request: Request):
        return answer(lambda: rest.publish(owner(request), run, checkpoint, False) or {})

    @app.delete(checkpoint)
    async def delete_checkpoint(run: str, checkpoint: str, request: Request):
        return answer(lambda: rest.delete_checkpoint(owner(request), run, checkpoint) or {})

    @app.get("/api/v1/checkpoints")
    async def user_checkpoints(request: Request, limit: int = 100, offset: int = 0):
        return answer(lambda: rest.user_checkpoints(owner(request), limit, offset))

    @app.get("/api/v1/sessions")
    async def sessions(request: Request, limit: int = 20, offset: int = 0, access_scope: str = "owned"):
        return answer(lambda: rest.sessions(owner(request), limit, offset, access_scope))

    @app.get("/api/v1/billing/usage/checkpoints/current")
    async def storage_usage(request: Request, project_id: str | None = None):
        return answer(lambda: no_projects(project_id) or rest.storage_usage(owner(request)))

    @app.get("/api/v1/sessions/{session_id}")
    async def session(session_id: str, request: Request):
        return answer(lambda: rest.session(owner(request), session_id))

    @app.get("/api/v1/external_files/{token}")
    async def external_file(token: str):
        # the signed URL is the credential (a plain GET, as from a storage bucket): no API key
        try:
            return FileResponse(rest.external_file(token))
        except NotFound as e:
            return user_error(str(e), 404)
        except ValueError as e:
            return user_error(str(e), 403)
