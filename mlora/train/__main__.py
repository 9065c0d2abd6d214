"""``mlora-train`` / ``python -m mlora.train``: the Hydra entry point.

    torchrun --nproc_per_node 4 -m mlora.train --config-name cpu_demo
    torchrun ... -m mlora.train trainer.policy.model.path=Qwen2.5-0.5B data.train_data="[gsm8k/train.parquet]"
    mlora-train --config-name dpo trainer.policy.model.path=DIR data.train_data="[pairs.parquet]"   # or sft, rm

The configs ship inside the package (``mlora/configs``; ``configs/`` at the repository root links
to them), so an installed wheel finds them. Keys are checked against the typed schema
(:mod:`mlora.config.schema`), then by :func:`mlora.config.validate.finalize`.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib import resources

CONFIG_DIR = str(resources.files("mlora") / "configs")
# Hydra writes a job log file and a .hydra/ folder into the working directory by default; a
# trainer's logs go to its run directory (metrics.jsonl) and the console instead.
HYDRA_QUIET = ("hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.output_subdir=null", "hydra.run.dir=.")


def _is_override(arg: str) -> bool:
    return not arg.startswith("-") and ("=" in arg or arg.startswith("~"))


def _hydra_literal(value) -> str | None:
    """``value`` (parsed JSON) in Hydra's override grammar; None when a key is no plain identifier."""
    if isinstance(value, dict):
        items = [(k, _hydra_literal(v)) for k, v in value.items()]
        if any(not k.isidentifier() or v is None for k, v in items):
            return None
        return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
    if isinstance(value, list):
        items = [_hydra_literal(v) for v in value]
        return None if None in items else "[" + ",".join(items) + "]"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


def _dict_fields(node=None, prefix: str = "") -> list[str]:
    """The schema's dict-typed keys (``generator.engine_init_kwargs``, ...): free-form, any entry."""
    from dataclasses import fields, is_dataclass

    from mlora.config.schema import TrainConfig

    out = []
    for f in fields(node or TrainConfig):
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            out += _dict_fields(default, f"{prefix}{f.name}.")
        elif "dict[" in str(f.type):
            out.append(prefix + f.name)
    return out


def skyrl_override(arg: str) -> str:
    """A SkyRL command-line override in Hydra's terms. SkyRL sets a dict key, or an entry of one, without
    Hydra's ``+`` (``...transformer_config_kwargs.recompute_method=uniform``): such a key is set with
    ``++`` (add or replace). SkyRL takes a JSON object as a dict value (its scripts pass
    ``engine_init_kwargs`` so); Hydra's grammar has no quoted keys, so the value is rewritten in it.
    Anything else is returned unchanged."""
    import json

    key, sep, value = arg.partition("=")
    if not sep:
        return arg
    if not key.startswith(("+", "~")) and any(key == d or key.startswith(d + ".") for d in _dict_fields()):
        key, arg = "++" + key, "++" + arg
    if not value.startswith("{"):
        return arg
    try:
        literal = _hydra_literal(json.loads(value))
    except ValueError:
        return arg
    return arg if literal is None else f"{key}={literal}"


