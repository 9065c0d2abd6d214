"""The RL stage of the run loop (:mod:`mlora.train.loop`): rollouts from vLLM engines, rewards, a
shared-base PPO/GRPO/RLOO step, the adapter hand-off, evaluation by sampling; for one experiment or for
K of them on one base and one engine set (:mod:`mlora.train.experiments`).

The engines (:class:`~mlora.train.rollouts.Rollouts`) generate every running experiment's prompts in one
call, each with its own policy adapter, sampling and seeds; every rank gets the batches. The update of all
experiments is one shared-base step (:func:`mlora.train.engine.step_experiments`); after it every policy
adapter is handed to the engines and hot-swapped in.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from mlora.config.dtypes import engine_dtype
from mlora.config.experiments import experiment_configs
from mlora.config.schema import TrainConfig, lora_max_rank
from mlora.config.validate import async_groups_in_flight
from mlora.rollout.chat_template import apply_run_template, resolve_chat_template
from mlora.rollout.data import Prompt, epoch_batches, load_prompt_set
from mlora.rollout.envs import REWARD_MODEL_ENV, env_class, is_multi_turn, make_env
from mlora.rollout.generator import SamplingConfig, per_prompt_configs
from mlora.train import loop
from mlora.train.async_schedule import AsyncGeneration, GroupSchedule
from mlora.train.batch import RolloutBatch
from mlora.train.engine import ActorCriticEngine, step_experiments
from mlora.train.experiments import CRITIC, POLICY, Experiment, ExperimentEngines, experiments_step_line, joint_schedule
from mlora.train.from_config import lora_config, ppo_config, sampling_config
from mlora.train.learned_reward import REWARD, build_learned_reward
from mlora.train.loop import FROZEN, hf_save_due
from mlora.train.metrics_log import log, step_line
from mlora.train.rollouts import (
    Collected,
    Job,
    Rollouts,
    engine_placement,
    release_cached_memory,
)


def dapo_shaping(cfg: TrainConfig, batch: RolloutBatch, finish_reasons: Sequence[str | None]) -> dict[str, float]:
    """DAPO's soft overlong punishment (``trainer.algorithm.overlong_buffer_len``) and overlong filtering
    (``generator.apply_overlong_filtering``: ``batch.loss_mask`` drops responses that did not stop), in place;
    returns their metrics (:mod:`mlora.rl.reward_shaping`). The penalty goes where the update reads the reward:
    ``batch.rewards`` and, when the environment gave per-token rewards, the last response token's (SkyRL's
    ``apply_dapo_soft_overlong_punishment``: ``reward[-1] -= penalty``); a response longer than
    ``max_generate_length`` (its span, environment tokens included) has its rewards set to 0."""
    from mlora.rl.reward_shaping import overlong_filter_mask, overlong_penalty, overlong_zeroed

    a, metrics = cfg.trainer.algorithm, {}
    if a.overlong_buffer_len is not None:
        max_len = cfg.generator.sampling_params.max_generate_length
        lengths = batch.response_span.sum(-1).long()
        penalty = overlong_penalty(lengths, max_len, a.overlong_buffer_len, a.overlong_buffer_penalty_factor)
        zeroed = overlong_zeroed(lengths, max_len)
        batch.rewards = torch.where(zeroed, torch.zeros_like(batch.rewards), batch.rewards + penalty)
        if batch.token_rewards is not None:
            tokens = batch.token_rewards.clone()
            tokens[torch.arange(batch.size), batch.last_response_position] += penalty.to(tokens.dtype)
            batch.token_rewards = torch.where(zeroed[:, None], torch.zeros_like(tokens), tokens)
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        metrics["reward/overlong_penalized_ratio"] = float((penalty < 0).float().mean())
    if cfg.generator.apply_overlong_filtering:
        batch.loss_mask = overlong_filter_mask(finish_reasons)
        metrics["response/overlong_filtered_ratio"] = float(1 - batch.loss_mask.mean())
    return metrics


def zero_variance_filter(cfg: TrainConfig, batch: RolloutBatch) -> dict[str, float]:
    """SkyRL's ``trainer.algorithm.zero_variance_filter``: the rows of a prompt group whose live rows (a token in
    the loss) number more than one and whose rewards lie within ``zero_variance_filter_tol`` of each other leave
    the loss (``batch.loss_mask``), in place; returns how many groups were dropped."""
    from mlora.rl.sampling_filters import zero_variance_keep

    a, n = cfg.trainer.algorithm, cfg.generator.n_samples_per_prompt
    if not a.zero_variance_filter:
        return {}
    groups = [i // n for i in range(batch.size)]
    keep = zero_variance_keep(batch.rewards, groups, batch.action_mask.sum(-1) > 0, a.zero_variance_filter_tol)
    batch.loss_mask = keep.float() if batch.loss_mask is None else batch.loss_mask * keep.float()
    return {"reward/num_zero_variance_filtered": float(len(set(groups)) - len({g for g, k in zip(groups, keep) if k}))}


def dump_batch(batch: RolloutBatch, path: Path, trained: dict[str, torch.Tensor] | None = None) -> None:
    """``trainer.dump_data_batch``: what the trainer trained on this step (token ids, masks, shaped rewards,
    the engine's log-probs, the loss mask, and ``trained``: the per-token rewards and advantages the update
    read) as a ``torch.save`` dict of CPU tensors."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**{k: v for k, v in vars(batch).items() if v is not None}, **(trained or {})}, path)


