"""``mlora-train`` / ``python -m mlora.train``: the Hydra entry point.

    torchrun --nproc_per_node 4 -m mlora.train --config-name cpu_demo
    torchrun ... -m mlora.train trainer.policy.model.path=Qwen2.5-0.5B data.train_data="[gsm8k/train.parquet]"

The configs ship inside the package (``mlora/configs``; ``configs/`` at the repository root links
to them), so an installed wheel finds them. Keys are checked against the typed schema
(:mod:`mlora.config.schema`), then by :func:`mlora.config.validate.finalize`.
"""

from __future__ import annotations

import os
import sys
from importlib import resources

CONFIG_DIR = str(resources.files("mlora") / "configs")
# Hydra writes a job log file and a .hydra/ folder into the working directory by default; a
# trainer's logs go to its run directory (metrics.jsonl) and the console instead.
HYDRA_QUIET = ("hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.output_subdir=null", "hydra.run.dir=.")


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
        from mlora.train.loop import run

        cfg = OmegaConf.to_object(dict_cfg)
        explicit = [o.split("=", 1)[0] for o in HydraConfig.get().overrides.task]
        notes = finalize(cfg, int(os.environ.get("WORLD_SIZE", "1")), torch.cuda.is_available(), explicit)
        run(cfg, notes)

    given = {a.split("=", 1)[0] for a in sys.argv[1:]}
    sys.argv += [o for o in HYDRA_QUIET if o.split("=", 1)[0] not in given]
    _run()


if __name__ == "__main__":
    main()
