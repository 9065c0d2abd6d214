"""What a checkpoint holds, for every stage (PPO/GRPO/RLOO, SFT, reward model, DPO), written by the
ranks that own it and read back on any mesh.

Inside ``global_step_<k>/`` (the directory protocol is :mod:`mlora.checkpoint.dirs`)::

    adapters/<name>/adapter_config.json         each trained adapter in PEFT layout, as exported (each
    adapters/<name>/adapter_model.safetensors   rank writes its shards into the one file, no gather;
                                                loads in PEFT and vLLM, `mlora export-adapter` reads it)
    heads/<name>.safetensors                    a trained adapter's head: the critic's value head (TRL's
                                                v_head.summary.* names), the reward model's score.weight
    optim/pp<p>-tp<t>.safetensors               AdamW moments and step counts, canonical pieces
                                                (mlora.checkpoint.optim_state), written by their owners
    rng/rank<r>.safetensors                     each rank's generator states (mlora.checkpoint.rng_state)
    trainer_state.json                          the stage, step, data position, LR schedulers, the engine's
                                                counters (its step, the KL coefficient), LoRA dropout
                                                counters, the mesh it was saved on
    config.yaml                                 the run's configuration
    manifest.json                               every file and its size, the base model's identity

Nothing is pickled: tensors are safetensors, scalars JSON. A stage's engine says what it trains
(:class:`StageState`); this module alone decides where each part goes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from mlora.checkpoint import rng_state
from mlora.checkpoint.dirs import CheckpointError
from mlora.checkpoint.optim_state import (
    OptimizerStateReader,
    Piece,
    adapter_pieces,
    load_optimizer_state,
    write_optimizer_state,
)
from mlora.formats.checkpoint_reader import CheckpointReader
from mlora.formats.durable import fsync_file
from mlora.formats.safetensors_writer import SafetensorsWriter
from mlora.formats.weight_map import REPLICATED

log = logging.getLogger("mlora")

ADAPTERS, HEADS, OPTIM, RNG = "adapters", "heads", "optim", "rng"
STATE_FILE, CONFIG_FILE = "trainer_state.json", "config.yaml"
MESH_KEYS = ("tp", "pp", "dp")
VALUE_HEAD = ("v_head.summary.weight", "v_head.summary.bias")  # TRL's names of a value head's weight and bias
SCORE_HEAD = ("score.weight",)  # HF's sequence-classification head (a reward model's; bias-free)


@dataclass
class TrainedAdapter:
    """One optimizer's share of a stage: an adapter, the head trained with it, its optimizer and LR schedule."""

    role: str  # the optimizer group's name in optim/ ("actor", "critic")
    adapter: str
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    # the head's parameters by their saved names, on the pipeline stage that holds the head (empty elsewhere)
    head: dict[str, torch.nn.Parameter] = field(default_factory=dict)
    experiment: str | None = None  # the experiment it belongs to (runs with several, mlora.config.experiments)


@dataclass
class StageState:
    """What a stage trains, as its checkpoint holds it."""

    stage: str  # "rl", "sft", "rm", "dpo": a checkpoint resumes a run of its own stage only
    trained: list[TrainedAdapter]
    counters: dict[str, float]  # the engine's scalars (JSON): its step count, the KL controller's value
    # the run's experiments (empty: a run without); a resume loads the ones the checkpoint holds, starts the
    # others fresh and leaves the checkpoint's others behind
    experiments: tuple[str, ...] = ()


class Checkpointable(Protocol):
    """An engine whose training state checkpoints hold (:class:`mlora.train.engine.ActorCriticEngine`,
    :class:`mlora.train.preference_engine.PreferenceEngine`)."""

    def stage_state(self) -> StageState: ...

    def restore_counters(self, counters: dict[str, float]) -> None: ...


def head_parameters(model, head: str, names: tuple[str, ...]) -> dict[str, torch.nn.Parameter]:
    """``model.heads[head]``'s weight (and bias) under the saved ``names`` (:data:`VALUE_HEAD`,
    :data:`SCORE_HEAD`); empty on the pipeline stages without the head."""
    if head not in model.heads:
        return {}
    params = [p for p in (model.heads[head].weight, model.heads[head].bias) if p is not None]
    if len(params) != len(names):
        raise ValueError(f"head {head!r} has {len(params)} parameters, names given for {len(names)}: {names}")
    return dict(zip(names, params))


