"""The SFT / reward-model / DPO stage of the run loop (:mod:`mlora.train.loop`), behind
``mlora-train --config-name sft | rm | dpo``: data -> the shared base with its adapter ->
:class:`~mlora.train.preference_engine.PreferenceEngine` steps -> held-out evaluation -> the final
adapter in PEFT format (the reward model as a PEFT sequence-classification adapter with its ``score``
head, :func:`mlora.export.reward_adapter.save_reward_adapter`) and a plot. Seeded epochs, checkpoints
(resumable on any mesh), preemption and the metrics log are the loop's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

from mlora.config.schema import TrainConfig
from mlora.rollout.data import epoch_batches
from mlora.train import loop
from mlora.train.from_config import lora_config, packing
from mlora.train.metrics_log import log, read_metrics
from mlora.train.preference_data import Example, SequenceBatch, collate, load_examples, split_held_out
from mlora.train.preference_engine import PreferenceConfig, PreferenceEngine

# the numbers each stage shows on the console and in the plot (TRL's names)
HEADLINE = {"sft": ("loss",), "rm": ("loss", "accuracy", "margin"),
            "dpo": ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")}


def preference_config(cfg: TrainConfig, total_steps: int) -> PreferenceConfig:
    """The engine's hyper-parameters from the run configuration (validated by ``finalize``)."""
    t, p = cfg.trainer, cfg.preference
    opt = t.policy.optimizer_config
    return PreferenceConfig(stage=p.stage, beta=p.beta, label_smoothing=p.label_smoothing, loss_type=p.loss_type,
                            margin=p.margin, micro_batch_size=t.micro_train_batch_size_per_gpu, lr=opt.lr,
                            weight_decay=opt.weight_decay, betas=tuple(opt.adam_betas),
                            max_grad_norm=opt.max_grad_norm, warmup_steps=opt.num_warmup_steps,
                            total_steps=total_steps, lr_schedule=opt.scheduler, packing=packing(t))


def _load_data(cfg: TrainConfig, tokenizer) -> tuple[list[Example], list[Example]]:
    p, pairs = cfg.preference, cfg.preference.stage != "sft"
    train, dropped = load_examples(list(cfg.data.train_data), tokenizer, pairs, p.max_length, "data.train_data")
    if cfg.data.val_data:
        val, val_dropped = load_examples(list(cfg.data.val_data), tokenizer, pairs, p.max_length, "data.val_data")
    else:
        val_dropped = 0
        train, val = split_held_out(train, p.held_out_fraction, cfg.trainer.seed)
        log.info("held out %d of %d examples of data.train_data for evaluation (preference.held_out_fraction=%g)",
                 len(val), len(train) + len(val), p.held_out_fraction)
    if dropped or val_dropped:
        log.info("dropped %d training and %d held-out examples longer than preference.max_length=%d tokens",
                 dropped, val_dropped, p.max_length)
    return train, val


