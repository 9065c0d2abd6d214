"""Assets of the CPU RL demo: a tiny random Llama and prompts for the synthetic ``target_token`` task."""

from __future__ import annotations

import random
from pathlib import Path

TARGET_FRACTION = 0.1  # the targets: this share of the vocabulary


def build_demo_assets(directory: str | Path, n_prompts: int = 256, seed: int = 0, task: str = "target_token",
                      model: str = "llama") -> Path:
    """``<dir>/tiny-<model>`` (``demo.model``: ``llama``, or a mixture of experts such as ``qwen3_moe``),
    ``<dir>/train.parquet`` and a held-out ``<dir>/val.parquet`` (prompt, env_class, reward_spec, data_source) of
    ``task`` (``demo.task``: ``target_token``, whose targets are aligned to that model's output layer, or a
    multi-turn environment's, :mod:`mlora.demos.tool_tasks`); idempotent."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mlora.testing import TINY_ARCHS, build_tiny_model

    if model not in TINY_ARCHS:
        raise ValueError(f"demo.model={model!r} is not a tiny architecture; valid: {', '.join(TINY_ARCHS)}")
    root = Path(directory)
    model_dir = root / f"tiny-{model}"
    if not (model_dir / "config.json").exists():
        # a wider init than the default 0.02 gives the output layer enough range for a LoRA to move it;
        # multi-turn conversations (the calculator's instructions and worked exchange take ~240 tokens of
        # the tiny tokenizer) need a longer context than the tiny model's 256
        longer = {} if task == "target_token" else {"max_position_embeddings": 1024}
        build_tiny_model(model, model_dir, seed=seed, initializer_range=0.1, **longer)
    if task != "target_token":
        from mlora.demos.tool_tasks import build_tool_task

        return build_tool_task(root, task, n_prompts, 32, seed)
    aligned_to = root / "targets_of"  # the model the prompts' targets were aligned to
    if aligned_to.is_file() and aligned_to.read_text() != model:
        for split in ("train", "val"):
            (root / f"{split}.parquet").unlink(missing_ok=True)
    for split, count, split_seed in (("train", n_prompts, seed), ("val", 32, seed + 1)):
        if (root / f"{split}.parquet").exists():
            continue
        targets = aligned_targets(model_dir, seed)
        rng = random.Random(split_seed)
        words = ["red", "blue", "cat", "dog", "sun", "moon", "tree", "rock", "fish", "bird"]
        rows = [{"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(3, 8))),
                 "env_class": "target_token", "data_source": "synthetic_target_token",
                 "reward_spec": {"targets": targets}} for _ in range(count)]
        pq.write_table(pa.Table.from_pylist(rows), root / f"{split}.parquet")
    aligned_to.write_text(model)
    return root


def aligned_targets(model_dir: Path, seed: int) -> list[int]:
    """The tokens whose output-layer rows point most along one random direction: raising the final
    hidden state along it favours them all at once, which a LoRA can learn (a random set of tokens
    would need a direction the RMS-normed hidden state cannot reach)."""
    import torch

    from mlora.formats.checkpoint_reader import CheckpointReader

    with CheckpointReader(model_dir) as reader:
        head = reader.read("lm_head.weight").float()
    u = torch.randn(head.shape[1], generator=torch.Generator().manual_seed(seed + 1))
    k = int(head.shape[0] * TARGET_FRACTION)
    return sorted(torch.topk(head @ u, k).indices.tolist())
