"""Checkpoints without a trainer: atomic visibility, the latest pointer, pruning, fall-back past damaged
checkpoints, base-model identity, optimizer pieces read back on other TP sizes, the metrics record on
resume, the data position, preemption signals and the resume keys' errors."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mlora.checkpoint import dirs as ck
from mlora.checkpoint.dirs import CheckpointError
from mlora.formats.durable import write_text_atomic

pytestmark = pytest.mark.quick

BASE = {"base_model": {"path": "/nowhere", "sha256": "0"}}


def _fake_checkpoint(root: Path, step: int, payload: bytes = b"x" * 100) -> Path:
    """A committed checkpoint with one data file, through the real begin/commit protocol."""
    tmp = ck.begin(root, step)
    (tmp / "optim").mkdir()
    (tmp / "optim" / "pp0-tp0.safetensors").write_bytes(payload)
    return ck.commit(root, step, {"optim/pp0-tp0.safetensors": len(payload)}, BASE)


def test_commit_is_atomic_and_moves_the_pointer(tmp_path):
    root = tmp_path / "ckpts"
    tmp = ck.begin(root, 3)
    (tmp / "a.bin").write_bytes(b"abc")
    assert ck.list_checkpoints(root) == [] and ck.find_latest(root) is None  # being written: invisible
    final = ck.commit(root, 3, {"a.bin": 3}, BASE)
    assert final == root / "global_step_3" and not tmp.exists()
    assert (root / ck.LATEST_FILE).read_text().strip() == "3"
    assert ck.check_complete(final)["step"] == 3 and ck.find_latest(root) == final
    # a stale temporary directory from a killed save is replaced, and an existing step is replaced whole
    ck.begin(root, 3)
    (ck.temp_dir(root, 3) / "b.bin").write_bytes(b"de")
    ck.commit(root, 3, {"b.bin": 2}, BASE)
    assert sorted(p.name for p in final.iterdir()) == ["b.bin", "manifest.json"]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


def test_prune_keeps_the_newest(tmp_path):
    root = tmp_path / "ckpts"
    for step in (2, 4, 6, 8):
        _fake_checkpoint(root, step)
    assert ck.prune(root, -1, 8) == []
    ck.prune(root, 2, 8)
    assert [s for s, _ in ck.list_checkpoints(root)] == [6, 8]
    _fake_checkpoint(root, 10)
    ck.prune(root, 2, 6)  # a run resumed at 6: step 10 belongs to another branch and is left alone
    assert [s for s, _ in ck.list_checkpoints(root)] == [6, 8, 10]


def test_latest_falls_back_past_damaged_checkpoints(tmp_path, caplog):
    root = tmp_path / "ckpts"
    for step in (1, 2, 3):
        _fake_checkpoint(root, step)
    data = root / "global_step_3" / "optim" / "pp0-tp0.safetensors"
    data.write_bytes(data.read_bytes()[:50])  # truncated
    (root / "global_step_2" / "optim" / "pp0-tp0.safetensors").unlink()  # deleted
    with caplog.at_level(logging.WARNING, logger="mlora"):
        assert ck.resolve_resume("latest", root, None) == root / "global_step_1"
    text = caplog.text
    assert "global_step_3 is damaged: optim/pp0-tp0.safetensors has 50 bytes, 100 were written" in text
    assert "global_step_2 is damaged: optim/pp0-tp0.safetensors is missing" in text
    assert "newest complete checkpoint before the latest (step 3)" in text
    with pytest.raises(CheckpointError, match="has 50 bytes, 100 were written"):
        ck.resolve_resume("from_path", root, str(root / "global_step_3"))
    (root / "global_step_1" / ck.MANIFEST).unlink()
    assert ck.resolve_resume("latest", root, None) is None


def test_resume_modes(tmp_path, caplog):
    root = tmp_path / "ckpts"
    assert ck.resolve_resume(None, root, None) is None and ck.resolve_resume("none", root, "/x") is None
    with caplog.at_level(logging.INFO, logger="mlora"):
        assert ck.resolve_resume("latest", root, None) is None
    assert "no complete checkpoint in" in caplog.text and "starting from step 0" in caplog.text
    with pytest.raises(CheckpointError, match="needs trainer.resume_path"):
        ck.resolve_resume("from_path", root, None)
    (tmp_path / "not_a_ckpt").mkdir()
    with pytest.raises(CheckpointError, match="is not a complete mlora checkpoint: it has no manifest.json"):
        ck.resolve_resume("from_path", root, str(tmp_path / "not_a_ckpt"))
    with pytest.raises(CheckpointError, match="does not exist"):
        ck.resolve_resume("from_path", root, str(tmp_path / "missing"))
    # checkpoints newer than the pointer (another branch) are not "latest"
    for step in (2, 5):
        _fake_checkpoint(root, step)
    write_text_atomic(root / ck.LATEST_FILE, "2\n")
    assert ck.find_latest(root) == root / "global_step_2"


def test_base_model_identity(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"")
    manifest = {"base_model": ck.base_model_identity(model)}
    ck.check_base_model(manifest, model, tmp_path)
    other = tmp_path / "m2"
    other.mkdir()
    (other / "config.json").write_text('{"hidden_size": 64}')
    with pytest.raises(CheckpointError, match="was trained on the base model .*m'.* this run's"):
        ck.check_base_model(manifest, other, tmp_path)
    (model / "config.json").write_text('{"hidden_size": 128}')
    with pytest.raises(CheckpointError, match="changed since the checkpoint was written"):
        ck.check_base_model(manifest, model, tmp_path)


# ------------------------------------------------------------------ optimizer pieces on any TP
def _canonical(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"q.A": torch.randn(4, 8, generator=g), "k.A": torch.randn(4, 8, generator=g),
            "q.B": torch.randn(8, 4, generator=g), "o.A": torch.randn(4, 8, generator=g),
            "o.B": torch.randn(8, 4, generator=g), "head": torch.randn(1, 8, generator=g)}


def _rank_params(tp: int, tp_rank: int, c: dict[str, torch.Tensor]):
    """One rank's parameters (values = the canonical tensors' slices) and their pieces, as the model lays them out."""
    from mlora.checkpoint.optim_state import Piece
    from mlora.formats.weight_map import COLUMNS, REPLICATED, ROWS

    return [
        (torch.cat([c["q.A"], c["k.A"]]), [Piece("q.A", REPLICATED, (0, 4)), Piece("k.A", REPLICATED, (4, 8))]),
        (c["q.B"].chunk(tp, 0)[tp_rank].clone(), [Piece("q.B", ROWS)]),
        (c["o.A"].chunk(tp, 1)[tp_rank].clone(), [Piece("o.A", COLUMNS)]),
        (c["o.B"].clone(), [Piece("o.B", REPLICATED)]),
        (c["head"].clone(), [Piece("head", REPLICATED)]),
    ]


@pytest.mark.parametrize("save_tp,load_tp", [(2, 1), (1, 4), (4, 2)])
def test_optimizer_pieces_reshard(tmp_path, save_tp, load_tp):
    """Moments saved by the owners on one TP size are read back exactly on another (DP replicas write nothing)."""
    from mlora.checkpoint.optim_state import OptimizerStateReader, load_optimizer_state, write_optimizer_state

    avg, sq = _canonical(1), _canonical(2)
    for dp_rank in (0, 1):
        for t in range(save_tp):
            mesh = SimpleNamespace(tp=save_tp, tp_rank=t, dp_rank=dp_rank)
            params = _rank_params(save_tp, t, _canonical(0))
            state = {p: {"exp_avg": a, "exp_avg_sq": s, "step": torch.tensor(7.0)}
                     for (p, _), (a, _), (s, _) in zip(params, _rank_params(save_tp, t, avg),
                                                        _rank_params(save_tp, t, sq))}
            out = write_optimizer_state(tmp_path / f"pp0-tp{t}-dp{dp_rank}.safetensors",
                                        {"actor": (SimpleNamespace(state=state), params)}, mesh)
            assert (out is None) == (dp_rank == 1)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"pp0-tp{t}-dp0.safetensors" for t in range(save_tp)]
    reader = OptimizerStateReader(tmp_path)
    for t in range(load_tp):
        params = _rank_params(load_tp, t, _canonical(0))
        opt = SimpleNamespace(state={})
        assert load_optimizer_state(reader, "actor", opt, params, SimpleNamespace(tp=load_tp, tp_rank=t)) == 5
        for (p, _), (a, _), (s, _) in zip(params, _rank_params(load_tp, t, avg), _rank_params(load_tp, t, sq)):
            assert torch.equal(opt.state[p]["exp_avg"], a) and torch.equal(opt.state[p]["exp_avg_sq"], s)
            assert float(opt.state[p]["step"]) == 7.0 and opt.state[p]["step"].dim() == 0
    reader.close()


def test_optimizer_pieces_missing_file(tmp_path):
    from mlora.checkpoint.optim_state import OptimizerStateReader, load_optimizer_state, write_optimizer_state

    for t in range(2):
        params = _rank_params(2, t, _canonical(0))
        state = {p: {"exp_avg": p.clone(), "exp_avg_sq": p.clone(), "step": torch.tensor(1.0)} for p, _ in params}
        write_optimizer_state(tmp_path / f"pp0-tp{t}.safetensors", {"actor": (SimpleNamespace(state=state), params)},
                              SimpleNamespace(tp=2, tp_rank=t, dp_rank=0))
    (tmp_path / "pp0-tp1.safetensors").unlink()
    reader = OptimizerStateReader(tmp_path)
    with pytest.raises(CheckpointError, match="cover 4 of rows"):
        load_optimizer_state(reader, "actor", SimpleNamespace(state={}), _rank_params(1, 0, _canonical(0)),
                             SimpleNamespace(tp=1, tp_rank=0))


# ------------------------------------------------------------------ the run's record and position
def test_metrics_record_on_resume(tmp_path):
    from mlora.train.metrics_log import prepare_metrics_file

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": s / 10}) + "\n" for s in range(0, 6)) + '{"step": 6, "rew')
    prepare_metrics_file(path, resume_step=3)  # died after logging 5 (and half of 6), checkpointed at 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]
    prepare_metrics_file(path, resume_step=None)  # a fresh run keeps the old record aside
    assert not path.exists() and len(list(tmp_path.glob("metrics.*.jsonl"))) == 1


def test_data_position():
    from mlora.rollout.data import epoch_batches

    full = list(epoch_batches(10, 3, seed=5, total_steps=8))
    assert [s for _, s, _ in full] == list(range(1, 9)) and full[3][0] == 1  # 3 batches per epoch
    for k in range(9):
        assert list(epoch_batches(10, 3, seed=5, total_steps=8, start_step=k)) == full[k:]


# ------------------------------------------------------------------ preemption signals
def test_preemption_guard():
    from mlora.train.preemption import EX_TEMPFAIL, Preempted, PreemptionGuard

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Preempted) as info:  # start-up (model loading, engines): stop at once
        with PreemptionGuard():
            os.kill(os.getpid(), signal.SIGTERM)
    assert info.value.step is None and info.value.code == 75
    signal.signal(signal.SIGTERM, before)
    with PreemptionGuard() as guard:
        guard.defer()  # the training loop: finish the step first
        assert not guard.requested and not guard.agreed()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal (e.g. during the save) only counts
        assert guard.received == "SIGUSR1" and guard.count == 2 and guard.agreed()
    assert signal.getsignal(signal.SIGTERM) is before  # a normal end gives the old handlers back
    with pytest.raises(Preempted) as info:
        with PreemptionGuard():
            raise Preempted(3, None)
    assert info.value.code == EX_TEMPFAIL == 75
    assert signal.getsignal(signal.SIGTERM) is not before  # still guarded: the process is about to exit 75
    signal.signal(signal.SIGTERM, before)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_marker(tmp_path):
    from mlora.train.preemption import MARKER, clear_marker, write_marker

    write_marker(tmp_path, 4, tmp_path / "ckpts" / "global_step_4", "SIGTERM")
    body = json.loads((tmp_path / MARKER).read_text())
    assert body["step"] == 4 and body["checkpoint"].endswith("global_step_4") and body["exit_code"] == 75
    clear_marker(tmp_path)
    assert not (tmp_path / MARKER).exists()


# ------------------------------------------------------------------ keys
def test_resume_keys(tmp_path):
    from mlora.config.schema import TrainConfig
    from mlora.config.validate import ConfigError, finalize

    def check(**trainer):
        cfg = TrainConfig()
        cfg.trainer.policy.model.path = str(tmp_path)
        for k, v in trainer.items():
            setattr(cfg.trainer, k, v)
        finalize(cfg, 1)
        return cfg

    assert check().trainer.resume_mode == "none" and check(resume_mode="latest").trainer.resume_mode == "latest"
    with pytest.raises(ConfigError, match="resume_mode=from_path needs trainer.resume_path"):
        check(resume_mode="from_path")
    with pytest.raises(ConfigError, match=r"trainer.resume_path='.*': .* is not a complete mlora checkpoint"):
        check(resume_mode="from_path", resume_path=str(tmp_path))
    with pytest.raises(ConfigError, match="trainer.resume_mode='last' is not valid; valid: none, latest, from_path"):
        check(resume_mode="last")
    with pytest.raises(ConfigError, match="max_ckpts_to_keep=0"):
        check(max_ckpts_to_keep=0)
    _fake_checkpoint(tmp_path / "ckpts", 2)
    assert check(resume_mode="from_path", resume_path=str(tmp_path / "ckpts" / "global_step_2"))


def test_one_checkpoint_writer_for_every_stage(model, tmp_path):
    """A reward-model checkpoint (adapter, bias-free score head, AdamW moments, LR schedule, the engine's
    step) goes through the writer and reader PPO's does and reads back exactly; a run of another stage
    refuses it, naming both stages."""
    from mlora.checkpoint.run_state import load_run_state, read_loop_state, write_run_state
    from mlora.train.preference_engine import PreferenceConfig, PreferenceEngine

    cfg = PreferenceConfig(stage="rm", micro_batch_size=1, lr=1e-3, total_steps=10, warmup_steps=2)
    rm = PreferenceEngine(model, cfg, adapter="rm")
    try:
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            for p in rm.params:
                p.grad = torch.randn(p.shape, generator=g)
            rm.opt.step()
            rm.sched.step()
        rm.global_step = 2

        def snapshot(engine):
            return ([p.detach().clone() for p in engine.params],
                    [{k: v.clone() for k, v in engine.opt.state[p].items()} for p in engine.params],
                    engine.opt.param_groups[0]["lr"], engine.global_step)

        want = snapshot(rm)
        assert len(want[0]) == len(model.adapter_parameters("rm")) + 1  # the score head, bias-free
        write_run_state(tmp_path, model, rm, {"step": 2}, "")
        assert read_loop_state(tmp_path)["stage"] == "rm"
        with torch.no_grad():
            for p in rm.params:
                p.zero_()
        fresh = PreferenceEngine(model, cfg, adapter="rm")  # the same adapter and head, zeroed; no AdamW state
        load_run_state(tmp_path, model, fresh)
        got = snapshot(fresh)
        assert all(torch.equal(a, b) for a, b in zip(want[0], got[0]))
        assert all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(want[1], got[1]))
        assert got[2:] == want[2:]

        dpo = PreferenceEngine(model, PreferenceConfig(stage="dpo", micro_batch_size=1), adapter="rm")
        with pytest.raises(CheckpointError, match="is of stage 'rm', this run is 'dpo'"):
            load_run_state(tmp_path, model, dpo)
    finally:
        del model.heads["rm"]


def test_rng_state_holds_the_ranks_own_gpu_only(tmp_path, monkeypatch):
    """Issue 22: a rank saves and restores the CUDA generator of its own device only, so a resume on a node
    that shows fewer GPUs (2 here, 8 when saved) works; the old per-index save of every visible GPU crashed."""
    from mlora.checkpoint import rng_state

    visible = {"n": 8}
    states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(8)}
    restored = {}

    def set_all(new):
        if len(new) > visible["n"]:
            raise IndexError(f"{len(new)} states for {visible['n']} visible devices")
        restored.update(enumerate(new))

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: visible["n"])
    monkeypatch.setattr(cuda, "current_device", lambda: 1)
    monkeypatch.setattr(cuda, "get_rng_state", lambda device="cuda": states[device].clone())
    monkeypatch.setattr(cuda, "get_rng_state_all", lambda: [states[i].clone() for i in range(visible["n"])])
    monkeypatch.setattr(cuda, "set_rng_state", lambda state, device="cuda": restored.__setitem__(device, state))
    monkeypatch.setattr(cuda, "set_rng_state_all", set_all)
    monkeypatch.setattr(rng_state, "_megatron_tracker", lambda: None)
    path = rng_state.save(tmp_path / "rank0.safetensors", {"rank": 0})
    visible["n"] = 2
    rng_state.restore(path)
    assert list(restored) == [1] and torch.equal(restored[1], states[1])
