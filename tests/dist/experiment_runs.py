"""torchrun worker: several whole mlora-train RL runs, one after another in the same ranks (one torchrun start-up
for all of them), each composed from ``cpu_demo`` with its own overrides, as ``mlora-train`` would run it.

Usage: torchrun ... experiment_runs.py ASSETS_DIR WORK_DIR RUNS_JSON
RUNS_JSON: a JSON list of ``[name, [override, ...]]``; run ``name`` writes into ``WORK_DIR/name``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from mlora.config.schema import register_schema
from mlora.config.validate import finalize
from mlora.demos.rl_assets import build_demo_assets
from mlora.train.__main__ import CONFIG_DIR
from mlora.train.rl_stage import run_rl


def main() -> None:
    assets, work, runs = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    register_schema()
    for name, overrides in runs:
        overrides = [f"demo.dir={assets}", f"trainer.run_dir={work / name}", f"trainer.run_name={name}",
                     *overrides]
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = OmegaConf.to_object(compose(config_name="cpu_demo", overrides=overrides))
        notes = finalize(cfg, dist.get_world_size() if dist.is_initialized() else 4,
                         explicit=[o.split("=", 1)[0] for o in overrides])
        run_rl(cfg, notes, build_assets=build_demo_assets)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
