"""SkyRL's SFT command line (``python -m skyrl.train.main_sft key=value ...``, its flat ``SFTConfig``
keys) as ``mlora-train --config-name sft`` overrides.

SkyRL's SFT entry point has a config class of its own, with top-level keys (``model.path``,
``batch_size``, ``num_steps`` ...) that mlora's schema holds under ``trainer.*`` / ``data.*`` /
``preference.*``. :func:`skyrl_sft_overrides` renames each to the mlora key that does the same
thing; a SkyRL SFT key without such a key is a :class:`ConfigError` naming it and why.
"""

from __future__ import annotations

from pathlib import Path

from mlora.config.errors import ConfigError

# SkyRL SFT key (or key prefix, ending in '.') -> the mlora key (prefix) that means the same
RENAMES = {
    "strategy": "trainer.strategy",
    "model.path": "trainer.policy.model.path",
    "model.lora.": "trainer.policy.model.lora.",
    "optimizer_config.": "trainer.policy.optimizer_config.",
    "fsdp_config.": "trainer.policy.fsdp_config.",
    "placement.num_nodes": "trainer.placement.policy_num_nodes",
    "placement.num_gpus_per_node": "trainer.placement.policy_num_gpus_per_node",
    "num_steps": "trainer.total_steps",
    "num_epochs": "trainer.epochs",
    "batch_size": "trainer.train_batch_size",
    "micro_train_batch_size_per_gpu": "trainer.micro_train_batch_size_per_gpu",
    "remove_microbatch_padding": "trainer.remove_microbatch_padding",
    "seed": "trainer.seed",
    "logger": "trainer.logger",
    "project_name": "trainer.project_name",
    "run_name": "trainer.run_name",
    "ckpt_interval": "trainer.ckpt_interval",
    "max_ckpts_to_keep": "trainer.max_ckpts_to_keep",
    "eval_interval": "trainer.eval_interval",
    "eval_before_train": "trainer.eval_before_train",
    # SkyRL truncates longer sequences to max_length; mlora drops those examples (as TRL), logging how many
    "max_length": "preference.max_length",
}
# SkyRL SFT keys mlora has no equivalent of, and why
REFUSED = {
    "train_dataset_splits": "Hugging Face split slicing (e.g. 'train[:100]'): mlora reads whole local parquet/jsonl "
                            "files (data.train_data); cut the file instead",
    "train_dataset_weights": "per-dataset mixing weights are not supported: data.train_data files are concatenated",
    "messages_key": "mlora's SFT data are TRL's columns prompt + response (each text or chat messages); a single "
                    "conversation column is not read: split it into prompt (all turns but the last) and response",
    "dataset_name": "use data.train_data (local parquet/jsonl files)",
    "eval_datasets": "use data.val_data (local parquet/jsonl files)",
}
_LOCAL = (".parquet", ".jsonl", ".json")


def _listed(value: str) -> list[str]:
    inner = value.strip()
    if inner.startswith("[") and inner.endswith("]"):
        inner = inner[1:-1]
    return [v.strip().strip("'\"") for v in inner.split(",") if v.strip()]


def skyrl_sft_overrides(overrides: list[str]) -> list[str]:
    """``overrides`` with SkyRL's SFT keys renamed to mlora's (mlora's own keys pass unchanged).

    ``train_datasets`` become ``data.train_data`` when they are local parquet/jsonl files (SkyRL also
    takes Hugging Face dataset names, which mlora does not download); ``ckpt_path=""`` is SkyRL's
    "none" (mlora: ``<run_dir>/checkpoints``); ``resume_from`` "" / ``latest`` / a ``global_step_N``
    directory is ``trainer.resume_mode`` none / latest / from_path.
    """
    out = []
    for arg in overrides:
        key, sep, value = arg.partition("=")
        bare = key.lstrip("+")
        if not sep or bare.split(".", 1)[0] in ("data", "trainer", "generator", "environment", "reward_model",
                                                 "demo", "preference", "hydra"):
            out.append(arg)
            continue
        if bare in REFUSED:
            raise ConfigError(f"{bare}={value}: {REFUSED[bare]}")
        if bare == "train_datasets":
            files = _listed(value)
            remote = [f for f in files if not (f.endswith(_LOCAL) and Path(f).expanduser().exists())]
            if remote:
                raise ConfigError(f"train_datasets={value}: {remote[0]!r} is not a local parquet/jsonl file; mlora "
                                  "reads local files (data.train_data) and downloads no Hugging Face datasets")
            out.append(f"data.train_data=[{','.join(files)}]")
        elif bare == "ckpt_path":
            out.append(f"trainer.ckpt_path={value if value.strip(chr(34) + chr(39)) else 'null'}")
        elif bare == "resume_from":
            path = value.strip("'\"")
            out += (["trainer.resume_mode=none"] if not path else ["trainer.resume_mode=latest"] if path == "latest"
                    else ["trainer.resume_mode=from_path", f"trainer.resume_path={path}"])
        else:
            target = next((new + bare[len(old):] for old, new in RENAMES.items()
                           if bare == old or (old.endswith(".") and bare.startswith(old))), None)
            if target is None:
                raise ConfigError(f"{bare}={value}: a key of neither mlora's schema nor SkyRL's SFT keys that mlora "
                                  f"maps ({', '.join(sorted(RENAMES))}, train_datasets, ckpt_path, resume_from)")
            out.append(f"{key[:len(key) - len(bare)]}{target}={value}")
    return out
