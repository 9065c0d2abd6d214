"""Checkpoints of SFT / reward-model / DPO runs: the PPO layout (:mod:`mlora.checkpoint.rl_state`) with
one trained adapter, and for the reward model its bias-free head.

Inside ``global_step_<k>/`` (directory protocol: :mod:`mlora.checkpoint.dirs`)::

    adapters/<name>/                  the trained adapter, PEFT layout as exported (ranks write their shards)
    heads/<name>.safetensors          reward model only: ``score.weight`` [1, hidden] (HF's name)
    optim/pp<p>-tp<t>.safetensors     AdamW state in canonical pieces (mlora.checkpoint.optim_state)
    rng/rank<r>.safetensors           each rank's generator states
    trainer_state.json, config.yaml   step, data position, LR schedule, dropout counters, mesh; the config

Any mesh reads it back (adapters and optimizer state are resharded; the head is replicated over TP).
"""

from __future__ import annotations

import json
from pathlib import Path

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
from mlora.checkpoint.rl_state import (
    ADAPTERS,
    CONFIG_FILE,
    HEADS,
    OPTIM,
    RNG,
    STATE_FILE,
    _dropout_calls,
    _mesh_coords,
    _restore_scheduler,
    read_loop_state,
)
from mlora.formats.checkpoint_reader import CheckpointReader
from mlora.formats.durable import fsync_file
from mlora.formats.safetensors_writer import SafetensorsWriter
from mlora.formats.weight_map import REPLICATED

SCORE_NAME = "score.weight"  # HF's sequence-classification head
ROLE = "actor"  # the optimizer group's name in optim/ (one trained adapter, as the PPO actor)


def _groups(model, engine) -> dict[str, tuple]:
    pieces = adapter_pieces(model, engine.adapter)
    if engine.head is not None and engine.head in model.heads:
        pieces.append((model.heads[engine.head].weight, [Piece(SCORE_NAME, REPLICATED)]))
    return {ROLE: (engine.opt, pieces)}


def write_preference_state(directory: Path, model, engine, loop_state: dict, config_text: str) -> list[Path]:
    """Collective: this rank's part of the state of a :class:`~mlora.train.preference_engine.PreferenceEngine`
    run; every file written is fsynced and returned."""
    mesh, mine = model.mesh, []
    model.save_adapter(engine.adapter, directory / ADAPTERS / engine.adapter)
    if mesh.rank == 0:
        mine += sorted((directory / ADAPTERS / engine.adapter).iterdir())
    if engine.head is not None and engine.head in model.heads and mesh.tp_rank == 0 and mesh.dp_rank == 0:
        path = directory / HEADS / f"{engine.head}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        weight = model.heads[engine.head].weight.detach().cpu().contiguous()
        writer = SafetensorsWriter(path, {SCORE_NAME: (weight.dtype, tuple(weight.shape))})
        writer.write(SCORE_NAME, weight)
        writer.close()
        mine.append(path)
    optim = write_optimizer_state(directory / OPTIM / f"pp{mesh.pp_rank}-tp{mesh.tp_rank}.safetensors",
                                  _groups(model, engine), mesh)
    if optim is not None:
        mine.append(optim)
    mine.append(rng_state.save(directory / RNG / f"rank{mesh.rank}.safetensors", _mesh_coords(mesh)))
    if mesh.rank == 0:
        state = {**loop_state, "stage": engine.cfg.stage, "engine_global_step": engine.global_step,
                 "schedulers": {ROLE: {"last_epoch": engine.sched.last_epoch,
                                       "_step_count": engine.sched._step_count}},
                 "lora_dropout_calls": {engine.adapter: _dropout_calls(model, engine.adapter)},
                 "mesh": {k: v for k, v in _mesh_coords(mesh).items() if k in ("tp", "pp", "dp", "world_size")}}
        (directory / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
        (directory / CONFIG_FILE).write_text(config_text)
        mine += [directory / STATE_FILE, directory / CONFIG_FILE]
    for f in mine:
        fsync_file(f)
    return mine


def load_preference_state(directory: Path, model, engine) -> dict:
    """Put checkpoint ``directory`` into ``model`` and ``engine`` on this rank's mesh; returns
    ``trainer_state.json``. A checkpoint of another stage is an error."""
    state = read_loop_state(directory)
    if state.get("stage") != engine.cfg.stage:
        raise CheckpointError(f"checkpoint {directory} is of stage {state.get('stage')!r} (a PPO run has none), "
                              f"this run is {engine.cfg.stage!r}: resume a run with a checkpoint of its own stage")
    src = directory / ADAPTERS / engine.adapter
    if not src.is_dir():
        raise CheckpointError(f"checkpoint {directory} has no adapter {engine.adapter!r} ({src})")
    model.load_adapter_weights(engine.adapter, src)
    if engine.head is not None and engine.head in model.heads:
        file = directory / HEADS / f"{engine.head}.safetensors"
        if not file.is_file():
            raise CheckpointError(f"checkpoint {directory} has no reward head ({file})")
        with CheckpointReader(file.parent) as reader, torch.no_grad():
            model.heads[engine.head].weight.copy_(reader.read(SCORE_NAME))
    reader = OptimizerStateReader(directory / OPTIM)
    try:
        for role, (opt, params) in _groups(model, engine).items():
            load_optimizer_state(reader, role, opt, params, model.mesh)
    finally:
        reader.close()
    _restore_scheduler(engine.sched, state["schedulers"][ROLE])
    engine.global_step = state["engine_global_step"]
    for linear in model._lora_linears():
        if engine.adapter in linear.lora:
            linear.lora[engine.adapter].dropout_calls = state["lora_dropout_calls"].get(engine.adapter, 0)
    saved, mesh = state["mesh"], model.mesh
    rng_file = directory / RNG / f"rank{mesh.rank}.safetensors"
    if all(saved[k] == getattr(mesh, k) for k in ("tp", "pp", "dp")) and rng_file.is_file():
        rng_state.restore(rng_file)
    return state