def _mesh_coords(mesh) -> dict:
    return {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp, "world_size": mesh.world_size, "rank": mesh.rank,
            "tp_rank": mesh.tp_rank, "pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank}


def _optimizer_groups(model, state: StageState) -> dict[str, tuple]:
    return {t.role: (t.optimizer, adapter_pieces(model, t.adapter)
                     + [(p, [Piece(name, REPLICATED)]) for name, p in t.head.items()]) for t in state.trained}


def _dropout_calls(model, adapter: str) -> int:
    """Forward calls that drew LoRA dropout masks for ``adapter`` on this rank (the same on every branch)."""
    calls = [linear.lora[adapter].dropout_calls for linear in model._lora_linears() if adapter in linear.lora]
    return max(calls, default=0)


def _write_head(head: dict[str, torch.nn.Parameter], path: Path) -> Path:
    tensors = {n: p.detach().cpu().contiguous() for n, p in head.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsWriter(path, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()})
    for n, t in tensors.items():
        writer.write(n, t)
    writer.close()
    return path


def write_run_state(directory: Path, model, engine: Checkpointable, loop_state: dict, config_text: str
                    ) -> list[Path]:
    """Collective: write this rank's part of the training state into ``directory``; every file it wrote
    is fsynced and returned (for the manifest)."""
    mesh, mine, state = model.mesh, [], engine.stage_state()
    for t in state.trained:  # each stage's ranks write their own shards into one PEFT file (no gather)
        model.save_adapter(t.adapter, directory / ADAPTERS / t.adapter)
        if mesh.rank == 0:
            mine += sorted((directory / ADAPTERS / t.adapter).iterdir())
        if t.head and mesh.tp_rank == 0 and mesh.dp_rank == 0:
            mine.append(_write_head(t.head, directory / HEADS / f"{t.adapter}.safetensors"))
    ep = f"-ep{mesh.ep_rank}" if mesh.ep > 1 else ""  # EP ranks of one (pp, tp) hold different experts
    optim = write_optimizer_state(directory / OPTIM / f"pp{mesh.pp_rank}-tp{mesh.tp_rank}{ep}.safetensors",
                                  _optimizer_groups(model, state), mesh)
    if optim is not None:
        mine.append(optim)
    mine.append(rng_state.save(directory / RNG / f"rank{mesh.rank}.safetensors", _mesh_coords(mesh)))
    if mesh.rank == 0:
        saved = {
            **loop_state,
            "stage": state.stage,
            "counters": state.counters,
            "schedulers": {t.role: {"last_epoch": t.scheduler.last_epoch, "_step_count": t.scheduler._step_count}
                           for t in state.trained},
            "lora_dropout_calls": {t.adapter: _dropout_calls(model, t.adapter) for t in state.trained},
            "experiments": list(state.experiments),
            "mesh": {k: v for k, v in _mesh_coords(mesh).items() if k in (*MESH_KEYS, "world_size")},
        }
        (directory / STATE_FILE).write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")
        (directory / CONFIG_FILE).write_text(config_text)
        mine += [directory / STATE_FILE, directory / CONFIG_FILE]
    for f in mine:
        fsync_file(f)
    return mine


def read_loop_state(directory: Path) -> dict:
    """``trainer_state.json`` of a checkpoint."""
    file = directory / STATE_FILE
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} is unreadable ({exc})") from None


def _restore_scheduler(sched: torch.optim.lr_scheduler.LambdaLR, saved: dict) -> None:
    """The schedule's position; the LR of the next step follows from this run's peak LR and schedule."""
    sched.last_epoch, sched._step_count = saved["last_epoch"], saved["_step_count"]
    lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas)]
    for group, lr in zip(sched.optimizer.param_groups, lrs):
        group["lr"] = lr
    sched._last_lr = lrs