def _eval_batches(examples: list[Example], batch_size: int, per: int, pad_id: int, pairs: bool
                  ) -> list[SequenceBatch]:
    """Held-out examples in batches of ``batch_size``, the last one cut to a multiple of ``per`` (micro x DP)."""
    batches = []
    for s in range(0, len(examples), batch_size):
        chunk = examples[s:s + batch_size]
        chunk = chunk[:len(chunk) // per * per]
        if chunk:
            batches.append(collate(chunk, pad_id, pairs))
    return batches


class PreferenceStage:
    """SFT, reward model or DPO (``preference.stage``) as a stage of :func:`mlora.train.loop.run`: the
    examples, the shared base with the trained adapter (on top of the frozen one, if any) and the engine."""

    def __init__(self, cfg: TrainConfig, mesh) -> None:
        from transformers import AutoTokenizer

        t = cfg.trainer
        self.cfg, self.mesh, self.stage = cfg, mesh, cfg.preference.stage
        self.pairs = self.stage != "sft"
        tokenizer = AutoTokenizer.from_pretrained(str(t.policy.model.path))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.train, val = _load_data(cfg, tokenizer)
        self.n_examples = len(self.train)
        self.total_steps = loop.total_steps(cfg, self.n_examples)
        # e.g. the SFT adapter under a reward model or DPO (DPO's reference is the base + it)
        self.model, reference = loop.load_model(cfg, mesh)
        self.engine = PreferenceEngine(self.model, preference_config(cfg, self.total_steps),
                                       reference_adapters=reference, lora=lora_config(t.policy.model.lora, t.seed))
        self.val_batches = _eval_batches(val, t.train_batch_size, t.micro_train_batch_size_per_gpu * mesh.dp,
                                         self.pad_id, self.pairs)
        self.evaluates = bool(self.val_batches)

    def open(self, run_dir: Path) -> None:
        """Where ``trainer.hf_save_interval`` writes (the data is in memory)."""
        self.export_dir = Path(self.cfg.trainer.export_path or run_dir)

    def schedule(self, start_step: int):
        t = self.cfg.trainer
        return epoch_batches(self.n_examples, t.train_batch_size, t.seed, self.total_steps, start_step)

    def eval_due(self, step: int) -> bool:
        return self.evaluates and loop.interval_due(step, self.cfg.trainer.eval_interval, self.total_steps)

    def step(self, step: int, picked: list[int]) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.engine.step(collate([self.train[i] for i in picked], self.pad_id, self.pairs))
        metrics["timing/train_s"] = time.perf_counter() - t0
        t = self.cfg.trainer
        # SkyRL's hf_save_interval, as the RL stage: the adapter (PEFT) in <export>/global_step_<k>/policy
        if loop.hf_save_due(step, t.hf_save_interval, self.total_steps, self.n_examples // t.train_batch_size):
            save_final_adapter(self.cfg, self.model, self.engine, self.export_dir / f"global_step_{step}" / "policy")
        return metrics

    def evaluate(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        out = {f"eval/{k}": v for k, v in self.engine.evaluate_all(self.val_batches).items()}
        # how many held-out examples the means are over: whole micro-batches x DP only, the first ones in file order
        out["eval/examples"] = sum(b.size for b in self.val_batches)
        out["timing/eval_s"] = time.perf_counter() - t0
        return out

    def step_line(self, step: int, metrics: dict[str, float]) -> str:
        return (f"step {step:3d}  {_summary(metrics, self.stage, '')}"
                + (f"  | held-out {_summary(metrics, self.stage, 'eval/')}" if "eval/loss" in metrics else ""))

    def eval_line(self, metrics: dict[str, float]) -> str:
        return _summary(metrics, self.stage, "eval/")

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{metrics['loss']:.4f}"}

    def finish(self, run_dir: Path) -> Path:
        """The adapter in PEFT format (:func:`save_final_adapter`) and the plot of its headline metrics."""
        final = save_final_adapter(self.cfg, self.model, self.engine, run_dir / "final_adapter")
        if self.mesh.rank == 0:
            png = _plot(run_dir / "metrics.jsonl", run_dir / "metrics.png", self.stage)
            frozen = self.cfg.trainer.policy.model.frozen_adapter_path
            log.info("\nmetrics: %s\nplot: %s\nfinal %s adapter (PEFT%s): %s%s", run_dir / "metrics.jsonl", png,
                     self.stage, ", sequence classification with its score head" if self.stage == "rm" else "",
                     final, f"\n(trained on top of {frozen})" if frozen else "")
        return final

    def loop_state(self) -> dict:
        return {}

    def restore(self, state: dict) -> None:
        pass

    def close(self) -> None:
        """Nothing to release."""


def run_preference(cfg: TrainConfig, notes: Sequence[str] = (),
                   build_assets: Callable[[str], object] | None = None) -> dict:
    """Train the stage ``cfg.preference.stage``; returns the last step's metrics (on every rank). See
    :func:`mlora.train.loop.run`; ``build_assets(demo.dir)``: what ``demo.prepare`` builds (the entry point
    passes :func:`mlora.demos.preference_assets.build_preference_assets`)."""
    return loop.run(cfg, PreferenceStage, notes, build_assets)


def save_final_adapter(cfg: TrainConfig, model, engine: PreferenceEngine, final: Path) -> Path:
    """The stage's trained adapter in PEFT format (collective). The reward model's is a SEQ_CLS adapter
    with its score head that records the frozen adapter it was trained on top of
    (``trainer.policy.model.frozen_adapter_path``): PPO stacks that one under it when scoring
    (:mod:`mlora.train.learned_reward`), so the reward it optimises is the one trained here."""
    if cfg.preference.stage == "rm":
        from mlora.export.reward_adapter import save_reward_adapter

        return save_reward_adapter(model, engine.adapter, engine.head, final,
                                   frozen_adapter=cfg.trainer.policy.model.frozen_adapter_path)
    model.save_adapter(engine.adapter, final)
    return final


def _summary(metrics: dict, stage: str, prefix: str) -> str:
    return "  ".join(f"{k} {metrics[prefix + k]:.4f}" for k in HEADLINE[stage] if prefix + k in metrics)


def _plot(metrics_file: Path, out: Path, stage: str) -> Path:
    """Training and held-out curves of the stage's headline metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_file)
    keys = HEADLINE[stage][:3]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for prefix, label in (("", "train"), ("eval/", "held-out")):
            pts = [(r["step"], r[prefix + key]) for r in rows if prefix + key in r]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
        ax.set_title(f"{stage}: {key}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
