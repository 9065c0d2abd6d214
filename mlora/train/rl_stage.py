"""The RL stage of the run loop (:mod:`mlora.train.loop`): rollouts from vLLM engines, rewards, a
shared-base PPO/GRPO/RLOO step, the adapter hand-off, evaluation by sampling.

Global rank 0 owns the inference engines (:class:`Rollouts`); the trainer ranks get
each step's rollouts by broadcast. After each update the policy adapter is handed to every engine
and hot-swapped in: as PEFT files in the sync directory (``generator.weight_sync=disk|memory``,
``save_adapter``) or as tensors that each rank copies from its own shards into one shared-memory
segment (``weight_sync=tensors``, :mod:`mlora.rollout.tensor_sync`).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from mlora.config.schema import TrainConfig
from mlora.config.validate import async_batches_ahead
from mlora.parallel.small_collectives import all_flags, broadcast_json, ranks_seeing_folder
from mlora.rollout.data import Prompt, epoch_batches, load_prompt_set, prompt_text
from mlora.rollout.envs import env_class, is_multi_turn, make_env
from mlora.rollout.generator import Generation, SamplingConfig
from mlora.rollout.multi_turn import TURN_REWARDS, TurnFormat, end_reason_counts, run_episodes
from mlora.rollout.placement import Placement, cuda_visible_devices, plan_placement
from mlora.rollout.shm_names import SHM_DIR, remove_stale, shm_name
from mlora.rollout.spread import collect_scored, gather_scored, generate_scored, submit_generation
from mlora.train import loop
from mlora.train.batch import RolloutBatch
from mlora.train.engine import ActorCriticEngine
from mlora.train.evaluate import evaluate
from mlora.train.from_config import lora_config, ppo_config, sampling_config
from mlora.train.learned_reward import build_learned_reward, env_kwargs
from mlora.train.loop import FROZEN
from mlora.train.metrics_log import log, step_line

POLICY, CRITIC = "policy", "critic"  # the trainer's adapter names; the engines serve POLICY under this name


def build_batch(prompt_ids: list[list[int]], gens: list[Generation], rewards: list[float], pad_id: int,
                turn_rewards: str = "turn_end") -> RolloutBatch:
    """Right-padded prompt+response sequences, response mask and the engine's log-probs per action.

    Multi-turn generations (:mod:`mlora.rollout.multi_turn`: ``extra["model_mask"]``) keep only the model's
    tokens in the response mask, and their turn rewards become per-token rewards: each on its turn's last
    model token (``turn_rewards="turn_end"``, SkyRL's) or their sum on the last one (``"final"``)."""
    if turn_rewards not in TURN_REWARDS:
        raise ValueError(f"turn_rewards={turn_rewards!r}; valid: {', '.join(TURN_REWARDS)}")
    seqs = [prompt_ids[g.prompt_index] + g.token_ids for g in gens]
    width = max(len(s) for s in seqs)
    b = len(seqs)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros(b, width, dtype=torch.long)
    resp = torch.zeros(b, width, dtype=torch.long)
    rollout_lp = torch.zeros(b, width - 1)
    multi = any("model_mask" in g.extra for g in gens)
    token_rewards = torch.zeros(b, width - 1) if multi else None
    for i, (seq, g) in enumerate(zip(seqs, gens)):
        n_prompt = len(prompt_ids[g.prompt_index])
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        rollout_lp[i, n_prompt - 1:len(seq) - 1] = torch.tensor(g.logprobs, dtype=torch.float32)
        if "model_mask" not in g.extra:
            resp[i, n_prompt:len(seq)] = 1
            if multi:
                token_rewards[i, len(seq) - 2] = rewards[i]
            continue
        resp[i, n_prompt:len(seq)] = torch.tensor(g.extra["model_mask"], dtype=torch.long)
        # the token at sequence index n_prompt + e is predicted at action position n_prompt + e - 1
        ends = [n_prompt + e - 1 for e in g.extra["turn_ends"]]
        if turn_rewards == "final":
            token_rewards[i, ends[-1]] = sum(g.extra["turn_rewards"])
        else:
            for at, r in zip(ends, g.extra["turn_rewards"]):
                token_rewards[i, at] += r
    return RolloutBatch(ids, attn, resp, torch.tensor(rewards, dtype=torch.float32), rollout_lp,
                        token_rewards=token_rewards)


def dapo_shaping(cfg: TrainConfig, batch: RolloutBatch, finish_reasons: Sequence[str | None]) -> dict[str, float]:
    """DAPO's soft overlong punishment (``trainer.algorithm.overlong_buffer_len``: added to ``batch.rewards``)
    and overlong filtering (``generator.apply_overlong_filtering``: ``batch.loss_mask`` drops responses
    that did not stop), in place; returns their metrics (:mod:`mlora.rl.reward_shaping`)."""
    from mlora.rl.reward_shaping import overlong_filter_mask, overlong_penalty

    a, metrics = cfg.trainer.algorithm, {}
    if a.overlong_buffer_len is not None:
        penalty = overlong_penalty(batch.response_positions.sum(-1), cfg.generator.sampling_params.max_generate_length,
                                   a.overlong_buffer_len, a.overlong_buffer_penalty_factor)
        batch.rewards = batch.rewards + penalty
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        metrics["reward/overlong_penalized_ratio"] = float((penalty < 0).float().mean())
    if cfg.generator.apply_overlong_filtering:
        batch.loss_mask = overlong_filter_mask(finish_reasons)
        metrics["response/overlong_filtered_ratio"] = float(1 - batch.loss_mask.mean())
    return metrics


def hf_save_due(step: int, interval: int, total_steps: int, steps_per_epoch: int) -> bool:
    """SkyRL's ``trainer.hf_save_interval`` schedule: every ``interval`` steps, at each epoch's end and
    after the last step; never when ``interval <= 0``."""
    if interval <= 0:
        return False
    return step % interval == 0 or step == total_steps or (steps_per_epoch > 0 and step % steps_per_epoch == 0)


def dump_batch(batch: RolloutBatch, path: Path) -> None:
    """``trainer.dump_data_batch``: what the trainer trains on this step (token ids, masks, shaped rewards,
    the engine's log-probs, the loss mask) as a ``torch.save`` dict of CPU tensors."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: v for k, v in vars(batch).items() if v is not None}, path)


def _sync_dir(cfg: TrainConfig, adapter: str) -> Path:
    """Where rank 0 writes the adapter for the engines (weight_sync=disk|memory): a folder no other run
    uses (its name holds this host and process, :func:`mlora.rollout.shm_names.shm_name`), under
    ``/dev/shm`` (memory) or ``lora_sync_path`` (disk; default ``<run_dir>/lora_sync``)."""
    name = cfg.trainer.run_name.replace("/", "_")  # one folder, also for run names like Qwen/Qwen3-0.6B-grpo
    if cfg.generator.weight_sync == "memory":
        if not SHM_DIR.is_dir():
            raise RuntimeError("generator.weight_sync=memory needs /dev/shm (shared memory); use disk")
        return SHM_DIR / shm_name(f"sync-{name}") / adapter
    root = cfg.trainer.policy.model.lora.lora_sync_path or Path(cfg.trainer.run_dir) / "lora_sync"
    return Path(root) / shm_name(name) / adapter


@dataclass
class QueuedBatch:
    """A batch whose generation is queued on the engines (:meth:`Rollouts.submit`): its prompts, the policy
    version of the adapter it samples with, and this rank's pending engine calls (None where it holds none)."""

    prompts: list[Prompt]
    version: int
    pending: tuple | None


class Rollouts:
    """The engines, the environments that score their responses, and the hand-off of the policy adapter.

    Engines are started by the ranks the placement names (each node's local rank 0 for local engines on
    GPUs, :mod:`mlora.rollout.placement`), else all by global rank 0 (CPU, Ray). ``starts``: the global
    indices of the engines this rank starts, overriding that choice (tests). ``collect``, ``sync`` and
    ``evaluate`` are collective: every rank gets the same batch."""

    def __init__(self, cfg: TrainConfig, mesh, run_dir: Path, adapter: str, placement: Placement | None = None,
                 starts: Sequence[int] | None = None, tokenizer=None) -> None:
        self.cfg, self.mesh, self.adapter = cfg, mesh, adapter
        # multi-turn environments (mlora.rollout.multi_turn) turn observations into tokens with the tokenizer
        self.turns = TurnFormat(tokenizer, cfg.generator.use_conversation_multi_turn is not False) if tokenizer else None
        e = cfg.generator.inference_engine
        self.total = e.num_engines
        if starts is None:
            starts = ([s.index for s in placement.started_by(mesh.rank)] if placement is not None
                      else range(self.total) if mesh.rank == 0 else ())
        self.slots = list(starts)
        self.starters = [r for r, holds in enumerate(all_flags(bool(self.slots))) if holds]
        self.sync_dir = Path(broadcast_json(str(_sync_dir(cfg, adapter)) if mesh.rank == 0 else None))
        self.tensors = cfg.generator.weight_sync == "tensors"
        self.handoff = None  # weight_sync=tensors: the segment, made at the first sync (it needs the model)
        # asynchronous training (trainer.fully_async): swaps are queued between generation requests, not waited for
        self.queued = cfg.trainer.fully_async.enabled
        self.swaps: list = []  # the last queued swap's calls
        self.version = -1  # the policy version (updates applied) of the adapter last handed to the engines
        self.generator = None
        self.envs: dict = {}
        self.engine_base = cfg.trainer.policy.model.path
        # colocated engines sleep from the end of generation until the next hand-off (vLLM's sleep mode)
        self.sleeps = self.asleep = False
        if self.starters != [0]:
            self._check_shared_sync()
        frozen = cfg.trainer.policy.model.frozen_adapter_path
        if frozen:  # the engines load the base with the frozen adapter merged, once (rank 0), in the run dir
            from mlora.export.merge import merge_adapter

            if mesh.rank == 0:
                merge_adapter(self.engine_base, frozen, run_dir / "engine_base", progress=False)
            self.engine_base = run_dir / "engine_base"
            dist.barrier()
        self.max_model_len = engine_max_model_len(cfg, self.engine_base)  # the engines' context
        can_sleep = self._start_engines(placement) if self.slots else True
        if cfg.trainer.placement.colocate_all:  # every rank frees its cached blocks while the engines sleep
            flags = all_flags(can_sleep)
            self.sleeps = all(flags[r] for r in self.starters)
            if not self.sleeps and mesh.rank == 0:
                log.info("trainer.placement.colocate_all=true: the vLLM engines cannot sleep (vLLM reports no sleep "
                         "mode on this platform%s): they keep their memory while the trainer works",
                         "" if torch.cuda.is_available() else ", the CPU build")

    def _start_engines(self, placement: Placement | None) -> bool:
        """Start this rank's engines; returns whether they can sleep."""
        from mlora.rollout.vllm_engine import build_engines

        stale = remove_stale()  # on this node: what killed runs left in its /dev/shm
        if stale:
            log.info("removed %d shared-memory leftovers of killed runs on this host: %s", len(stale), " ".join(stale))
        options = engine_options(self.cfg, self.engine_base, torch.cuda.is_available())
        options["num_engines"] = len(self.slots)
        if options.get("engine_cores") is not None:
            options["engine_cores"] = [options["engine_cores"][i] for i in self.slots]
        if placement is not None:
            options["engine_gpus"] = [cuda_visible_devices(placement.engines[i].gpus) for i in self.slots]
        log.info("vLLM engines %s: max_model_len %d%s", self.slots, options["max_model_len"],
                 "" if options.get("engine_cores") is None else
                 "; CPU cores per engine " + " ".join(str(c) for c in options["engine_cores"]))
        self.generator = build_engines(self.engine_base, **options)
        return self.generator.sleep_mode_available()

    def _check_shared_sync(self) -> None:
        """Engines started by other ranks than global rank 0 (several nodes) load the adapter files rank 0
        writes: only weight_sync=disk on a folder every starter sees (a token file proves it)."""
        w = self.cfg.generator.weight_sync
        if w != "disk":
            raise ValueError(f"generator.weight_sync={w}: the engines are started by ranks {self.starters} (engines "
                             "on several nodes), but the adapter's shared memory is global rank 0's; use "
                             "generator.weight_sync=disk with trainer.policy.model.lora.lora_sync_path on a file "
                             "system every node mounts (or Ray engines, generator.run_engines_locally=false)")
        folder = self.sync_dir.parent
        seen = ranks_seeing_folder(folder, f"creating the adapter sync folder {folder}")
        blind = [r for r in self.starters if not seen[r]]
        if blind:
            raise ValueError(f"the adapter sync folder {folder} (trainer.policy.model.lora.lora_sync_path, default "
                             f"under trainer.run_dir) is not visible to ranks {blind}, which start engines: put it "
                             "on a file system every node mounts")

    def _generate(self, prompts: list[Prompt], sampling: SamplingConfig, score_of) -> tuple[list, list, float]:
        """Collective: generations, rewards and seconds of ``prompts`` (multi-turn episodes where their
        environment is a multi-turn one)."""
        if self.multi_turn(prompts):
            return self._episodes(prompts, sampling)
        return generate_scored(self.generator, self.slots, self.total, [p.token_ids for p in prompts], sampling,
                               score_of)

    @staticmethod
    def multi_turn(prompts: list[Prompt]) -> bool:
        return bool(prompts) and is_multi_turn(prompts[0].env_class)

    def _episodes(self, prompts: list[Prompt], sampling: SamplingConfig) -> tuple[list, list, float]:
        """Collective: multi-turn trajectories of ``prompts`` (:func:`mlora.rollout.multi_turn.run_episodes`),
        prompt ``i`` on the rank holding engine ``i mod total``, its environment steps beside it; every rank
        gets every trajectory and its total reward, in prompt order."""
        g, env = self.cfg.generator, self.cfg.environment
        part: tuple = ([], [], 0.0)
        if self.generator is not None:
            t0 = time.perf_counter()
            mine = [i for i in range(len(prompts)) if i % self.total in self.slots]
            settings = dict(env.skyrl_gym)

            def make(prompt: Prompt):
                extras = {**prompt.row, "max_turns": prompt.row.get("max_turns") or g.max_turns}
                return env_class(prompt.env_class)(env_config=dict(settings.get(prompt.env_class) or {}),
                                                   extras=extras)

            def ids_of(prompt: Prompt, conversation) -> list[int]:
                text = prompt_text({**prompt.row, "prompt": conversation}, self.turns.tokenizer)
                return self.turns.tokenizer(text, add_special_tokens=True)["input_ids"]

            # a next turn's input must leave the engine's context room for one more generation
            bound = min(g.max_input_length or self.cfg.trainer.max_prompt_length,
                        self.max_model_len - sampling.max_generate_length)
            gens = run_episodes(self.generator.generate, [prompts[i] for i in mine], sampling, make, self.turns,
                                g.max_turns, bound, ids_of, int(settings.get("max_env_workers", 1)))
            for gen in gens:
                gen.prompt_index = mine[gen.prompt_index]
            if g.zero_reward_on_non_stop:  # SkyRL's: a trajectory whose last turn was cut scores nothing
                for gen in gens:
                    if gen.finish_reason != "stop":
                        gen.extra["turn_rewards"] = [0.0] * len(gen.extra["turn_rewards"])
            part = (gens, [sum(gen.extra["turn_rewards"]) for gen in gens], time.perf_counter() - t0)
        return gather_scored(part)

    def score(self, prompt: Prompt, gen: Generation) -> float:
        if self.cfg.generator.zero_reward_on_non_stop and gen.finish_reason != "stop":
            return 0.0
        if prompt.env_class not in self.envs:
            self.envs[prompt.env_class] = make_env(prompt.env_class, **env_kwargs(self.cfg, prompt.env_class))
        return self.envs[prompt.env_class].reward(prompt.row, gen.text, gen.token_ids)

    def sync(self, model, version: int) -> dict[str, float]:
        """Wake sleeping engines, hand the policy adapter (policy version ``version``: updates applied) to them
        (collective) and hot-swap it in: PEFT files in the sync directory, or (``weight_sync=tensors``) each
        rank's shards copied into the shared segment.

        Asynchronous training (``trainer.fully_async``): the swap is queued behind the generation requests
        already submitted (they finish on the version they started with) and not waited for; the next hand-off
        first waits for it, since it overwrites the files or segment the engines read."""
        t0 = time.perf_counter()
        out = {}
        if self.asleep:  # back on the GPUs before the adapter goes in
            if self.generator is not None:
                out["timing/engine_wake_s"] = self.generator.wake_up()
            self.asleep = False
        if self.queued:
            for call in self.swaps:
                self.generator.wait(call)
            self.swaps = []
            out["timing/swap_wait_s"] = time.perf_counter() - t0
            dist.barrier()  # no rank overwrites its part before every engine has loaded the previous version
        if self.tensors:
            if self.handoff is None:
                from mlora.rollout.tensor_sync import TensorHandoff

                self.handoff = TensorHandoff(model, self.adapter)
            path = self.handoff.write()  # rank 0's segment, for its engines (the only starter: _check_shared_sync)
        else:
            model.save_adapter(self.adapter, self.sync_dir)
        out["timing/adapter_gather_s"] = time.perf_counter() - t0
        if self.generator is not None:
            method, arg = ("set_adapter_tensors", path) if self.tensors else ("set_adapter", str(self.sync_dir))
            if self.queued:
                self.swaps = self.generator.submit_all(method, arg, self.adapter)
                if self.cfg.trainer.fully_async.clear_kv_cache_on_weight_sync:
                    self.swaps += self.generator.submit_all("reset_prefix_cache")
            else:
                out["timing/adapter_swap_s"] = (self.generator.update_adapter_tensors(path, self.adapter)
                                                if self.tensors else self.generator.update_adapter(self.sync_dir,
                                                                                                   self.adapter))
        self.version = version
        out["timing/adapter_sync_s"] = time.perf_counter() - t0
        return out

    def submit(self, prompts: list[Prompt], sampling: SamplingConfig) -> QueuedBatch:
        """Queue a batch's generation on this rank's engines, behind what is queued already: it runs on the
        adapter of the last hand-off (:attr:`version`). :meth:`collect_queued` waits for it."""
        return QueuedBatch(prompts, self.version, submit_generation(self.generator, self.slots, self.total,
                                                                    [p.token_ids for p in prompts], sampling))

    def collect(self, prompts: list[Prompt], sampling: SamplingConfig, pad_id: int) -> tuple[RolloutBatch, dict]:
        """Generate and score where the engines are; every rank gets the batch (:meth:`collect_queued`;
        multi-turn environments: :meth:`_episodes`)."""
        if self.multi_turn(prompts):
            gens, rewards, seconds = self._episodes(prompts, sampling)
            return self._batch(prompts, gens, rewards, seconds, self.version, pad_id)
        return self.collect_queued(self.submit(prompts, sampling), pad_id)

    def collect_queued(self, queued: QueuedBatch, pad_id: int) -> tuple[RolloutBatch, dict]:
        """Wait for a batch :meth:`submit` queued and score it where the engines are; every rank gets the batch."""
        prompts = queued.prompts
        gens, rewards, seconds = collect_scored(self.generator, queued.pending, lambda i, g: self.score(prompts[i], g))
        return self._batch(prompts, gens, rewards, seconds, queued.version, pad_id)

    def _batch(self, prompts: list[Prompt], gens: list[Generation], rewards: list[float], seconds: float,
               version: int, pad_id: int) -> tuple[RolloutBatch, dict]:
        """The batch of scored generations and its metrics. Colocated engines that can sleep go to sleep after
        it (:meth:`sync` wakes them)."""
        metrics = {"timing/generate_s": seconds}
        if gens and "end_reason" in gens[0].extra:
            metrics.update(self._turn_metrics(gens))
        if self.sleeps:  # the trainer has the GPUs until the next hand-off
            if self.generator is not None:
                metrics["timing/engine_sleep_s"] = self.generator.sleep()
            self.asleep = True
        # what the learned reward (env_class=reward_model) needs of each row, scored on the trainer later
        self.last_rows = [(prompts[g.prompt_index].env_class, g.finish_reason) for g in gens]
        self.last_version = version
        return build_batch([p.token_ids for p in prompts], gens, rewards, pad_id, self.cfg.generator.turn_rewards), metrics

    def _turn_metrics(self, gens: list[Generation]) -> dict[str, float]:
        """Turns, environment tokens and end reasons of multi-turn trajectories; the faults are logged once per
        batch with the first message of each kind (the run goes on without those trajectories' rewards)."""
        counts = end_reason_counts(gens)
        n = len(gens)
        out = {"multi_turn/turns_mean": sum(g.extra["turns"] for g in gens) / n,
               "multi_turn/env_tokens_mean": sum(len(g.token_ids) - sum(g.extra["model_mask"]) for g in gens) / n,
               **{f"multi_turn/ended_{k}": float(v) for k, v in counts.items()}}
        if self.mesh.rank == 0:
            faults = {}
            for g in gens:
                reason = str(g.extra["end_reason"])
                if reason.split(":", 1)[0] in ("env_error", "malformed"):
                    faults.setdefault(reason.split(":", 1)[0], reason)
            for kind, first in faults.items():
                log.warning("%d trajectories ended by %s (they keep the rewards of their earlier turns); the first: %s",
                            counts[kind], kind, first)
        return out

    def evaluate(self, prompts: list[Prompt], step: int, run_dir: Path) -> dict[str, float]:
        """Evaluation metrics (collective; rank 0 returns them and writes the dump, the others return {})."""
        if not prompts:
            return {}
        g, t = self.cfg.generator, self.cfg.trainer
        sampling = sampling_config(g.eval_sampling_params, g.eval_n_samples_per_prompt, t.seed)
        t0 = time.perf_counter()
        rank0 = self.mesh.rank == 0
        out = evaluate(lambda chunk, s, score_of: self._generate(chunk, s, score_of)[:2], prompts, sampling,
                       t.eval_batch_size, self.score, step,
                       Path(t.export_path or run_dir) / "dumped_evals" if t.dump_eval_results and rank0 else None)
        return {**out, "timing/eval_s": time.perf_counter() - t0} if rank0 else {}

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()
        if self.handoff is not None:  # after the engines: they map the segment until they end
            self.handoff.close()
        if not self.tensors and self.mesh.rank == 0:  # this run's own folder
            shutil.rmtree(self.sync_dir.parent, ignore_errors=True)


def release_cached_memory() -> None:
    """The trainer's cached CUDA blocks back to the driver, for colocated engines waking on the same GPUs."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_placement(cfg: TrainConfig, world_size: int, cuda: bool) -> Placement | None:
    """Where local engines and trainer ranks compute on the job's GPUs (:mod:`mlora.rollout.placement`;
    torchrun's ``LOCAL_WORLD_SIZE`` ranks per node); None on CPU and for Ray engines (Ray places them)."""
    e = cfg.generator.inference_engine
    if not cuda or not e.run_engines_locally:
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return plan_placement(world_size // local, torch.cuda.device_count(), local, e.num_engines,
                          e.tensor_parallel_size, cfg.trainer.placement.colocate_all)


def engine_max_model_len(cfg: TrainConfig, model_dir: str | os.PathLike) -> int:
    """The engines' context length: ``generator.engine_init_kwargs.max_model_len`` when given, else the
    run's longest prompt + longest response (training or evaluation sampling), capped by the model's
    own limit (:mod:`mlora.rollout.model_len`)."""
    from mlora.rollout.model_len import read_context_limit, run_max_model_len

    explicit = cfg.generator.engine_init_kwargs.get("max_model_len")
    if explicit is not None:
        return int(explicit)
    g = cfg.generator
    # the longest engine input: the prompt (single-turn) or a whole conversation so far (generator.max_input_length)
    return run_max_model_len(g.max_input_length or cfg.trainer.max_prompt_length, (g.sampling_params.max_generate_length,
                                                              g.eval_sampling_params.max_generate_length),
                             read_context_limit(model_dir))


def engine_options(cfg: TrainConfig, engine_base: str | os.PathLike, cuda: bool) -> dict:
    """The arguments of :func:`~mlora.rollout.vllm_engine.build_engines` for this run, after the model:
    the engine keys, ``generator.engine_init_kwargs`` (which win), the derived ``max_model_len``
    (:func:`engine_max_model_len`) and, for local engines on CPU, each engine's cores
    (:func:`mlora.rollout.cpu_threads.local_engine_cores`; None when the user's ``OMP_NUM_THREADS`` decides)."""
    from mlora.rollout.cpu_threads import local_engine_cores

    t, g, e = cfg.trainer, cfg.generator, cfg.generator.inference_engine
    extra = dict(g.engine_init_kwargs)
    if e.distributed_executor_backend is not None:
        extra.setdefault("distributed_executor_backend", e.distributed_executor_backend)
    # null: eager, mlora's engines as they were (no CUDA graphs on the CPU build, no capture time on GPUs)
    extra.setdefault("enforce_eager", True if e.enforce_eager is None else e.enforce_eager)
    if e.gpu_memory_utilization is not None and cuda:  # on the CPU build it would size the KV cache from host RAM
        extra.setdefault("gpu_memory_utilization", e.gpu_memory_utilization)
    extra["max_model_len"] = engine_max_model_len(cfg, engine_base)
    local_cpu = e.run_engines_locally and not cuda
    return dict(num_engines=e.num_engines, tensor_parallel_size=e.tensor_parallel_size,
                run_locally=e.run_engines_locally, ship_adapter=g.weight_sync == "memory",
                tensor_lora=g.weight_sync == "tensors", sleep_mode=cuda and t.placement.colocate_all,
                engine_cores=(local_engine_cores(e.num_engines, overlap=t.fully_async.enabled) if local_cpu
                              else None),
                max_lora_rank=t.policy.model.lora.rank, dtype=t.dtype, seed=t.seed,
                kv_cache_memory_bytes=g.kv_cache_memory_bytes, **extra)


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
    """PPO / GRPO / RLOO (``trainer.algorithm``) as a stage of :func:`mlora.train.loop.run`: the prompts,
    the shared base with the policy (and critic) adapters on it, the PPO engine, the learned reward if an
    environment needs one; the engines and the hand-off once opened."""

    def __init__(self, cfg: TrainConfig, mesh) -> None:
        from transformers import AutoTokenizer

        self.cfg, self.mesh = cfg, mesh
        t = cfg.trainer
        self.placement = engine_placement(cfg, mesh.world_size, torch.cuda.is_available())  # before anything loads
        if self.placement is not None and mesh.rank == 0:
            log.info(self.placement.table())
        tokenizer = self.tokenizer = AutoTokenizer.from_pretrained(str(t.policy.model.path))
        self.pad_id = tokenizer.pad_token_id or 0
        self.train, self.val = _load_data(cfg, tokenizer)
        self.n_examples, self.evaluates = len(self.train), bool(self.val)
        self.total_steps = loop.total_steps(cfg, self.n_examples)
        self.model, reference = loop.load_model(cfg, mesh)
        self.engine = ActorCriticEngine(self.model, ppo_config(cfg, self.total_steps), policy=POLICY, critic=CRITIC,
                                        reference_adapters=reference,
                                        policy_lora=lora_config(t.policy.model.lora, t.seed),
                                        critic_lora=lora_config(t.critic.model.lora, t.seed))
        # the reward adapter + head, frozen on this same base (env_class=reward_model; mlora.train.learned_reward)
        self.learned = build_learned_reward(cfg, self.model, self.engine, {p.env_class for p in self.train + self.val},
                                            run_frozen=FROZEN if reference else None)
        self.rollouts: Rollouts | None = None
        self.run_dir: Path | None = None
        # asynchronous training: the batches queued on the engines ahead of the update, by the step they are for
        self.ahead = async_batches_ahead(cfg) if t.fully_async.enabled else 0
        self.queued: dict[int, QueuedBatch] = {}
        self.schedule: dict[int, list[int]] = {}

    def open(self, run_dir: Path) -> None:
        """The engines, serving the initial policy adapter (or the resumed one)."""
        self.run_dir = run_dir
        self.rollouts = Rollouts(self.cfg, self.mesh, run_dir, POLICY, self.placement, tokenizer=self.tokenizer)
        self.rollouts.sync(self.model, self.engine.global_step)

    def _sampling(self, step: int) -> SamplingConfig:
        g, t = self.cfg.generator, self.cfg.trainer
        # rollouts of step s sample with seed + 1000·s (+ the prompt's index): no RNG to carry
        return sampling_config(g.sampling_params, g.n_samples_per_prompt, t.seed + step * 1000)

    def _queue_ahead(self, step: int, picked: list[int]) -> None:
        """Asynchronous training: queue the generation of batches ``step .. step + ahead`` not queued yet, on the
        adapter the engines have now (the hand-off of policy version ``step - 1``). The prompts of a later step
        are the ones the run loop will pass then (:func:`~mlora.rollout.data.epoch_batches` is deterministic)."""
        if not self.schedule:  # the first step of this launch (a resumed run starts after its checkpoint)
            t = self.cfg.trainer
            self.schedule = {s: p for _, s, p in epoch_batches(self.n_examples, t.train_batch_size, t.seed,
                                                               self.total_steps, step - 1)}
            if step > 1 and self.mesh.rank == 0:
                n = self.ahead * t.train_batch_size * self.cfg.generator.n_samples_per_prompt
                log.info("trainer.fully_async: resumed at step %d; the samples the stopped run had generated ahead "
                         "(up to %d: %d batches) are not in the checkpoint and are discarded: steps %d.. are "
                         "generated again from the resumed policy, none is used twice", step - 1, n, self.ahead,
                         step)
        if self.schedule[step] != picked:
            raise RuntimeError(f"asynchronous training: step {step}'s prompts differ from the queued schedule")
        for s in range(step, min(step + self.ahead, self.total_steps) + 1):
            if s not in self.queued and s in self.schedule:
                self.queued[s] = self.rollouts.submit([self.train[i] for i in self.schedule[s]], self._sampling(s))

    def step(self, step: int, picked: list[int]) -> dict[str, float]:
        """Rollouts -> rewards -> (colocated engines sleep) -> shared-base update -> (the trainer frees its
        cached blocks, the engines wake) -> hand-off.

        Asynchronous training (``trainer.fully_async``): the rollouts are a batch queued up to ``ahead`` steps
        earlier, sampled by the adapter of that time; the next batches generate while this one trains."""
        if self.ahead:
            self._queue_ahead(step, picked)
            t0 = time.perf_counter()
            batch, metrics = self.rollouts.collect_queued(self.queued.pop(step), self.pad_id)
            metrics["timing/rollout_wait_s"] = time.perf_counter() - t0  # what the trainer waited for generation
            version, trained = self.rollouts.last_version, self.engine.global_step
            metrics.update({"async/generation_version": version, "async/trainer_version": trained,
                            "async/staleness": trained - version, "async/engine_version": self.rollouts.version,
                            "async/queued_batches": len(self.queued)})
        else:
            batch, metrics = self.rollouts.collect([self.train[i] for i in picked], self._sampling(step), self.pad_id)
        if self.learned is not None:  # the model-based part of the reward, on the trainer
            metrics.update(self.learned.apply(batch, self.rollouts.last_rows))
        metrics.update(dapo_shaping(self.cfg, batch, [reason for _, reason in self.rollouts.last_rows]))
        self._dump_batch(step, batch)
        t0 = time.perf_counter()
        metrics.update(self.engine.step(batch))
        metrics["timing/train_s"] = time.perf_counter() - t0
        self._export_adapter(step)
        if self.rollouts.asleep:  # the engines wake into the memory the step held
            release_cached_memory()
        metrics.update(self.rollouts.sync(self.model, self.engine.global_step))
        return metrics

    def _dump_batch(self, step: int, batch: RolloutBatch) -> None:
        """``trainer.dump_data_batch``: the batch the update trains on, under ``trainer.export_path`` (unset:
        the run directory), as SkyRL; rank 0."""
        t = self.cfg.trainer
        if t.dump_data_batch and self.mesh.rank == 0:
            dump_batch(batch, Path(t.export_path or self.run_dir) / "dumped_data" /
                       f"global_step_{step}_training_input.pt")

    def _export_adapter(self, step: int) -> None:
        """``trainer.hf_save_interval``: the policy adapter (PEFT) in ``<export_path>/global_step_<k>/policy``,
        SkyRL's layout (collective)."""
        t = self.cfg.trainer
        if hf_save_due(step, t.hf_save_interval, self.total_steps, self.n_examples // t.train_batch_size):
            self.model.save_adapter(POLICY, Path(t.export_path or self.run_dir) / f"global_step_{step}" / POLICY)

    def evaluate(self, step: int) -> dict[str, float]:
        return self.rollouts.evaluate(self.val, step, self.run_dir)

    def step_line(self, step: int, metrics: dict[str, float]) -> str:
        return step_line(step, metrics)

    def eval_line(self, metrics: dict[str, float]) -> str:
        return "  ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/"))

    def postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{metrics['reward/mean']:.3f}"}

    def finish(self, run_dir: Path) -> Path:
        """The policy adapter in PEFT format, the plot, and how to serve it."""
        final = run_dir / "final_adapter"
        self.model.save_adapter(POLICY, final)
        if self.mesh.rank == 0:
            _report(self.cfg, run_dir, final, self.rollouts.engine_base)
        return final

    def close(self) -> None:
        if self.rollouts is not None:
            self.rollouts.close()


def run_rl(cfg: TrainConfig, notes: Sequence[str] = (), build_assets: Callable[[str], object] | None = None) -> dict:
    """Train PPO / GRPO / RLOO; returns the last step's metrics (on every rank). See :func:`mlora.train.loop.run`."""
    return loop.run(cfg, RLStage, notes, build_assets)


def _report(cfg: TrainConfig, run_dir: Path, final: Path, engine_base) -> None:
    from mlora.rollout.serve import format_command, serve_command
    from mlora.train.plot import plot_metrics

    t = cfg.trainer
    png = plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png")
    frozen = t.policy.model.frozen_adapter_path
    argv = serve_command(engine_base, {POLICY: final.resolve()}, max_lora_rank=t.policy.model.lora.rank,
                         dtype=t.dtype, kv_cache_memory_bytes=cfg.generator.kv_cache_memory_bytes,
                         max_model_len=engine_max_model_len(cfg, engine_base))
    log.info("\nmetrics: %s\nplot: %s\nfinal adapter (PEFT): %s\n%sserve it with vLLM (OpenAI API):\n  %s",
             run_dir / "metrics.jsonl", png, final,
             f"(it applies on top of {frozen}, merged into the base in {engine_base})\n" if frozen else "",
             format_command(argv))

