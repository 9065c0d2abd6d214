"""trainer.logger backends, offline: W&B (``WANDB_MODE=offline``) and TensorBoard both hold the logged
metrics, a resumed run continues the same W&B run id and TensorBoard shows each step once, and a backend
that is not installed is a config error before any model loads."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from mlora.train.metrics_log import WANDB_ID_FILE, MetricsLogger

pytestmark = pytest.mark.quick


def _log(run_dir: Path, kind: str, steps: dict[int, float], resume_step: int | None = None) -> None:
    m = MetricsLogger(kind, run_dir, "mlora-tests", "backends", resume_step=resume_step)
    for step, value in steps.items():
        m.log(step, {"reward/mean": value, "note": "not a number: jsonl and backends skip it"})
    m.close()


def _wandb_history(run_file: Path) -> list[dict]:
    """History rows of an offline ``run-<id>.wandb`` file: a 7-byte header (":W&B", magic, version), then
    LevelDB log records (32 KiB blocks; 7-byte record headers: crc, length, type) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, payloads, parts = 7, 32768, [], []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and n == 0:
            break
        parts.append(data[pos:pos + n])
        pos += n
        if kind in (1, 4):  # FULL or LAST
            payloads.append(b"".join(parts))
            parts = []
    rows = []
    for payload in payloads:
        rec = pb.Record()
        rec.ParseFromString(payload)
        if rec.WhichOneof("record_type") == "history":
            rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_wandb_offline_keeps_metrics_and_resumes_the_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _log(run_dir, "wandb", {1: 0.1, 2: 0.2, 3: 0.3})
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    _log(run_dir, "wandb", {3: 3.0, 4: 4.0}, resume_step=2)
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == run_id
    # One run, two launches. W&B names a launch's folder by its start second and adds "-1" when two start
    # in the same second, so the folders' names do not order the launches: their first rows' times do.
    runs = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert len(runs) == 2, runs
    first, second = sorted((_wandb_history(r / f"run-{run_id}.wandb") for r in runs),
                           key=lambda rows: rows[0]["_timestamp"] if rows else float("inf"))
    assert [(r["_step"], r["reward/mean"]) for r in first] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [(r["_step"], r["reward/mean"]) for r in second] == [(3, 3.0), (4, 4.0)]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 3.0), (4, 4.0)]


def test_tensorboard_event_files_read_back_once_per_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _log(run_dir, "tensorboard", {1: 0.1, 2: 0.2, 3: 0.3})
    _log(run_dir, "tensorboard", {3: 3.0, 4: 4.0}, resume_step=2)  # step 3 ran again after the checkpoint
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    got = [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")]
    assert got == [(1, 0.1), (2, 0.2), (3, 3.0), (4, 4.0)], got


@pytest.mark.parametrize("logger,package", [("wandb", "wandb"), ("tensorboard", "tensorboard")])
def test_missing_backend_is_a_config_error(logger, package, monkeypatch):
    import importlib.util

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.config.validate import ConfigError, finalize
    from mlora.train.__main__ import CONFIG_DIR

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="ppo", overrides=["trainer.policy.model.path=/m",
                                                                         f"trainer.logger={logger}"]))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(ConfigError, match=rf"trainer.logger={logger} needs the {package} package, which is not "
                                          r"installed: pip install 'mlora\[logging\]'"):
        finalize(cfg, 1)