def _load_data(cfg: TrainConfig, tokenizer) -> tuple[list[Prompt], list[Prompt]]:
    t, env = cfg.trainer, cfg.environment.env_class
    env_class(env)  # an unknown environment fails before any model is loaded
    train, dropped = load_prompt_set(list(cfg.data.train_data), tokenizer, t.max_prompt_length, env,
                                     "data.train_data")
    val, val_dropped = load_prompt_set(list(cfg.data.val_data), tokenizer, t.max_prompt_length, env, "data.val_data")
    names = sorted({p.env_class for p in train + val})
    for name in names:
        if not is_multi_turn(name):
            make_env(name)
            if name != REWARD_MODEL_ENV and any(p.row.get("reward_spec") is None for p in train + val
                                                if p.env_class == name):
                raise ValueError(f"rows of reward environment {name!r} lack a reward_spec (its ground truth): "
                                 "give the data files a reward_spec column ({'ground_truth': ...})")
    kinds = {is_multi_turn(n) for n in names}
    if len(kinds) > 1:
        raise ValueError(f"the prompts' environments {names} mix multi-turn ones ("
                         f"{', '.join(n for n in names if is_multi_turn(n))}) with single-response ones: a run "
                         "trains one kind (a batch is generated as trajectories or as responses)")
    if not train:
        raise ValueError("data.train_data is empty: give one or more prompt parquet files")
    if dropped or val_dropped:
        log.info("dropped %d training and %d validation prompts longer than trainer.max_prompt_length=%d tokens",
                 dropped, val_dropped, t.max_prompt_length)
    return train, val


