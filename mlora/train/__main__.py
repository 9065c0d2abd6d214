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


def hydra_argv(args: list[str]) -> list[str]:
    """Options first, then the user's overrides, then the quiet defaults the user did not set.

    Hydra parses overrides as one positional list, so argparse rejects overrides on both sides of
    an option (``key=v --config-name x``); keeping options first accepts any order."""
    overrides = [a for a in args if _is_override(a)]
    given = {o.split("=", 1)[0] for o in overrides}
    return ([a for a in args if not _is_override(a)] + overrides
            + [o for o in HYDRA_QUIET if o.split("=", 1)[0] not in given])


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import hydra
    from omegaconf import DictConfig, OmegaConf

    from mlora.config.schema import register_schema

    register_schema()

    @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="ppo")
    def _run(dict_cfg: DictConfig) -> None:
        import torch
        from hydra.core.hydra_config import HydraConfig

        from mlora.config.validate import finalize

        cfg = OmegaConf.to_object(dict_cfg)
        explicit = [o.split("=", 1)[0] for o in HydraConfig.get().overrides.task]
        notes = finalize(cfg, int(os.environ.get("WORLD_SIZE", "1")), torch.cuda.is_available(), explicit)
        # demo.prepare: the stage's demo assets, built on rank 0 at the start of the run (start_run)
        if cfg.preference.stage is not None:  # sft | rm | dpo (--config-name sft | rm | dpo)
            from mlora.demos.preference_assets import build_preference_assets
            from mlora.train.preference_loop import run_preference

            run_preference(cfg, notes, build_assets=build_preference_assets)
        else:
            from mlora.demos.rl_assets import build_demo_assets
            from mlora.train.loop import run

            run(cfg, notes, build_assets=build_demo_assets)

    sys.argv[1:] = hydra_argv(sys.argv[1:])
    from mlora.train.preemption import Preempted

    try:
        _run()
    except Preempted as stop:
        # Checkpoint, preempted.json and the engines are done. Skip the interpreter's teardown (seconds
        # of module finalisation after torch, megatron and transformers) so that every rank exits 75
        # well within torchrun's --shutdown-timeout (30 s by default, then SIGKILL).
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(stop.code)


if __name__ == "__main__":
    main()
