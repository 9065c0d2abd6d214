"""The SFT / reward-model / DPO loop behind ``mlora-train --config-name sft | rm | dpo``.

Every rank runs :func:`run_preference` with the same validated config: data -> the shared base with
its adapter -> :class:`~mlora.train.preference_engine.PreferenceEngine` steps over seeded epochs ->
held-out evaluation, checkpoints (resumable on any mesh, preemption included), ``metrics.jsonl`` and
a plot -> the final adapter in PEFT format (the reward model as a PEFT sequence-classification
adapter with its ``score`` head, :func:`mlora.export.reward_adapter.save_reward_adapter`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Sequence

import mlora
from mlora.checkpoint.preference_state import load_preference_state, write_preference_state
from mlora.config.schema import TrainConfig
from mlora.rollout.data import epoch_batches
from mlora.train.from_config import lora_config, model_kwargs
from mlora.train.loop import FROZEN, _Saver, start_run
from mlora.train.metrics_log import MetricsLogger, log
from mlora.train.preemption import EX_TEMPFAIL, Preempted, PreemptionGuard, clear_marker, write_marker
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
                            total_steps=total_steps, lr_schedule=opt.scheduler)


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


def run_preference(cfg: TrainConfig, notes: Sequence[str] = (),
                   build_assets: Callable[[str], object] | None = None) -> dict:
    """Train the stage ``cfg.preference.stage``; returns the last step's metrics (on every rank).
    ``build_assets(demo.dir)``: what ``demo.prepare`` builds (the entry point passes
    :func:`mlora.demos.preference_assets.build_preference_assets`)."""
    with PreemptionGuard() as guard:
        try:
            return _train(cfg, notes, guard, build_assets)
        except Preempted as stop:
            if stop.step is None and int(os.environ.get("RANK", "0")) == 0:
                write_marker(Path(cfg.trainer.run_dir), None, None, guard.received)
            raise


def _train(cfg: TrainConfig, notes: Sequence[str], guard: PreemptionGuard,
           build_assets: Callable[[str], object] | None) -> dict:
    from transformers import AutoTokenizer

    t, stage = cfg.trainer, cfg.preference.stage
    mesh, run_dir, ckpt_root, resume = start_run(cfg, notes, build_assets)

    tokenizer = AutoTokenizer.from_pretrained(str(t.policy.model.path))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    train, val = _load_data(cfg, tokenizer)
    total_steps = t.total_steps or t.epochs * (len(train) // t.train_batch_size)
    model = mlora.from_pretrained(t.policy.model.path, mesh, **model_kwargs(t))
    frozen = t.policy.model.frozen_adapter_path
    if frozen:  # e.g. the SFT adapter under a reward model or DPO (DPO's reference is the base + it)
        model.load_adapter(FROZEN, frozen, trainable=False)
    engine = PreferenceEngine(model, preference_config(cfg, total_steps), reference_adapters=(FROZEN,) if frozen
                              else (), lora=lora_config(t.policy.model.lora, t.seed))
    start_step = 0
    if resume is not None:
        state = load_preference_state(resume, model, engine)
        start_step = state["step"]
        log.info("resumed from %s (step %d of %d)", resume, start_step, total_steps)
    pairs = stage != "sft"
    val_batches = _eval_batches(val, t.train_batch_size, t.micro_train_batch_size_per_gpu * mesh.dp, pad_id, pairs)
    evaluating = bool(val_batches) and t.eval_interval > 0
    saver = _Saver(cfg, mesh, model, engine, ckpt_root, len(train), total_steps, write_state=write_preference_state)

    metrics_log = None
    last: dict = {}
    try:
        if mesh.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            metrics_log = MetricsLogger(t.logger, run_dir, t.project_name, t.run_name,
                                        resume_step=start_step if resume else None)
        if evaluating and t.eval_before_train and resume is None:
            metrics = _evaluate(engine, val_batches)
            if metrics_log is not None:
                metrics_log.log(0, metrics)
            log.info("eval before training: %s", _summary(metrics, stage, "eval/"))
        guard.defer()
        for epoch, step, picked in epoch_batches(len(train), t.train_batch_size, t.seed, total_steps, start_step):
            t0 = time.perf_counter()
            metrics = engine.step(collate([train[i] for i in picked], pad_id, pairs))
            metrics["timing/train_s"] = time.perf_counter() - t0
            metrics["trainer/epoch"] = epoch
            if evaluating and (step % t.eval_interval == 0 or step == total_steps):
                metrics.update(_evaluate(engine, val_batches))
            saved = None
            if t.ckpt_interval > 0 and (step % t.ckpt_interval == 0 or step == total_steps):
                saved = saver.save(step, epoch)
            stop = guard.agreed(mesh.device)
            if metrics_log is not None:
                metrics_log.log(step, metrics)
            log.info("step %3d  %s%s", step, _summary(metrics, stage, ""),
                     f"  | held-out {_summary(metrics, stage, 'eval/')}" if "eval/loss" in metrics else "")
            last = metrics
            if stop and step < total_steps:
                checkpoint = saved or saver.save(step, epoch)
                if mesh.rank == 0:
                    write_marker(run_dir, step, checkpoint, guard.received)
                    log.info("preempted after step %d: checkpoint %s; exiting with %d", step, checkpoint,
                             EX_TEMPFAIL)
                raise Preempted(step, checkpoint)
        final = save_final_adapter(cfg, model, engine, run_dir / "final_adapter")
        if mesh.rank == 0:
            png = _plot(run_dir / "metrics.jsonl", run_dir / "metrics.png", stage)
            log.info("\nmetrics: %s\nplot: %s\nfinal %s adapter (PEFT%s): %s%s", run_dir / "metrics.jsonl", png,
                     stage, ", sequence classification with its score head" if stage == "rm" else "", final,
                     f"\n(trained on top of {frozen})" if frozen else "")
            clear_marker(run_dir)
    finally:
        if metrics_log is not None:
            metrics_log.close()
    return last


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


def _evaluate(engine: PreferenceEngine, batches: list[SequenceBatch]) -> dict[str, float]:
    t0 = time.perf_counter()
    out = {f"eval/{k}": v for k, v in engine.evaluate_all(batches).items()}
    out["timing/eval_s"] = time.perf_counter() - t0
    return out


def _summary(metrics: dict, stage: str, prefix: str) -> str:
    return "  ".join(f"{k} {metrics[prefix + k]:.4f}" for k in HEADLINE[stage] if prefix + k in metrics)


def _plot(metrics_file: Path, out: Path, stage: str) -> Path:
    """Training and held-out curves of the stage's headline metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
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
