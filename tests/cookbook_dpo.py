"""Run tinker-cookbook's DPO (``preference.train_dpo.main``, unchanged) on a local preference JSONL file.

Usage: python tests/cookbook_dpo.py MODEL_DIR BASE_URL LOG_PATH DATA_JSONL MAX_STEPS
The recipe's CLI (``recipes.preference.dpo.train``) only takes its hub datasets (hhh, helpsteer3, ultrafeedback),
so this builds the ``train_dpo.Config`` that CLI builds, with the cookbook's own ``ComparisonBuilderFromJsonl`` as
the comparisons: each step the reference sampling client (the initial weights, ``save_weights_and_get_sampling_client``)
scores both completions (``compute_logprobs``), and the loss runs through ``forward_backward_custom``.
"""

from __future__ import annotations

import sys

from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

RENDERER = "qwen3_instruct"  # ChatML, SmolLM2's chat format


def main() -> None:
    model, url, log, data, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name=RENDERER, max_length=256,
                                            batch_size=4)
    builder = DPODatasetBuilderFromComparisons(common_config=common,
                                               comparison_builder=ComparisonBuilderFromJsonl(train_path=data))
    config = train_dpo.Config(log_path=log, model_name=model, recipe_name="mlora_cookbook_dpo", renderer_name=RENDERER,
                              dataset_builder=builder, learning_rate=1e-4, lora_rank=8, dpo_beta=0.1, base_url=url,
                              eval_every=0, save_every=0, max_steps=steps)
    train_dpo.main(config)


if __name__ == "__main__":
    main()