class RLStage:
    """PPO / GRPO / RLOO (``trainer.algorithm``) as a stage of :func:`mlora.train.loop.run`: the prompts, the
    shared base with each experiment's policy (and critic) adapters on it, their PPO engines, the learned
    rewards environments need; the engines and the hand-off once opened. A run without ``experiments`` is one
    unnamed experiment (:class:`~mlora.train.experiments.Experiment`)."""

    def __init__(self, cfg: TrainConfig, mesh) -> None:
        from transformers import AutoTokenizer

        self.cfg, self.mesh = cfg, mesh
        t = cfg.trainer
        self.placement = engine_placement(cfg, mesh.world_size, torch.cuda.is_available())  # before anything loads
        if self.placement is not None and mesh.rank == 0:
            log.info(self.placement.table())
        g = cfg.generator
        tokenizer = self.tokenizer = apply_run_template(
            AutoTokenizer.from_pretrained(str(t.policy.model.path)),
            resolve_chat_template(g.chat_template.source, g.chat_template.name_or_path), g.chat_template_kwargs)
        self.pad_id = tokenizer.pad_token_id or 0
        configs = experiment_configs(cfg)
        named = [(None, cfg)] if configs is None else list(configs.items())
        data = [_load_data(c, tokenizer) for _, c in named]  # bad data fails before the model loads
        self.model, reference = loop.load_model(cfg, mesh)
        self.experiments = [self._experiment(name, c, train, val, reference)
                            for (name, c), (train, val) in zip(named, data)]
        self.single = configs is None
        self.engine = self.experiments[0].engine if self.single else ExperimentEngines(self.experiments)
        self.n_examples = sum(len(e.train) for e in self.experiments)
        self.evaluates = any(e.val for e in self.experiments)
        self.total_steps = max(e.total_steps for e in self.experiments)
        self.rollouts: Rollouts | None = None
        self.run_dir: Path | None = None
        # asynchronous training (runs without experiments): SkyRL's admission of prompt groups
        # (mlora.train.async_schedule), each group's prompt by the run's order, finished groups not trained yet
        self.asynchronous = t.fully_async.enabled
        self.groups: GroupSchedule | None = None
        self.group_prompts: dict[int, int] = {}
        self.generation: AsyncGeneration | None = None  # rank 0's continuous generation
        # the groups trained (every rank): all below trained_below, and those in trained beyond it (finish order
        # trains some later groups before earlier ones); a checkpoint keeps both (SkyRL's consumed uids)
        self.trained_below, self.trained = 0, set()
        self.resumed_groups: tuple[int, list[int]] | None = None

    def _experiment(self, name: str | None, cfg: TrainConfig, train: list[Prompt], val: list[Prompt],
                    reference: tuple[str, ...]) -> Experiment:
        """Experiment ``name``'s engine on the shared base and its learned reward."""
        t = cfg.trainer
        total = loop.total_steps(cfg, len(train))
        key = (lambda role: role) if name is None else (lambda role: f"{name}/{role}")
        engine = ActorCriticEngine(self.model, ppo_config(cfg, total), policy=key(POLICY), critic=key(CRITIC),
                                   reference_adapters=reference, policy_lora=lora_config(t.policy.model.lora, t.seed),
                                   critic_lora=lora_config(t.critic.model.lora, t.seed))
        # the reward adapter + head, frozen on this same base (env_class=reward_model; mlora.train.learned_reward)
        learned = build_learned_reward(cfg, self.model, engine, {p.env_class for p in train + val},
                                       run_frozen=FROZEN if reference else None, name=key(REWARD))
        return Experiment(name, cfg, train, val, engine, learned, total)

    def open(self, run_dir: Path) -> None:
        """The engines, serving the initial policy adapters (or the resumed ones)."""
        self.run_dir = run_dir
        self.rollouts = Rollouts(self.cfg, self.mesh, run_dir, {e.served: e.engine.policy for e in self.experiments},
                                 self.placement, tokenizer=self.tokenizer, configs=[e.cfg for e in self.experiments])
        self.rollouts.sync(self.model, self.experiments[0].engine.global_step)

    def schedule(self, start_step: int):
        if self.single:
            t, e = self.cfg.trainer, self.experiments[0]
            return epoch_batches(len(e.train), t.train_batch_size, t.seed, e.total_steps, start_step)
        self.total_steps, steps = joint_schedule(self.experiments, start_step)
        return steps

    def eval_due(self, step: int) -> bool:
        return any(e.eval_due(step) for e in self.experiments)

    @staticmethod
    def _sampling(e: Experiment, step: int) -> SamplingConfig:
        g, t = e.cfg.generator, e.cfg.trainer
        # rollouts of step s sample with seed + 1000·s (+ the prompt's index): no RNG to carry
        return sampling_config(g.sampling_params, g.n_samples_per_prompt, t.seed + step * 1000)

    def _start_groups(self, step: int) -> None:
        """Asynchronous training, the first step of this launch (a resumed run starts after its checkpoint): the
        group schedule from this step on, each group's prompt as the synchronous loop orders them
        (:func:`~mlora.rollout.data.epoch_batches` is deterministic), and continuous generation on the rank holding
        the engines."""
        e, t, f = self.experiments[0], self.cfg.trainer, self.cfg.trainer.fully_async
        if self.rollouts.starters != [0]:
            raise ValueError(f"trainer.fully_async.enabled=true: the engines are started by ranks "
                             f"{self.rollouts.starters} (local engines on several nodes); asynchronous generation "
                             "drives them all from rank 0: use Ray engines (generator.run_engines_locally=false) or "
                             "one node")
        b, total = t.train_batch_size, e.total_steps * t.train_batch_size
        for _, s, prompts in epoch_batches(len(e.train), b, t.seed, e.total_steps, 0):
            self.group_prompts.update({(s - 1) * b + i: p for i, p in enumerate(prompts)})
        if self.resumed_groups is not None:  # the checkpoint's trained groups: the others generate, in order
            self.trained_below, trained = self.resumed_groups
            self.trained = set(trained)
        else:  # a fresh run, or a checkpoint without them: the first (step - 1) x B groups were trained
            self.trained_below = (step - 1) * b
        order = [g for g in range(self.trained_below, total) if g not in self.trained]
        self.groups = GroupSchedule(b, f.max_staleness_steps, f.num_parallel_generation_workers, (step - 1) * b,
                                    total, order)
        if self.mesh.rank == 0:
            self.generation = AsyncGeneration(self.groups, self._start_async, step)
        if step > 1 and self.mesh.rank == 0 and f.max_staleness_steps:
            n = async_groups_in_flight(self.cfg) - b
            log.info("trainer.fully_async: resumed at step %d; the samples the stopped run had generated ahead (up "
                     "to %d prompt groups) are not in the checkpoint and are discarded: the groups it had not trained, "
                     "from group %d on, are generated again from the resumed policy; none is used twice",
                     step - 1, n, self.trained_below)

    def loop_state(self) -> dict:
        """Asynchronous training: which groups were trained (finish order trains some later groups before
        earlier ones), so that a resumed run generates exactly the others."""
        if not self.asynchronous:
            return {}
        return {"async_trained_below": self.trained_below, "async_trained": sorted(self.trained)}

    def restore(self, state: dict) -> None:
        if self.asynchronous and "async_trained_below" in state:
            self.resumed_groups = (int(state["async_trained_below"]), [int(g) for g in state["async_trained"]])

    def _mark_trained(self, groups: list[int]) -> None:
        self.trained.update(groups)
        while self.trained_below in self.trained:
            self.trained.remove(self.trained_below)
            self.trained_below += 1

    def _start_async(self, groups: list[int], version: int) -> list:
        """Start ``groups`` on the engines (policy ``version``): each with its own prompt's seed in its batch, as
        the synchronous loop samples it (step ``s``'s prompt ``i`` with ``seed + 1000·s + i``)."""
        e, b = self.experiments[0], self.cfg.trainer.train_batch_size
        todo = []
        for g in groups:
            s = g // b + 1
            sampling = per_prompt_configs(self._sampling(e, s), [g - (s - 1) * b])[0]
            todo.append((g, e.train[self.group_prompts[g]], sampling))
        return self.rollouts.start_groups(todo)

    def _collect_async(self, step: int) -> tuple[Collected, dict]:
        """Collective: the first ``train_batch_size`` groups to finish (SkyRL's finish-time FIFO), from rank 0,
        which generates continuously; later groups go on generating while this step trains."""
        e, b = self.experiments[0], self.cfg.trainer.train_batch_size
        if self.groups is None:
            self._start_groups(step)
        t0 = time.perf_counter()
        taken = None
        if self.mesh.rank == 0:
            taken = self.generation.take(b)
            in_flight, waiting = self.generation.state()
            taken = (taken, in_flight, waiting)
        box = [taken]
        dist.broadcast_object_list(box, src=0)  # generations are objects: every rank trains the same batch
        taken, in_flight, waiting = box[0]
        # which groups train is their finish order; their rows go in the run's order (the objective is the same,
        # and max_staleness_steps=0 is then the synchronous loop bit for bit)
        taken = sorted(taken, key=lambda f: f.group)
        self._mark_trained([f.group for f in taken])
        wait = time.perf_counter() - t0
        prompts, gens, rewards = [], [], []
        for k, f in enumerate(taken):
            prompts.append(e.train[self.group_prompts[f.group]])
            for gen in f.gens:
                gen.prompt_index = k
            gens += f.gens
            rewards += f.rewards
        versions = [f.version for f in taken]
        got = self.rollouts.assemble(prompts, gens, rewards, min(versions), self.pad_id)
        trained = e.engine.global_step
        staleness = [trained - v for v in versions]
        bound = self.cfg.trainer.fully_async.max_staleness_steps
        violations = sum(x > bound for x in staleness)
        if violations and self.mesh.rank == 0:
            log.warning("trainer.fully_async: %d of step %d's groups are staler than max_staleness_steps=%d (up to %d "
                        "steps; SkyRL's caveat: a group that generates longer than the bound still trains)",
                        violations, step, bound, max(staleness))
        got.metrics.update({
            "timing/rollout_wait_s": wait,  # what the trainer waited for generation
            "timing/generate_s": max(f.finished - f.started for f in taken),
            "async/generation_version": min(versions), "async/trainer_version": trained,
            "async/staleness_mean": sum(staleness) / len(staleness), "async/staleness_max": max(staleness),
            "async/staleness_min": min(staleness), "async/staleness_ratio": sum(x > 0 for x in staleness) / len(staleness),
            "async/staleness_violation_count": violations,
            "async/groups_in_flight": in_flight, "async/groups_waiting": waiting})
        if self.mesh.rank == 0 and self.run_dir is not None:
            with open(self.run_dir / "async_groups.jsonl", "a") as out:
                for f in taken:
                    out.write(json.dumps({"step": step, "group": f.group, "version": f.version,
                                          "started": f.started, "finished": f.finished}) + "\n")
        return got, {}

    def _collect(self, step: int, picked) -> tuple[list[tuple[Experiment, Collected]], dict]:
        """Collective: the rollouts of every experiment running at ``step``, and the run's shared metrics."""
        todo = [(self.experiments[0], picked)] if self.single else [(self.experiments[i], p) for i, p in picked.items()]
        if self.asynchronous:  # runs without experiments; the groups that finish first, whatever ``picked`` says
            got, shared = self._collect_async(step)
            return [(todo[0][0], got)], shared
        jobs = [Job(e.cfg, e.served, [e.train[i] for i in p], self._sampling(e, e.step_of(step))) for e, p in todo]
        got = self.rollouts.collect_jobs(jobs, self.pad_id)
        shared = {k: got[0].metrics.pop(k) for k in list(got[0].metrics) if k.startswith("timing/")}
        return [(e, c) for (e, _), c in zip(todo, got)], shared

    def step(self, step: int, picked) -> dict[str, float]:
        """Rollouts of every running experiment -> rewards -> (colocated engines sleep) -> one shared-base
        update of all of them (:func:`mlora.train.engine.step_experiments`) -> (the trainer frees its cached
        blocks, the engines wake) -> hand-off of every policy adapter.

        ``picked``: the prompts (a run without experiments), or each running experiment's by index
        (:func:`mlora.train.experiments.joint_schedule`). Asynchronous training (``trainer.fully_async``): the
        rollouts are groups admitted by SkyRL's capacity rule (:mod:`mlora.train.async_schedule`), each sampled
        by the adapter the engines had when it was submitted; later groups generate while this step trains."""
        collected, shared = self._collect(step, picked)
        own: list[dict] = []
        for k, (e, got) in enumerate(collected):
            self._score(e, got)
            if e.cfg.trainer.algorithm.dynamic_sampling.type is not None:
                got = self._dynamic_sampling(e, step, got)
                collected[k] = (e, got)
            metrics = got.metrics
            metrics.update(dapo_shaping(e.cfg, got.batch, [reason for _, reason in got.rows]))
            metrics.update(zero_variance_filter(e.cfg, got.batch))
            own.append(metrics)
        t0 = time.perf_counter()
        if len(collected) == 1:
            results = [collected[0][0].engine.step(collected[0][1].batch)]
        else:
            results = step_experiments([(e.engine, got.batch) for e, got in collected])
        shared["timing/train_s"] = time.perf_counter() - t0
        for (e, got), metrics, result in zip(collected, own, results):
            metrics.update(result)
            self._dump_batch(e, e.step_of(step), got.batch)
            self._export_adapter(e, e.step_of(step))
        if self.rollouts.asleep:  # the engines wake into the memory the step held
            release_cached_memory()
        shared.update(self.rollouts.sync(self.model, self.experiments[0].engine.global_step))
        if self.generation is not None:  # the update is in the engines: SkyRL's capacity opens for step + 1
            self.generation.advance(step + 1)
        if self.single:
            return {**own[0], **shared}
        out = dict(shared)
        for (e, _), metrics in zip(collected, own):
            epochs = self.n_steps_per_epoch(e)
            out.update(e.prefixed({**metrics, "trainer/step": e.step_of(step),
                                   "trainer/epoch": (e.step_of(step) - 1) // epochs if epochs else 0}))
        return out

    @staticmethod
    def _score(e: Experiment, got: Collected) -> None:
        """The model-based part of the reward (a learned reward on the trainer), in place."""
        if e.learned is not None:
            got.metrics.update(e.learned.apply(got.batch, got.rows))

    def _dynamic_sampling(self, e: Experiment, step: int, got: Collected) -> Collected:
        """SkyRL's ``trainer.algorithm.dynamic_sampling`` (DAPO's filter, POLARIS's replace): prompt groups whose
        rewards are all equal carry no GRPO signal. filter keeps the groups with one and generates more batches
        until ``train_batch_size`` groups are kept (the first that many train); replace puts groups with a signal
        in the others' place once more than ``min_replace_ratio`` of a batch has one, else generates another batch.
        An extra batch's prompts are ``train_batch_size`` of the training set drawn by a shuffle seeded by
        (seed, step, attempt), sampled with a seed of their own, so the later steps' prompts stay theirs. At most
        ``max_sample_batches`` batches (-1: no limit), else the run stops (SkyRL's rule)."""
        from mlora.rl.sampling_filters import group_has_signal, replacement_rows
        from mlora.train.batch import concat_batches

        ds, t = e.cfg.trainer.algorithm.dynamic_sampling, e.cfg.trainer
        n, want = e.cfg.generator.n_samples_per_prompt, t.train_batch_size
        kept: list[tuple[RolloutBatch, list]] = []
        groups, attempt, first = 0, 1, got.metrics

        def draws() -> torch.Generator:  # this step's and attempt's random choices, the same on every rank
            return torch.Generator().manual_seed(t.seed * 1_000_003 + step * 1009 + attempt)

        while True:
            signal = group_has_signal(got.batch.rewards, n)
            if n == 1:  # SkyRL: a group of one always counts as informative
                signal = torch.ones_like(signal)
            stats = {"dynamic_sampling/batches": float(attempt),
                     "dynamic_sampling/signal_ratio": float(signal.float().mean())}
            if ds.type == "replace" and signal.sum() > ds.min_replace_ratio * len(signal):
                index = replacement_rows(signal, n, draws())
                return Collected(got.batch.rows(index), {**first, **stats,
                                 "dynamic_sampling/replaced_groups": float((~signal).sum())},
                                 [got.rows[i] for i in index.tolist()], got.version)
            if ds.type == "filter":
                rows = (signal[:, None].expand(-1, n).reshape(-1)).nonzero().flatten()
                kept.append((got.batch.rows(rows), [got.rows[i] for i in rows.tolist()]))
                groups += int(signal.sum())
                if groups >= want:
                    batch = concat_batches([b for b, _ in kept], self.pad_id).rows(slice(0, want * n))
                    return Collected(batch, {**first, **stats}, [r for _, rs in kept for r in rs][:want * n],
                                     got.version)
            if 0 < ds.max_sample_batches <= attempt:
                found = f"kept {groups} of the {want}" if ds.type == "filter" else "never had enough of the"
                raise RuntimeError(f"trainer.algorithm.dynamic_sampling.type={ds.type}: step {step} generated "
                                   f"{attempt} batches (max_sample_batches={ds.max_sample_batches}) and {found} "
                                   "prompt groups with a reward spread it needs; check the data's difficulty (or raise "
                                   "max_sample_batches, -1: no limit)")
            attempt += 1
            prompts = [e.train[i] for i in torch.randperm(len(e.train), generator=draws())[:want].tolist()]
            sampling = self._sampling(e, e.step_of(step))
            sampling = dataclasses.replace(sampling, seed=None if sampling.seed is None
                                           else sampling.seed + attempt * 7_000_003)
            self.rollouts.wake()
            got = self.rollouts.collect_jobs([Job(e.cfg, e.served, prompts, sampling)], self.pad_id)[0]
            self._score(e, got)

    @staticmethod
    def n_steps_per_epoch(e: Experiment) -> int:
        return len(e.train) // e.cfg.trainer.train_batch_size

    def _export_dir(self, e: Experiment) -> Path:
        """Where an experiment's exports and dumps go: ``trainer.export_path`` (unset: the run directory), in
        a folder of its own name for a run with experiments."""
        root = Path(e.cfg.trainer.export_path or self.run_dir)
        return root if e.name is None else root / e.name

    def _dump_batch(self, e: Experiment, step: int, batch: RolloutBatch) -> None:
        """``trainer.dump_data_batch``: the batch the update trains on, as SkyRL; rank 0."""
        if e.cfg.trainer.dump_data_batch and self.mesh.rank == 0:
            dump_batch(batch, self._export_dir(e) / "dumped_data" / f"global_step_{step}_training_input.pt",
                       e.engine.last_trained)

    def _export_adapter(self, e: Experiment, step: int) -> None:
        """``trainer.hf_save_interval``: the policy adapter (PEFT) in ``<export>/global_step_<k>/policy``,
        SkyRL's layout (collective)."""
        t = e.cfg.trainer
        if hf_save_due(step, t.hf_save_interval, e.total_steps, self.n_steps_per_epoch(e)):
            self.model.save_adapter(e.engine.policy, self._export_dir(e) / f"global_step_{step}" / POLICY)

    def evaluate(self, step: int) -> dict[str, float]:
        """Held-out metrics of each experiment due at the run's step ``step`` (all of them before training)."""
        out: dict[str, float] = {}
        for e in self.experiments:
            if step == 0 or e.eval_due(step):
                own = e.step_of(step) if step else 0
                metrics = self.rollouts.evaluate(e.val, own, self.run_dir, cfg=e.cfg, adapter=e.served,
                                                 dump_dir=self._export_dir(e) / "dumped_evals")
                out.update(metrics if self.single else e.prefixed({**metrics, "trainer/step": own} if metrics else {}))
        return out

    def step_line(self, step: int, metrics: dict[str, float]) -> str:
        return step_line(step, metrics) if self.single else experiments_step_line(step, metrics, self.experiments)

    def eval_line(self, metrics: dict[str, float]) -> str:
        return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items() if "eval/" in k and not k.startswith("timing/"))

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {e.key("reward"): f"{metrics[e.key('reward/mean')]:.3f}" for e in self.experiments
                if e.key("reward/mean") in metrics}

    def finish(self, run_dir: Path) -> Path:
        """Each policy adapter in PEFT format (``final_adapter``, or ``final_adapter/<experiment>``), the plot,
        the experiments' results table, and how to serve the adapters."""
        final = run_dir / "final_adapter"
        adapters = {}
        for e in self.experiments:
            adapters[e.served] = final if e.name is None else final / e.name
            self.model.save_adapter(e.engine.policy, adapters[e.served])
        if self.mesh.rank == 0:
            _report(self.cfg, run_dir, adapters, self.rollouts.engine_base, self.rollouts.max_model_len,
                    self.experiments)
        return final

    def close(self) -> None:
        if self.generation is not None:
            self.generation.close()
        if self.rollouts is not None:
            self.rollouts.close()


def run_rl(cfg: TrainConfig, notes: Sequence[str] = (), build_assets: Callable[[str], object] | None = None) -> dict:
    """Train PPO / GRPO / RLOO; returns the last step's metrics (on every rank). See :func:`mlora.train.loop.run`."""
    return loop.run(cfg, RLStage, notes, build_assets)


def _report(cfg: TrainConfig, run_dir: Path, adapters: dict[str, Path], engine_base, max_model_len: int,
            experiments: Sequence[Experiment]) -> None:
    from mlora.rollout.serve import format_command, serve_command
    from mlora.train.plot import plot_metrics

    t = cfg.trainer
    names = [e.name for e in experiments if e.name is not None]
    png = plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png", experiments=names)
    frozen = t.policy.model.frozen_adapter_path
    argv = serve_command(engine_base, {name: path.resolve() for name, path in adapters.items()},
                         max_lora_rank=max(lora_max_rank(e.cfg.trainer.policy.model.lora) for e in experiments),
                         dtype=engine_dtype(cfg, torch.cuda.is_available()),
                         kv_cache_memory_bytes=cfg.generator.kv_cache_memory_bytes,
                         max_model_len=max_model_len)
    table = ""
    if names:
        from mlora.train.experiment_report import write_results

        table = "\n" + write_results(run_dir / "metrics.jsonl", names, run_dir) + "\n"
    log.info("%s\nmetrics: %s\nplot: %s\nfinal adapter%s (PEFT): %s\n%sserve %s with vLLM (OpenAI API):\n  %s", table,
             run_dir / "metrics.jsonl", png, "s" if names else "",
             " ".join(str(p) for p in adapters.values()),
             f"(it applies on top of {frozen}, merged into the base in {engine_base})\n" if frozen else "",
             "them" if names else "it", format_command(argv))
