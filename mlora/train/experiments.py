"""The experiments of one RL run on one frozen base (``experiments``, :mod:`mlora.config.experiments`).

Experiment ``e`` owns the adapters ``e/policy`` (and ``e/critic`` with its value head under PPO), its
optimizers, schedules, KL controller, data order, sampling seeds and step count; the engines serve its
policy as ``e``. Its steps are numbered on its own: an experiment added when a run resumes starts at its
step 1 while the others continue, so each experiment's data, seeds and results are those of a run of its
own (:func:`joint_schedule`). Its metrics are logged as ``e/<name>`` (``e/reward/mean``, ``e/eval/...``)
beside the run's shared ``timing/*``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Sequence

from mlora.checkpoint.run_state import StageState
from mlora.config.schema import TrainConfig
from mlora.rollout.data import Prompt, epoch_batches
from mlora.train.loop import interval_due

POLICY, CRITIC = "policy", "critic"  # a run's adapters (an experiment's are e/policy, e/critic)


@dataclass
class Experiment:
    """One experiment of the run: its configuration, prompts, engine on the shared base and learned reward.
    A run without ``experiments`` has one, unnamed, whose adapters, metrics and files have today's names."""

    name: str | None
    cfg: TrainConfig
    train: list[Prompt]
    val: list[Prompt]
    engine: object  # its ActorCriticEngine
    learned: object | None  # its LearnedReward
    total_steps: int
    offset: int = 0  # run steps before its first step (an experiment added on resume starts later)

    def key(self, name: str) -> str:
        """``name`` of this experiment's adapter, metric or folder (``e/name``; unnamed: ``name``)."""
        return name if self.name is None else f"{self.name}/{name}"

    @property
    def served(self) -> str:
        """The name the engines serve its policy under."""
        return POLICY if self.name is None else self.name

    def step_of(self, run_step: int) -> int:
        """Its own step at the run's step ``run_step``."""
        return run_step - self.offset

    def runs_at(self, run_step: int) -> bool:
        return 0 < self.step_of(run_step) <= self.total_steps

    def eval_due(self, run_step: int) -> bool:
        """Whether it evaluates after the run's step ``run_step``: every ``trainer.eval_interval`` of its own
        steps and after its last."""
        return (bool(self.val) and self.runs_at(run_step)
                and interval_due(self.step_of(run_step), self.cfg.trainer.eval_interval, self.total_steps))

    def prefixed(self, metrics: dict) -> dict:
        return {self.key(k): v for k, v in metrics.items()}


class ExperimentEngines:
    """The experiments' engines as one checkpointable state (:mod:`mlora.checkpoint.run_state`): each
    experiment's optimizer groups and counters under its name, so that a resume can load any subset."""

    def __init__(self, experiments: Sequence[Experiment]) -> None:
        self.experiments = list(experiments)

    def stage_state(self) -> StageState:
        trained, counters = [], {}
        for e in self.experiments:
            state = e.engine.stage_state()
            trained += [replace(t, role=e.key(t.role), experiment=e.name) for t in state.trained]
            counters.update(e.prefixed(state.counters))
        return StageState("rl", trained, counters, tuple(e.name for e in self.experiments))

    def restore_counters(self, counters: dict[str, float]) -> None:
        for e in self.experiments:
            own = {k[len(e.key("")):]: v for k, v in counters.items() if k.startswith(e.key(""))}
            if own:
                e.engine.restore_counters(own)


def joint_schedule(experiments: Sequence[Experiment], start_step: int
                   ) -> tuple[int, Iterator[tuple[int, int, dict[int, list[int]]]]]:
    """The run's steps after ``start_step``: ``(total run steps, iterator of (epoch, run step, picked))`` where
    ``picked`` maps each experiment running at that step (by index) to its prompts. Experiment ``e`` has done
    ``e.engine.global_step`` steps (restored by a resume, 0 when new), which sets where its steps fall among
    the run's (:attr:`Experiment.offset`); its prompts are those its own seed, data and batch size give
    (:func:`mlora.rollout.data.epoch_batches`), as in a run of its own."""
    for e in experiments:
        e.offset = start_step - e.engine.global_step
    total = max(e.offset + e.total_steps for e in experiments)

    def steps():
        orders = [epoch_batches(len(e.train), e.cfg.trainer.train_batch_size, e.cfg.trainer.seed, e.total_steps,
                                e.engine.global_step) for e in experiments]
        for run_step in range(start_step + 1, total + 1):
            picked, epochs = {}, []
            for i, e in enumerate(experiments):
                if e.runs_at(run_step):
                    epoch, own, prompts = next(orders[i])
                    if own != e.step_of(run_step):
                        raise RuntimeError(f"experiment {e.name}: its data order is at step {own}, not "
                                           f"{e.step_of(run_step)}")
                    picked[i] = prompts
                    epochs.append(epoch)
            yield (min(epochs) if epochs else 0), run_step, picked

    return total, steps()


def experiments_step_line(step: int, metrics: dict, experiments: Sequence[Experiment]) -> str:
    """The console summary of one run step: each running experiment's reward, KL and policy loss."""
    parts = [f"step {step:3d}"]
    for e in experiments:
        if e.key("reward/mean") in metrics:
            parts.append(f"| {e.name} (step {e.step_of(step)}): reward {metrics[e.key('reward/mean')]:.3f} "
                         f"kl {metrics[e.key('kl/mean')]:.4f} pg_loss {metrics[e.key('actor/pg_loss')]:+.4f}"
                         + "".join(f" eval {v:.3f}" for k, v in metrics.items() if k == e.key("eval/all/reward_mean")))
    parts.append(f"| sync {metrics.get('timing/adapter_sync_s', float('nan')):.2f}s")
    return "  ".join(parts)
