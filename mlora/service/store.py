"""The service's durable state in one SQLite file: sessions, client models, checkpoints, sampling sessions and
futures.

A restarted server reopens the file: sessions and checkpoints are still there (a client loads its checkpoint
into a new training client and goes on), finished futures can still be retrieved, and futures that were
pending when the server stopped fail with a message saying so. Every owner (an API key, stored as its hash)
sees only its own models and checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL,
    heartbeat REAL NOT NULL, finished INTEGER NOT NULL DEFAULT 0, metadata TEXT NOT NULL DEFAULT '{}',
    display_name TEXT);
CREATE TABLE IF NOT EXISTS models (model_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL,
    base_model TEXT NOT NULL, config TEXT NOT NULL, metadata TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL,
    state TEXT NOT NULL DEFAULT 'live', last_seq INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS checkpoints (path TEXT PRIMARY KEY, model_id TEXT NOT NULL, owner TEXT NOT NULL,
    kind TEXT NOT NULL, name TEXT NOT NULL, directory TEXT NOT NULL, config TEXT NOT NULL, created REAL NOT NULL,
    last_sampled REAL NOT NULL DEFAULT 0, expires REAL, public INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS futures (request_id TEXT PRIMARY KEY, owner TEXT NOT NULL, model_id TEXT,
    seq_id INTEGER, kind TEXT NOT NULL, state TEXT NOT NULL, content_type TEXT, payload BLOB, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS samplers (sampler_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, owner TEXT NOT NULL,
    base_model TEXT NOT NULL, model_path TEXT, created REAL NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS futures_by_seq ON futures (model_id, seq_id) WHERE seq_id IS NOT NULL;
"""
# columns later servers added: a data dir of an earlier server gets them when it is opened
ADDED_COLUMNS = {"checkpoints": (("last_sampled", "REAL NOT NULL DEFAULT 0"), ("expires", "REAL"),
                                 ("public", "INTEGER NOT NULL DEFAULT 0")),
                 "sessions": (("display_name", "TEXT"),)}
CHECKPOINT_COLUMNS = "path, model_id, owner, kind, name, directory, config, created, last_sampled, expires, public"


def owner_of(api_key: str | None) -> str:
    """The owner id of an API key (a hash: the key itself is never stored)."""
    return hashlib.sha256((api_key or "").encode()).hexdigest()[:16]


