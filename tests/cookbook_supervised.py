"""Run tinker-cookbook's ``supervised.train.main`` (unchanged) on its bundled ``example_data/conversations.jsonl``.

Usage: python tests/cookbook_supervised.py MODEL_DIR BASE_URL LOG_PATH MAX_STEPS
The cookbook's own ``python -m tinker_cookbook.supervised.train`` entry point cannot start in 0.6.1 (chz refuses its
unannotated lambda), and its ``recipes.sl_basic`` needs a model it knows by hub name; so this builds the same
``train.Config`` that ``sl_basic`` builds, with the conversation file as its dataset, and calls ``train.main``.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import tinker_cookbook
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

RENDERER = "qwen3_instruct"  # ChatML, SmolLM2's chat format


def main() -> None:
    model, url, log, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name=RENDERER, max_length=512,
                                            batch_size=16, train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    config = train.Config(log_path=log, model_name=model, recipe_name="mlora_cookbook_sl", renderer_name=RENDERER,
                          dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(data)),
                          learning_rate=3e-4, lora_rank=16, eval_every=0, save_every=0, base_url=url,
                          max_steps=steps)
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main()