def _config_name(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        key, sep, value = arg.partition("=")
        if key in CONFIG_NAME_OPTIONS:
            return value if sep else (args[i + 1] if i + 1 < len(args) else None)
    return None


def hydra_argv(args: list[str]) -> list[str]:
    """Options first, then the user's overrides, then the quiet defaults the user did not set.

    Hydra parses overrides as one positional list, so argparse rejects overrides on both sides of
    an option (``key=v --config-name x``); keeping options first accepts any order."""
    overrides = [skyrl_override(a) for a in args if _is_override(a)]
    if _config_name(args) == "sft":  # SkyRL's SFT keys (skyrl.train.main_sft) under their mlora names
        from mlora.config.skyrl_sft import skyrl_sft_overrides

        overrides = skyrl_sft_overrides(overrides)
    given = {o.split("=", 1)[0] for o in overrides}
    return ([a for a in args if not _is_override(a)] + overrides
            + [o for o in HYDRA_QUIET if o.split("=", 1)[0] not in given])


CONFIG_NAME_OPTIONS = ("--config-name", "-cn")


def plain_argv(args: list[str]) -> tuple[str, list[str]] | None:
    """``(config name, overrides)`` when ``args`` are only overrides and ``--config-name``: such runs are
    composed here, so that a bad key or value is reported once (:mod:`mlora.train.failure`). Anything
    else (``--help``, ``--cfg``, ``--config-path``, ``hydra.*`` overrides, ...) goes to ``hydra.main``."""
    name, overrides, i = "ppo", [], 0
    while i < len(args):
        arg = args[i]
        key = arg.split("=", 1)[0]
        if key in CONFIG_NAME_OPTIONS:
            if "=" in arg:
                name = arg.split("=", 1)[1]
            elif i + 1 < len(args):
                name, i = args[i + 1], i + 1
            else:
                return None
        elif _is_override(arg) and not key.lstrip("+~").startswith(("hydra.", "hydra/")):
            overrides.append(skyrl_override(arg))
        else:
            return None
        i += 1
    return name, overrides


def _train(dict_cfg, explicit: list[str]) -> None:
    """Validate, then run the stage the config names; a failure is reported once (exit 2 for config errors)."""
    import torch
    from omegaconf import OmegaConf

    from mlora.config.validate import finalize
    from mlora.train.failure import report
    from mlora.train.preemption import Preempted

    run_dir = None
    try:
        cfg = OmegaConf.to_object(dict_cfg)
        run_dir = cfg.trainer.run_dir
        cuda = torch.cuda.is_available()
        notes = finalize(cfg, int(os.environ.get("WORLD_SIZE", "1")), cuda, explicit,
                         gpus_per_node=torch.cuda.device_count() if cuda else None,
                         ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                         gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory if cuda else None)
        # demo.prepare: the stage's demo assets, built on rank 0 at the start of the run (start_run)
        if cfg.preference.stage is not None:  # sft | rm | dpo (--config-name sft | rm | dpo)
            from mlora.demos.preference_assets import build_preference_assets
            from mlora.train.preference_stage import run_preference

            run_preference(cfg, notes, build_assets=build_preference_assets)
        else:
            from mlora.config.errors import ConfigError
            from mlora.demos.rl_assets import build_demo_assets
            from mlora.testing import TINY_ARCHS
            from mlora.train.rl_stage import run_rl

            if cfg.demo.prepare and cfg.demo.model not in TINY_ARCHS:
                raise ConfigError(f"demo.model={cfg.demo.model!r} is not a tiny architecture the demo builds; valid: "
                                  f"{', '.join(TINY_ARCHS)}")

            run_rl(cfg, notes, build_assets=lambda directory: build_demo_assets(directory, task=cfg.demo.task,
                                                                                   model=cfg.demo.model))
    except (Preempted, KeyboardInterrupt):
        raise
    except SystemExit as stop:
        if stop.code not in (None, 0):
            _exit(report(stop, run_dir))
        raise
    except BaseException as exc:  # noqa: BLE001 - reported once, then the process ends
        _exit(report(exc, run_dir))


def _exit(code: int) -> None:
    # everything below has unwound (engines stopped, files closed); skip the interpreter's teardown,
    # which can wait on peers that are gone
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    from mlora.train.launch import launch, wants_launcher

    if wants_launcher(sys.argv[1:]):  # mlora-train --nproc_per_node N ...: start the ranks, report once
        sys.exit(launch(sys.argv[1:]))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from mlora.config.schema import register_schema
    from mlora.train.preemption import Preempted

    register_schema()
    plain = plain_argv(sys.argv[1:])
    try:
        if plain is not None:
            from hydra import compose, initialize_config_dir

            from mlora.train.failure import report

            name, overrides = plain
            try:
                from mlora.config.skyrl_absent import check_overrides

                check_overrides(overrides)  # SkyRL's keys that mlora lacks: named with why, not Hydra's "not in"
                if name == "sft":  # SkyRL's SFT keys (skyrl.train.main_sft) under their mlora names
                    from mlora.config.skyrl_sft import skyrl_sft_overrides

                    overrides = skyrl_sft_overrides(overrides)
                with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
                    dict_cfg = compose(config_name=name, overrides=overrides)
            except Exception as exc:  # noqa: BLE001 - a bad key, value or config name: reported once
                _exit(report(exc))
            _train(dict_cfg, [o.split("=", 1)[0] for o in overrides])
        else:
            _hydra_main()
    except Preempted as stop:
        # Checkpoint, preempted.json and the engines are done. Skip the interpreter's teardown (seconds
        # of module finalisation after torch, megatron and transformers) so that every rank exits 75
        # well within torchrun's --shutdown-timeout (30 s by default, then SIGKILL).
        _exit(stop.code)
    _finish()


def _finish() -> None:
    """A finished run: the exit handlers run (shared-memory segments unlinked, engines closed), then the
    process ends without the interpreter's teardown. In that teardown a C++ thread still joinable (gloo's or
    vLLM's) once aborted a rank of a finished CPU-demo run in CI ("terminate called without an active
    exception", exit -6), failing a run whose metrics and adapter were already written."""
    import atexit

    atexit._run_exitfuncs()
    _exit(0)


def _hydra_main() -> None:
    """The run through ``hydra.main`` (options such as ``--help``, ``--cfg job`` or ``--config-path``)."""
    import hydra
    from omegaconf import DictConfig

    @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="ppo")
    def _run(dict_cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig

        _train(dict_cfg, [o.split("=", 1)[0] for o in HydraConfig.get().overrides.task])

    sys.argv[1:] = hydra_argv(sys.argv[1:])
    _run()


if __name__ == "__main__":
    main()
