"""Tinker's REST API (what the SDK's ``RestClient`` and ``save_weights_external`` call): training runs, checkpoints
(list, delete, TTL, publish), weights info, sessions, and external weights a user downloads through signed URLs.

Ownership: the API key that made a thing owns it. Only the owner lists, deletes, re-times or publishes a checkpoint;
a published checkpoint is readable by every key (its training run with ``access_scope="accessible"``, its weights
info, sampling from it, a training client from it), as Tinker's public checkpoints are. An owner asking for another
owner's private thing is told it does not exist.

External weights (``tinker://<model>/external_weights/<name>``) are the model's PEFT adapter files
(``adapter_model.safetensors``, ``adapter_config.json``: PEFT and vLLM load them as they are), each optionally
encrypted to the request's age recipients (``<file>.age``, pyrage). ``external_weights_urls`` answers one URL per file,
signed with a key kept in ``--data-dir`` (HMAC-SHA256 of the path and the expiry), valid for an hour and while the
checkpoint exists: tinker-cookbook's ``weights.download`` fetches them with a plain GET, as it does Tinker's.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

# tinker path segment -> the SDK's checkpoint_type
CHECKPOINT_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
TTL_RANGE = (3600, 10 * 365 * 86400)  # the SDK documents TTLs from 1 hour to 10 years (None: never expires)
URL_LIFETIME = 3600.0  # seconds a signed download URL stays valid
MAX_RECIPIENTS = 10  # the SDK's documented limit of age recipients
PAGE_LIMIT = 1000  # the most items one list request returns


class NotFound(Exception):
    """The thing does not exist for this owner (answered as the SDK's user error)."""


def iso(when: float | None) -> str | None:
    return None if when is None else datetime.fromtimestamp(when, timezone.utc).isoformat()


def directory_size(directory: str | Path) -> int:
    root = Path(directory)
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0


def check_ttl(ttl_seconds: object) -> float | None:
    """The expiry time of a TTL (None: never); ValueError naming a TTL outside the SDK's range."""
    if ttl_seconds is None:
        return None
    if not isinstance(ttl_seconds, int) or isinstance(ttl_seconds, bool) or not \
            TTL_RANGE[0] <= ttl_seconds <= TTL_RANGE[1]:
        raise ValueError(f"ttl_seconds={ttl_seconds!r} must be an integer from {TTL_RANGE[0]} (1 hour) to "
                         f"{TTL_RANGE[1]} (10 years), or None (never expires)")
    return time.time() + ttl_seconds


def age_recipients(keys: object) -> list:
    """pyrage recipients of ``age1...`` or SSH public keys; ValueError naming a bad one."""
    if keys is None:
        return []
    if not isinstance(keys, list) or not keys or len(keys) > MAX_RECIPIENTS:
        raise ValueError(f"age_encryption_recipients must be a list of 1 to {MAX_RECIPIENTS} keys, got {keys!r}")
    try:
        import pyrage
    except ImportError:
        raise ValueError("age_encryption_recipients needs the pyrage package on the server (pip install pyrage), "
                         "or export without encryption") from None
    out = []
    for key in keys:
        try:
            out.append(pyrage.x25519.Recipient.from_str(key) if str(key).startswith("age1")
                       else pyrage.ssh.Recipient.from_str(key))
        except Exception:  # pyrage raises its own RecipientError / ValueError
            raise ValueError(f"age recipient {key!r} is neither an age1... key nor an SSH public key") from None
    return out


def write_external(adapter: Path, directory: Path, recipients: list) -> int:
    """The adapter's files into ``directory`` (encrypted to ``recipients`` as ``<file>.age`` when there are any);
    their total size. ``directory`` is replaced whole, so a reader never sees a half-written export."""
    staging = directory.with_name(f".{directory.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for f in sorted(adapter.iterdir()):
        if not f.is_file():
            continue
        if recipients:
            import pyrage

            (staging / f"{f.name}.age").write_bytes(pyrage.encrypt(f.read_bytes(), recipients))
        else:
            shutil.copy2(f, staging / f.name)
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    return directory_size(directory)


class UrlSigner:
    """Signed, expiring download URLs of files under the data directory (the key persists there, so URLs survive a
    restart)."""

    def __init__(self, data_dir: Path) -> None:
        key_file = data_dir / "url_signing.key"
        if not key_file.is_file():
            data_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        self._key = bytes.fromhex(key_file.read_text().strip())

    def token(self, checkpoint: str, name: str, expires: float) -> str:
        claim = base64.urlsafe_b64encode(json.dumps([checkpoint, name, int(expires)]).encode()).decode()
        return f"{claim}.{self._mac(claim)}"

    def verify(self, token: str) -> tuple[str, str]:
        """The checkpoint path and file name a token grants; ValueError for a forged or expired one."""
        claim, _, mac = token.partition(".")
        if not hmac.compare_digest(mac, self._mac(claim)):
            raise ValueError("the download URL's signature is not valid")
        checkpoint, name, expires = json.loads(base64.urlsafe_b64decode(claim.encode()))
        if time.time() > expires:
            raise ValueError("the download URL expired; ask external_weights_urls for new ones")
        return checkpoint, name

    def _mac(self, claim: str) -> str:
        return hmac.new(self._key, claim.encode(), hashlib.sha256).hexdigest()


class Rest:
    """The REST routes' bodies over the service's store (``owner``: the caller's API-key hash)."""

    def __init__(self, store, data_dir: Path) -> None:
        self.store = store
        self.signer = UrlSigner(data_dir)

    # ------------------------------------------------------------------ access
    def readable(self, owner: str, checkpoint: dict | None) -> bool:
        return checkpoint is not None and (checkpoint["owner"] == owner or bool(checkpoint["public"]))

    def _model(self, owner: str, model_id: str, access_scope: str = "owned") -> dict:
        if access_scope not in ("owned", "accessible"):
            raise ValueError(f"access_scope={access_scope!r} must be 'owned' or 'accessible'")
        row = self.store.model(model_id)
        if row is not None and (row["owner"] == owner or access_scope == "accessible" and any(
                c["public"] for c in self.store.model_checkpoints(model_id))):
            return row
        raise NotFound(f"training run {model_id!r} not found")

    def _checkpoint(self, owner: str, model_id: str, checkpoint_id: str) -> dict:
        """The owner's checkpoint ``checkpoint_id`` (``weights/<name>``, ``sampler_weights/<name>``,
        ``external_weights/<name>``) of ``model_id``."""
        row = self.store.checkpoint(f"tinker://{model_id}/{checkpoint_id}")
        if row is None or row["owner"] != owner:
            raise NotFound(f"checkpoint {checkpoint_id!r} of training run {model_id!r} not found (ids look like "
                           "weights/<name>, sampler_weights/<name> or external_weights/<name>)")
        return row

    # ------------------------------------------------------------------ answers
    def checkpoint_json(self, row: dict) -> dict:
        return {"checkpoint_id": f"{row['kind']}/{row['name']}", "checkpoint_type": CHECKPOINT_TYPES[row["kind"]],
                "time": iso(row["created"]), "tinker_path": row["path"], "size_bytes": directory_size(row["directory"]),
                "public": bool(row["public"]), "expires_at": iso(row["expires"])}

    def run_json(self, row: dict) -> dict:
        checkpoints = self.store.model_checkpoints(row["model_id"])
        newest = {kind: next((c for c in reversed(checkpoints) if c["kind"] == kind), None)
                  for kind in ("weights", "sampler_weights")}
        return {"training_run_id": row["model_id"], "base_model": row["base_model"], "model_owner": row["owner"],
                "is_lora": True, "corrupted": row["state"] == "lost", "lora_rank": row["config"]["rank"],
                "last_request_time": iso(self.store.last_request(row["model_id"]) or row["created"]),
                "last_checkpoint": newest["weights"] and self.checkpoint_json(newest["weights"]),
                "last_sampler_checkpoint": newest["sampler_weights"] and self.checkpoint_json(newest["sampler_weights"]),
                "user_metadata": {str(k): str(v) for k, v in row["metadata"].items()}}

    @staticmethod
    def _page(items: list, limit: int, offset: int) -> tuple[list, dict]:
        limit, offset = int(limit), int(offset)
        if not 1 <= limit <= PAGE_LIMIT or offset < 0:
            raise ValueError(f"limit={limit} must be in [1, {PAGE_LIMIT}] and offset={offset} >= 0")
        return items[offset:offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}

    def training_runs(self, owner: str, limit: int, offset: int, access_scope: str) -> dict:
        ids = self.store.owner_models(owner)
        if access_scope == "accessible":
            ids += [m for m in self.store.public_models() if m not in ids]
        elif access_scope != "owned":
            raise ValueError(f"access_scope={access_scope!r} must be 'owned' or 'accessible'")
        page, cursor = self._page(ids, limit, offset)
        return {"training_runs": [self.run_json(self.store.model(m)) for m in page], "cursor": cursor}

    def training_run(self, owner: str, model_id: str, access_scope: str) -> dict:
        return self.run_json(self._model(owner, model_id, access_scope))

    def checkpoints(self, owner: str, model_id: str) -> dict:
        self._model(owner, model_id)
        return {"checkpoints": [self.checkpoint_json(c) for c in reversed(self.store.model_checkpoints(model_id))]}

    def user_checkpoints(self, owner: str, limit: int, offset: int) -> dict:
        page, cursor = self._page(self.store.owner_checkpoints(owner), limit, offset)
        return {"checkpoints": [self.checkpoint_json(c) for c in page], "cursor": cursor}

    def delete_checkpoint(self, owner: str, model_id: str, checkpoint_id: str) -> None:
        row = self._checkpoint(owner, model_id, checkpoint_id)
        self.remove(row)

    def remove(self, row: dict) -> None:
        self.store.remove_checkpoint(row["path"])
        shutil.rmtree(row["directory"], ignore_errors=True)

    def set_ttl(self, owner: str, model_id: str, checkpoint_id: str, ttl_seconds: object) -> None:
        row = self._checkpoint(owner, model_id, checkpoint_id)
        self.store.set_expiry(row["path"], check_ttl(ttl_seconds))

    def publish(self, owner: str, model_id: str, checkpoint_id: str, public: bool) -> None:
        row = self._checkpoint(owner, model_id, checkpoint_id)
        self.store.set_public(row["path"], public)

    def weights_info(self, owner: str, tinker_path: str) -> dict:
        row = self.store.checkpoint(tinker_path)
        if not self.readable(owner, row):
            raise NotFound(f"checkpoint {tinker_path!r} not found")
        targets = set(row["config"]["targets"])
        return {"base_model": self.store.model(row["model_id"])["base_model"], "is_lora": True,
                "lora_rank": row["config"]["rank"], "train_unembed": "lm_head" in targets,
                "train_mlp": "gate_proj" in targets, "train_attn": "q_proj" in targets}

    def storage_usage(self, owner: str) -> dict:
        """The caller's checkpoints: how many, how many bytes (there are no prices here)."""
        sizes = [directory_size(c["directory"]) for c in self.store.owner_checkpoints(owner)]
        return {"data": [{"checkpoint_count": len(sizes), "size_bytes": sum(sizes),
                          "size_gigabytes": sum(sizes) / 1e9}]}

    def sessions(self, owner: str, limit: int, offset: int, access_scope: str) -> dict:
        if access_scope not in ("owned", "accessible"):  # sessions are never published: both are the owner's
            raise ValueError(f"access_scope={access_scope!r} must be 'owned' or 'accessible'")
        return {"sessions": self._page(self.store.owner_sessions(owner), limit, offset)[0]}

    def session(self, owner: str, session_id: str) -> dict:
        row = self.store.session(session_id)
        if row is None or row["owner"] != owner:
            raise NotFound(f"session {session_id!r} not found")
        return {"training_run_ids": self.store.session_models(session_id, live=False),
                "sampler_ids": self.store.session_samplers(session_id),
                "user_metadata": {str(k): str(v) for k, v in row["metadata"].items()} or None,
                "display_name": row["display_name"]}

    def external_urls(self, owner: str, model_id: str, checkpoint_id: str, base_url: str) -> dict:
        row = self._checkpoint(owner, model_id, checkpoint_id)
        if row["kind"] != "external_weights":
            raise ValueError(f"{row['path']!r} is not external weights: export them with save_weights_external")
        expires = time.time() + URL_LIFETIME
        if row["expires"] is not None:
            expires = min(expires, row["expires"])
        root = Path(row["directory"])
        urls = {f.relative_to(root).as_posix(): f"{base_url.rstrip('/')}/api/v1/external_files/"
                f"{self.signer.token(row['path'], f.relative_to(root).as_posix(), expires)}"
                for f in sorted(root.rglob("*")) if f.is_file()}
        return {"urls": urls, "expires": iso(expires)}

    def external_file(self, token: str) -> Path:
        """The file a signed URL names; ValueError / NotFound when the URL is bad or the checkpoint is gone."""
        path, name = self.signer.verify(token)
        row = self.store.checkpoint(path)
        if row is None:
            raise NotFound(f"checkpoint {path!r} was deleted")
        root = Path(row["directory"]).resolve()
        target = (root / name).resolve()
        if not target.is_relative_to(root) or not target.is_file():
            raise NotFound(f"{name!r} is not a file of {path!r}")
        return target

    def expire(self, now: float) -> list[str]:
        """Delete the checkpoints whose TTL ran out; their paths."""
        gone = self.store.expired(now)
        for row in gone:
            self.remove(row)
        return [row["path"] for row in gone]
