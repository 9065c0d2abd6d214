"""``mlora-train`` / ``python -m mlora.train``: the Hydra entry point (configs/ppo.yaml and friends).

    torchrun --nproc_per_node 4 -m mlora.train --config-name cpu_demo
    torchrun ... -m mlora.train trainer.policy.model.path=Qwen2.5-0.5B data.train_data="[gsm8k/train.parquet]"
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import hydra
    from omegaconf import DictConfig

    @hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="ppo")
    def _run(cfg: DictConfig) -> None:
        from mlora.train.loop import run

        run(cfg)

    if not any(a.startswith("hydra.run.dir") for a in sys.argv):
        sys.argv.append("hydra.output_subdir=null")
        sys.argv.append("hydra.run.dir=.")
    _run()


if __name__ == "__main__":
    main()