def load_run_state(directory: Path, model, engine: Checkpointable) -> dict:
    """Collective-free: put the state of checkpoint ``directory`` into ``model`` and ``engine`` on this
    rank's mesh (any TP/PP/DP). Returns ``trainer_state.json``. A checkpoint of another stage, or one
    without an adapter or head this run trains, is a :class:`CheckpointError`.

    A run with experiments resumes the experiments the checkpoint holds; an experiment it does not hold
    starts fresh (its adapters, optimizers and counters as built), and the checkpoint's experiments this run
    does not have stay behind (both are logged)."""
    mesh, saved, full = model.mesh, read_loop_state(directory), engine.stage_state()
    if saved.get("stage") != full.stage:
        raise CheckpointError(f"checkpoint {directory} is of stage {saved.get('stage')!r}, this run is "
                              f"{full.stage!r}: resume a run from a checkpoint of its own stage")
    state = _resumable(directory, saved, full)
    for t in state.trained:
        src = directory / ADAPTERS / t.adapter
        if not src.is_dir():
            held = sorted(p.name for p in (directory / ADAPTERS).iterdir()) if (directory / ADAPTERS).is_dir() else []
            raise CheckpointError(f"checkpoint {directory} has no adapter {t.adapter!r} ({src}); it holds {held} "
                                  "(was it made with another algorithm? GRPO and RLOO train no critic)")
        model.load_adapter_weights(t.adapter, src)
        if t.head:
            file = directory / HEADS / f"{t.adapter}.safetensors"
            if not file.is_file():
                raise CheckpointError(f"checkpoint {directory} has no head for adapter {t.adapter!r} ({file})")
            with CheckpointReader(file.parent) as reader, torch.no_grad():
                for name, p in t.head.items():
                    p.copy_(reader.read(name))
    reader = OptimizerStateReader(directory / OPTIM)
    try:
        for role, (opt, params) in _optimizer_groups(model, state).items():
            load_optimizer_state(reader, role, opt, params, mesh)
    finally:
        reader.close()
    for t in state.trained:
        _restore_scheduler(t.scheduler, saved["schedulers"][t.role])
    engine.restore_counters(saved["counters"])
    for t in state.trained:
        calls = saved["lora_dropout_calls"].get(t.adapter, 0)
        for linear in model._lora_linears():
            if t.adapter in linear.lora:
                linear.lora[t.adapter].dropout_calls = calls
    saved_mesh = saved["mesh"]
    rng_file = directory / RNG / f"rank{mesh.rank}.safetensors"
    if all(saved_mesh[k] == getattr(mesh, k) for k in MESH_KEYS) and rng_file.is_file():
        rng_state.restore(rng_file)
    elif mesh.rank == 0:
        log.info("resume: saved at TP%d×PP%d×DP%d, now TP%d×PP%d×DP%d: adapters, heads and optimizer state are "
                 "resharded; per-rank torch/python/numpy generator states are not carried over (mlora's own "
                 "draws are keyed by seed and step)%s", saved_mesh["tp"], saved_mesh["pp"], saved_mesh["dp"],
                 mesh.tp, mesh.pp, mesh.dp,
                 "; LoRA dropout masks depend on DP and will differ" if saved_mesh["dp"] != mesh.dp and any(
                     model.adapters[t.adapter].config.dropout > 0 for t in state.trained) else "")
    return saved


def _resumable(directory: Path, saved: dict, state: StageState) -> StageState:
    """What of ``state`` checkpoint ``directory`` holds: everything, or with experiments the trained adapters of
    the experiments both have."""
    held = tuple(saved.get("experiments") or ())
    if bool(held) != bool(state.experiments):
        def runs(names) -> str:
            return f"with experiments {', '.join(names)}" if names else "without experiments"

        raise CheckpointError(f"checkpoint {directory} was written by a run {runs(held)}, this run is one "
                              f"{runs(state.experiments)}: resume a run with experiments from a checkpoint of a run "
                              "with experiments, and one without from one without")
    if not held:
        return state
    kept = [e for e in state.experiments if e in held]
    added, dropped = [e for e in state.experiments if e not in held], [e for e in held if e not in state.experiments]
    log.info("resume: experiments %s continue from %s%s%s", ", ".join(kept) or "(none)", directory,
             f"; {', '.join(added)} start fresh" if added else "",
             f"; {', '.join(dropped)} (in the checkpoint) stay behind" if dropped else "")
    return StageState(state.stage, [t for t in state.trained if t.experiment in held], state.counters, tuple(kept))