class Store:
    """Thread-safe access to the SQLite file (one connection, one lock: the service's writes are small)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(SCHEMA)
        for table, added in ADDED_COLUMNS.items():
            columns = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            for name, declaration in added:
                if name not in columns:
                    self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {declaration}")
        self._lock = threading.Lock()
        # what a previous server left running cannot finish now
        self._run("UPDATE futures SET state='error', content_type='application/json', payload=? WHERE state='pending'",
                  (json.dumps({"error": "the server restarted before this request ran; submit it again",
                               "category": "server"}).encode(),))
        self._run("UPDATE models SET state='lost' WHERE state='live'")

    def _run(self, sql: str, args: tuple = ()) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def _one(self, sql: str, args: tuple, json_fields: tuple[str, ...] = ()) -> dict | None:
        """The first row of a query as a dict by column name (``json_fields`` decoded), or None."""
        with self._lock:
            cursor = self._db.execute(sql, args)
            row = cursor.fetchone()
            names = [d[0] for d in cursor.description]
        if row is None:
            return None
        out = dict(zip(names, row))
        for name in json_fields:
            out[name] = json.loads(out[name])
        return out

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ sessions
    def add_session(self, session_id: str, owner: str, metadata: dict, display_name: str | None = None) -> None:
        now = time.time()
        self._run("INSERT INTO sessions (session_id, owner, created, heartbeat, metadata, display_name) "
                  "VALUES (?, ?, ?, ?, ?, ?)", (session_id, owner, now, now, json.dumps(metadata), display_name))

    def session(self, session_id: str) -> dict | None:
        return self._one("SELECT session_id, owner, created, finished, metadata, display_name FROM sessions "
                         "WHERE session_id=?", (session_id,), ("metadata",))

    def owner_sessions(self, owner: str) -> list[str]:
        """The owner's session ids, newest first."""
        return [r[0] for r in self._run("SELECT session_id FROM sessions WHERE owner=? ORDER BY created DESC",
                                        (owner,))]

    def session_owner(self, session_id: str) -> str | None:
        rows = self._run("SELECT owner FROM sessions WHERE session_id=?", (session_id,))
        return rows[0][0] if rows else None

    def heartbeat(self, session_id: str) -> bool:
        """Record a heartbeat; False when the session is unknown or finished (the client must stop)."""
        rows = self._run("SELECT finished FROM sessions WHERE session_id=?", (session_id,))
        if not rows or rows[0][0]:
            return False
        self._run("UPDATE sessions SET heartbeat=? WHERE session_id=?", (time.time(), session_id))
        return True

    def finish_session(self, session_id: str) -> None:
        self._run("UPDATE sessions SET finished=1 WHERE session_id=?", (session_id,))

    def silent_sessions(self, older_than: float) -> list[str]:
        """Live sessions whose last heartbeat is older than ``older_than`` (a time)."""
        return [r[0] for r in self._run("SELECT session_id FROM sessions WHERE finished=0 AND heartbeat<?",
                                        (older_than,))]

    # ------------------------------------------------------------------ models
    def add_model(self, model_id: str, session_id: str, owner: str, base_model: str, config: dict,
                  metadata: dict) -> None:
        self._run("INSERT INTO models (model_id, session_id, owner, base_model, config, metadata, created) "
                  "VALUES (?, ?, ?, ?, ?, ?, ?)",
                  (model_id, session_id, owner, base_model, json.dumps(config), json.dumps(metadata), time.time()))

    def model(self, model_id: str) -> dict | None:
        return self._one("SELECT model_id, session_id, owner, base_model, config, metadata, state, created FROM models "
                         "WHERE model_id=?", (model_id,), ("config", "metadata"))

    def owner_models(self, owner: str) -> list[str]:
        """The owner's model ids, newest first."""
        return [r[0] for r in self._run("SELECT model_id FROM models WHERE owner=? ORDER BY created DESC", (owner,))]

    def public_models(self) -> list[str]:
        """Models with a published checkpoint, newest first."""
        return [r[0] for r in self._run("SELECT DISTINCT m.model_id FROM models m JOIN checkpoints c ON "
                                        "c.model_id=m.model_id WHERE c.public=1 ORDER BY m.created DESC")]

    def last_request(self, model_id: str) -> float | None:
        """When the model's newest request arrived (None: it has had none)."""
        return self._run("SELECT max(created) FROM futures WHERE model_id=?", (model_id,))[0][0]

    def set_model_state(self, model_id: str, state: str) -> None:
        self._run("UPDATE models SET state=? WHERE model_id=?", (state, model_id))

    def session_models(self, session_id: str, live: bool = True) -> list[str]:
        """The session's models (``live``: only those not freed or lost)."""
        return [r[0] for r in self._run("SELECT model_id FROM models WHERE session_id=?" +
                                        (" AND state='live'" if live else "") + " ORDER BY created", (session_id,))]

    # ------------------------------------------------------------------ checkpoints
    def add_checkpoint(self, path: str, model_id: str, owner: str, kind: str, name: str, directory: str,
                       config: dict, expires: float | None = None) -> None:
        """Record a checkpoint (a new one, or one rewritten under its path: not published, ``expires`` its TTL)."""
        self._run("INSERT OR REPLACE INTO checkpoints (path, model_id, owner, kind, name, directory, config, created, "
                  "expires) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                  (path, model_id, owner, kind, name, directory, json.dumps(config), time.time(), expires))

    def checkpoint(self, path: str) -> dict | None:
        return self._one(f"SELECT {CHECKPOINT_COLUMNS} FROM checkpoints WHERE path=?", (path,), ("config",))

    def owner_checkpoints(self, owner: str) -> list[dict]:
        """The owner's checkpoints, newest first."""
        return [self.checkpoint(r[0]) for r in self._run("SELECT path FROM checkpoints WHERE owner=? ORDER BY "
                                                         "created DESC", (owner,))]

    def set_expiry(self, path: str, expires: float | None) -> None:
        self._run("UPDATE checkpoints SET expires=? WHERE path=?", (expires, path))

    def set_public(self, path: str, public: bool) -> None:
        self._run("UPDATE checkpoints SET public=? WHERE path=?", (int(public), path))

    def expired(self, now: float) -> list[dict]:
        """Checkpoints whose TTL ran out by ``now``."""
        return [self.checkpoint(r[0]) for r in self._run("SELECT path FROM checkpoints WHERE expires IS NOT NULL "
                                                         "AND expires<=?", (now,))]

    def sampled(self, path: str, when: float) -> None:
        """Checkpoint ``path`` was sampled at ``when`` (a client holds it: :meth:`Service._prune_ephemeral`)."""
        self._run("UPDATE checkpoints SET last_sampled=? WHERE path=?", (when, path))

    def model_checkpoints(self, model_id: str, kind: str | None = None) -> list[dict]:
        """The model's checkpoints (of ``kind``, or all), oldest first."""
        rows = self._run("SELECT path FROM checkpoints WHERE model_id=?" + (" AND kind=?" if kind else "") +
                         " ORDER BY created", (model_id, kind) if kind else (model_id,))
        return [self.checkpoint(r[0]) for r in rows]

    def remove_checkpoint(self, path: str) -> None:
        self._run("DELETE FROM checkpoints WHERE path=?", (path,))

    # ------------------------------------------------------------------ sampling sessions
    def add_sampler(self, sampler_id: str, session_id: str, owner: str, base_model: str,
                    model_path: str | None) -> None:
        self._run("INSERT OR REPLACE INTO samplers (sampler_id, session_id, owner, base_model, model_path, created) "
                  "VALUES (?, ?, ?, ?, ?, ?)", (sampler_id, session_id, owner, base_model, model_path, time.time()))

    def session_samplers(self, session_id: str) -> list[str]:
        return [r[0] for r in self._run("SELECT sampler_id FROM samplers WHERE session_id=? ORDER BY created",
                                        (session_id,))]

    def sampler(self, sampler_id: str) -> dict | None:
        return self._one("SELECT sampler_id, session_id, owner, base_model, model_path FROM samplers "
                         "WHERE sampler_id=?", (sampler_id,))

    # ------------------------------------------------------------------ futures
    def add_future(self, request_id: str, owner: str, kind: str, model_id: str | None = None,
                   seq_id: int | None = None) -> str:
        """Record a pending future; an existing one for the same (model, seq_id), a retried submission, is
        returned instead (its request id)."""
        if model_id is not None and seq_id is not None:
            rows = self._run("SELECT request_id FROM futures WHERE model_id=? AND seq_id=?", (model_id, seq_id))
            if rows:
                return rows[0][0]
        self._run("INSERT INTO futures (request_id, owner, model_id, seq_id, kind, state, created) "
                  "VALUES (?, ?, ?, ?, ?, 'pending', ?)", (request_id, owner, model_id, seq_id, kind, time.time()))
        return request_id

    def finish_future(self, request_id: str, state: str, content_type: str, payload: bytes) -> None:
        self._run("UPDATE futures SET state=?, content_type=?, payload=? WHERE request_id=?",
                  (state, content_type, payload, request_id))

    def future(self, request_id: str) -> dict | None:
        return self._one("SELECT owner, state, content_type, payload, kind, model_id FROM futures WHERE request_id=?",
                         (request_id,))
