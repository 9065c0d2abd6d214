"""Run tinker-cookbook's on-policy distillation (``distillation.train_on_policy.main``, unchanged) on local prompts,
with the served base model as the teacher.

Usage: python tests/cookbook_distillation.py MODEL_DIR BASE_URL LOG_PATH PROMPTS_TXT MAX_STEPS STUDENT_STATE
The recipe's CLI (``recipes.distillation.on_policy_distillation``) only takes its hub datasets (deepmath, tulu3),
so this builds the ``train_on_policy.Config`` that CLI builds, with the cookbook's own ``PromptOnlyDataset`` over a
local file (one prompt a line) and its defaults otherwise (loss ``importance_sampling``, ``kl_penalty_coef`` 1,
``eval_every``/``save_every`` 20). The student starts from ``STUDENT_STATE`` (a ``tinker://`` state path); the
teacher is ``create_sampling_client(base_model=MODEL_DIR)``: the base the server serves, no adapter.
"""

from __future__ import annotations

import asyncio
import sys

import chz
from tinker_cookbook import renderers
from tinker_cookbook.distillation import train_on_policy
from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, PromptOnlyDataset, TeacherConfig
from tinker_cookbook.rl.types import RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

RENDERER = "qwen3_instruct"  # ChatML, SmolLM2's chat format
GROUPS, GROUP_SIZE = 8, 4


@chz.chz
class LocalPromptsBuilder(RLDatasetBuilder):
    """The cookbook's ``PromptOnlyDatasetBuilder`` with its prompts from a local file instead of a hub dataset."""

    path: str
    model_name: str

    async def __call__(self) -> tuple[PromptOnlyDataset, None]:
        tokenizer = get_tokenizer(self.model_name)
        prompts = [line for line in open(self.path).read().splitlines() if line.strip()]
        return PromptOnlyDataset(prompts=prompts, batch_size=GROUPS, group_size=GROUP_SIZE,
                                 renderer=renderers.get_renderer(RENDERER, tokenizer=tokenizer), tokenizer=tokenizer,
                                 max_prompt_tokens=1024, dataset_name="local"), None


def main() -> None:
    model, url, log, prompts, steps, student = sys.argv[1:7]
    dataset = DistillationDatasetConfig(dataset_builder=LocalPromptsBuilder(path=prompts, model_name=model),
                                        teacher_config=TeacherConfig(base_model=model), groups_per_batch=GROUPS)
    config = train_on_policy.Config(learning_rate=1e-3, dataset_configs=[dataset], model_name=model,
                                    recipe_name="mlora_cookbook_distillation", renderer_name=RENDERER, lora_rank=8,
                                    max_tokens=12, log_path=log, base_url=url, load_checkpoint_path=student,
                                    max_steps=int(steps))
    asyncio.run(train_on_policy.main(config))


if __name__ == "__main__":
    main()
