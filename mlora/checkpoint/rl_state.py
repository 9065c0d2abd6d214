"""What a checkpoint holds, written by the ranks that own it and read back on any mesh.

Inside ``global_step_<k>/`` (the directory protocol is :mod:`mlora.checkpoint.dirs`)::

    adapters/<name>/adapter_config.json         policy and critic in PEFT layout, as exported (each
    adapters/<name>/adapter_model.safetensors   rank writes its shards into the one file, no gather;
                                                loads in PEFT and vLLM, `mlora export-adapter` reads it)
    heads/<name>.safetensors                    the critic's value head (TRL's v_head.summary.* names)
    optim/pp<p>-tp<t>.safetensors               AdamW moments and step counts, canonical pieces
                                                (mlora.checkpoint.optim_state), written by their owners
    rng/rank<r>.safetensors                     each rank's generator states (mlora.checkpoint.rng_state)
    trainer_state.json                          step, data position, LR schedulers, KL controller,
                                                LoRA dropout counters, the mesh it was saved on
    config.yaml                                 the run's configuration
    manifest.json                               every file and its size, the base model's identity

Nothing is pickled: tensors are safetensors, scalars JSON.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from mlora.checkpoint import rng_state
from mlora.checkpoint.dirs import CheckpointError
from mlora.checkpoint.optim_state import (
    HEAD_NAMES,
    OptimizerStateReader,
    adapter_pieces,
    head_pieces,
    load_optimizer_state,
    write_optimizer_state,
)
from mlora.formats.checkpoint_reader import CheckpointReader
from mlora.formats.durable import fsync_file
from mlora.formats.safetensors_writer import SafetensorsWriter

log = logging.getLogger("mlora")

ADAPTERS, HEADS, OPTIM, RNG = "adapters", "heads", "optim", "rng"
STATE_FILE, CONFIG_FILE = "trainer_state.json", "config.yaml"


def _mesh_coords(mesh) -> dict:
    return {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp, "world_size": mesh.world_size, "rank": mesh.rank,
            "tp_rank": mesh.tp_rank, "pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank}


def _optimizer_groups(model, engine) -> dict[str, tuple]:
    groups = {"actor": (engine.actor_opt, adapter_pieces(model, engine.policy))}
    if engine.critic is not None:
        groups["critic"] = (engine.critic_opt, adapter_pieces(model, engine.critic) + head_pieces(model, engine.critic))
    return groups


def _schedulers(engine) -> dict[str, torch.optim.lr_scheduler.LambdaLR]:
    out = {"actor": engine.actor_sched}
    if engine.critic is not None:
        out["critic"] = engine.critic_sched
    return out


def _dropout_calls(model, adapter: str) -> int:
    """Forward calls that drew LoRA dropout masks for ``adapter`` on this rank (the same on every branch)."""
    calls = [linear.lora[adapter].dropout_calls for linear in model._lora_linears() if adapter in linear.lora]
    return max(calls, default=0)


def _write_head(model, name: str, path: Path) -> Path:
    head = model.heads[name]
    tensors = {HEAD_NAMES[0]: head.weight.detach().cpu(), HEAD_NAMES[1]: head.bias.detach().cpu()}
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsWriter(path, {n: (t.dtype, tuple(t.shape)) for n, t in tensors.items()})
    for n, t in tensors.items():
        writer.write(n, t.contiguous())
    writer.close()
    return path


def write_train_state(directory: Path, model, engine, loop_state: dict, config_text: str) -> list[Path]:
    """Collective: write this rank's part of the training state into ``directory``; every file it wrote
    is fsynced and returned (for the manifest)."""
    mesh, mine = model.mesh, []
    adapters = [n for n in (engine.policy, engine.critic) if n is not None]
    for name in adapters:  # each stage's ranks write their own shards into one PEFT file (no gather)
        model.save_adapter(name, directory / ADAPTERS / name)
        if mesh.rank == 0:
            mine += sorted((directory / ADAPTERS / name).iterdir())
    if engine.critic is not None and engine.critic in model.heads and mesh.tp_rank == 0 and mesh.dp_rank == 0:
        mine.append(_write_head(model, engine.critic, directory / HEADS / f"{engine.critic}.safetensors"))
    optim = write_optimizer_state(directory / OPTIM / f"pp{mesh.pp_rank}-tp{mesh.tp_rank}.safetensors",
                                  _optimizer_groups(model, engine), mesh)
    if optim is not None:
        mine.append(optim)
    mine.append(rng_state.save(directory / RNG / f"rank{mesh.rank}.safetensors", _mesh_coords(mesh)))
    if mesh.rank == 0:
        state = {
            **loop_state,
            "engine_global_step": engine.global_step,
            "schedulers": {role: {"last_epoch": s.last_epoch, "_step_count": s._step_count}
                           for role, s in _schedulers(engine).items()},
            "kl_ctrl": {"value": engine.kl_ctrl.value},
            "lora_dropout_calls": {name: _dropout_calls(model, name) for name in adapters},
            "mesh": {k: v for k, v in _mesh_coords(mesh).items() if k in ("tp", "pp", "dp", "world_size")},
        }
        (directory / STATE_FILE).write_text(json.dumps(state, indent=1, sort_keys=True) + "\n")
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


def load_train_state(directory: Path, model, engine) -> dict:
    """Collective-free: put the state of checkpoint ``directory`` into ``model`` and ``engine`` on this
    rank's mesh (any TP/PP/DP). Returns ``trainer_state.json``."""
    mesh, state = model.mesh, read_loop_state(directory)
    adapters = [n for n in (engine.policy, engine.critic) if n is not None]
    for name in adapters:
        src = directory / ADAPTERS / name
        if not src.is_dir():
            raise CheckpointError(f"checkpoint {directory} has no adapter {name!r} ({src}); was it made with "
                                  "another algorithm (GRPO has no critic)?")
        model.load_adapter_weights(name, src)
    if engine.critic is not None and engine.critic in model.heads:
        head, file = model.heads[engine.critic], directory / HEADS / f"{engine.critic}.safetensors"
        if not file.is_file():
            raise CheckpointError(f"checkpoint {directory} has no value head ({file})")
        with CheckpointReader(file.parent) as reader, torch.no_grad():
            head.weight.copy_(reader.read(HEAD_NAMES[0]))
            head.bias.copy_(reader.read(HEAD_NAMES[1]))
    reader = OptimizerStateReader(directory / OPTIM)
    try:
        for role, (opt, params) in _optimizer_groups(model, engine).items():
            load_optimizer_state(reader, role, opt, params, mesh)
    finally:
        reader.close()
    for role, sched in _schedulers(engine).items():
        _restore_scheduler(sched, state["schedulers"][role])
    engine.kl_ctrl.value = state["kl_ctrl"]["value"]
    engine.global_step = state["engine_global_step"]
    for name, calls in state.get("lora_dropout_calls", {}).items():
        for linear in model._lora_linears():
            if name in linear.lora:
                linear.lora[name].dropout_calls = calls
    saved_mesh = state["mesh"]
    same = all(saved_mesh[k] == getattr(mesh, k) for k in ("tp", "pp", "dp"))
    rng_file = directory / RNG / f"rank{mesh.rank}.safetensors"
    if same and rng_file.is_file():
        rng_state.restore(rng_file)
    elif mesh.rank == 0:
        log.info("resume: saved at TP%d×PP%d×DP%d, now TP%d×PP%d×DP%d: adapters, value head and optimizer state are "
                 "resharded; per-rank torch/python/numpy generator states are not carried over (mlora's own "
                 "draws are keyed by seed and step)%s", saved_mesh["tp"], saved_mesh["pp"], saved_mesh["dp"],
                 mesh.tp, mesh.pp, mesh.dp,
                 "; LoRA dropout masks depend on DP and will differ" if saved_mesh["dp"] != mesh.dp and any(
                     model.adapters[n].config.dropout > 0 for n in adapters) else "")
    return state
