"""Check a composed :class:`~mlora.config.schema.TrainConfig`, merge SkyRL's key aliases, and list
the keys that have no effect here.

Hydra already refuses unknown keys and wrong types (the schema is structured). What remains is
what a type cannot say: values with a meaning only in SkyRL's FSDP world, counts that must agree
with the torchrun world, aliases given twice with different values.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from dataclasses import fields
from pathlib import Path
from typing import Any, Iterable

from mlora.checkpoint.dirs import RESUME_MODES
from mlora.config.dtypes import engine_dtype, trainer_dtype
from mlora.config.errors import ConfigError
from mlora.config.schema import TrainConfig
from mlora.rl.advantages import ADVANTAGE_ESTIMATORS
from mlora.rl.kl import KL_CONTROLLERS, KL_ESTIMATORS
from mlora.rl.lr_schedule import LR_SCHEDULES
from mlora.rl.policy_losses import POLICY_LOSSES, PolicyLossParams, ratio_to_rollout
from mlora.rl.preference import DPO_LOSS_TYPES, PREFERENCE_STAGES
from mlora.rl.sampling_filters import DYNAMIC_SAMPLING_TYPES
from mlora.rollout.multi_turn import TURN_REWARDS

STRATEGIES = ("megatron", "fsdp", "fsdp2")
DATA_PARALLEL_STRATEGIES = ("fsdp", "fsdp2")  # SkyRL's: run as a TP1 x PP1 megatron-core mesh (DP = world)
REFUSED_STRATEGIES = ("deepspeed",)
LOSS_REDUCTIONS = {"token_mean": "token-mean", "sequence_mean": "seq-mean-token-mean",
                   "seq_mean_token_sum_norm": "seq-mean-token-sum-norm", "token_mean_legacy": "token-mean-legacy",
                   "prompt_mean": "prompt-mean"}
WEIGHT_SYNC = ("disk", "memory", "tensors")
# trainer.logger -> the package its backend needs (installed by the extra ``mlora[logging]``)
LOGGER_PACKAGES = {"console": None, "wandb": "wandb", "tensorboard": "tensorboard"}
LOGGERS = tuple(LOGGER_PACKAGES)
BACKENDS = ("vllm",)

_FILE_HANDOFF = ("mlora hands the adapter to the engines as PEFT files (generator.weight_sync=disk|memory) or as "
                 "tensors in shared memory (tensors), not by NCCL broadcast")
_TEXT_ONLY = ("mlora loads text-only decoder checkpoints (config.json of a causal LM): the language model is all there "
              "is to train and serve")
# Keys SkyRL users pass that change nothing here; each is harmless to ignore (memory or
# throughput knobs of SkyRL's own stack), and the run says so once when one is set.
NO_EFFECT = {
    "generator.async_engine": "mlora's engines batch every generate call; sync or async gives the same samples",
    "generator.batched": "mlora always generates a step's prompts in one batched call per engine",
    "generator.inference_engine.weight_sync_backend": _FILE_HANDOFF,
    "generator.weight_sync_backend": _FILE_HANDOFF,
    "trainer.gradient_checkpointing_use_reentrant": "megatron's activation recompute (trainer.recompute) has one "
                                                    "checkpoint of its own (reentrant, restoring megatron's RNG "
                                                    "states); gradients are the same either way",
    "trainer.policy.optimizer_config.offload_after_step": "adapter optimizer state is small and stays on device",
    "trainer.critic.optimizer_config.offload_after_step": "adapter optimizer state is small and stays on device",
    "trainer.placement.colocate_policy_ref": "policy and reference are always one model here (the base, adapters "
                                             "on or off)",
    "generator.sampling_params.logprobs": "the trainer always takes the sampled token's log-prob",
    "generator.eval_sampling_params.logprobs": "evaluation needs no log-probs",
    "trainer.policy.language_model_only": _TEXT_ONLY,
    "generator.inference_engine.language_model_only": _TEXT_ONLY,
    "trainer.policy.fsdp_config.reshard_after_forward": "trainer.strategy=fsdp|fsdp2 runs as a data-parallel "
                                                        "megatron-core mesh: the frozen base is replicated, there are "
                                                        "no parameter shards to gather or reshard",
    "trainer.algorithm.value_head_prefix": "the critic's value head lives in mlora's checkpoints under the critic "
                                           "adapter's name (SkyRL's prefix names an attribute of its HF critic model)",
    "trainer.log_path": "mlora has no separate infrastructure log: every rank logs to stdout/stderr, and metrics, "
                        "plots and dumps go to trainer.run_dir (exports to trainer.export_path)",
}
_CPU_KV_CACHE = ("on the CPU build vLLM would take that fraction of the host's RAM for its KV cache, next to the "
                 "trainer ranks' memory; there the KV cache is generator.kv_cache_memory_bytes (null: vLLM's "
                 "VLLM_CPU_KVCACHE_SPACE default)")
CPU_ONLY_NO_EFFECT = {
    "trainer.placement.colocate_all": "no GPUs here: engines run as CPU processes beside the trainer ranks",
    "generator.gpu_memory_utilization": _CPU_KV_CACHE,
    "generator.inference_engine.gpu_memory_utilization": _CPU_KV_CACHE,
}


# folder names joined by '/' (SkyRL's run names embed model ids such as Qwen/Qwen3-0.6B), each starting with a
# letter or digit: no absolute path, no '.' or '..' component
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]*(/[A-Za-z0-9][A-Za-z0-9._+=-]*)*")


def _get(cfg: Any, path: str) -> Any:
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _merge_alias(section: Any, name: str, alias_section: Any, alias: str, default: Any, where: str,
                 alias_where: str) -> None:
    """``section.name`` takes the alias's value when only the alias is set; both set differently: error."""
    value, other = getattr(section, name), getattr(alias_section, alias)
    if value is not None and other is not None and value != other:
        raise ConfigError(f"{where}={value!r} and its alias {alias_where}={other!r} disagree; set one of them")
    resolved = value if value is not None else other if other is not None else default
    setattr(section, name, resolved)
    setattr(alias_section, alias, resolved)


def _check_choice(value: Any, valid: Iterable, key: str) -> None:
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not valid; valid: {', '.join(map(str, valid))}")


def _check_positive(cfg: Any, prefix: str, names: Iterable[str]) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise ConfigError(f"{prefix}.{name}={value} must be >= 1")


def _check_packing(t: Any, multi_turn: bool) -> None:
    """``trainer.use_sample_packing`` (merged with its alias ``remove_microbatch_padding``; unset: on for
    multi-turn rollouts, whose lengths are long and uneven, off otherwise) and its token budget."""
    _merge_alias(t, "use_sample_packing", t, "remove_microbatch_padding", multi_turn, "trainer.use_sample_packing",
                 "trainer.remove_microbatch_padding")
    budget = t.max_tokens_per_microbatch
    if budget == 0 or budget < -1:
        raise ConfigError(f"trainer.max_tokens_per_microbatch={budget} is not valid; valid: -1 (the padded "
                          "micro-batch's tokens) or a token budget >= 1")
    if budget > 0 and not t.use_sample_packing:
        raise ConfigError(f"trainer.max_tokens_per_microbatch={budget} sizes packed micro-batches: set "
                          "trainer.use_sample_packing=true too, or -1 for micro-batches of sequence counts")
    if not t.use_sample_packing:
        return
    if not t.flash_attn and t.fp8 != "te":
        raise ConfigError("trainer.use_sample_packing=true needs the fused core attention (trainer.flash_attn=true): "
                          "megatron's unfused attention (trainer.flash_attn=false) takes no packed sequences")
    if t.algorithm.loss_reduction == "token_mean_legacy":
        raise ConfigError("trainer.algorithm.loss_reduction=token_mean_legacy averages per micro-batch, which "
                          "trainer.use_sample_packing=true regroups; choose one of "
                          + ", ".join(k for k in LOSS_REDUCTIONS if k != "token_mean_legacy") + " or turn packing off")


def _resolve_generator(cfg: TrainConfig) -> None:
    g, e = cfg.generator, cfg.generator.inference_engine
    pairs = (("num_engines", "num_inference_engines", 1), ("tensor_parallel_size",
             "inference_engine_tensor_parallel_size", 1), ("backend", "backend", "vllm"),
             ("run_engines_locally", "run_engines_locally", True), ("weight_sync_backend", "weight_sync_backend",
             "nccl"), ("gpu_memory_utilization", "gpu_memory_utilization", None))
    for name, alias, default in pairs:
        _merge_alias(e, name, g, alias, default, f"generator.inference_engine.{name}", f"generator.{alias}")
    if e.engine_init_kwargs:  # SkyRL's current place of generator.engine_init_kwargs
        if g.engine_init_kwargs and dict(g.engine_init_kwargs) != dict(e.engine_init_kwargs):
            raise ConfigError(f"generator.inference_engine.engine_init_kwargs={dict(e.engine_init_kwargs)!r} and its "
                              f"alias generator.engine_init_kwargs={dict(g.engine_init_kwargs)!r} disagree; set one "
                              "of them")
        g.engine_init_kwargs = dict(e.engine_init_kwargs)
    e.engine_init_kwargs = g.engine_init_kwargs
    _check_choice(e.backend, BACKENDS, "generator.inference_engine.backend")
    _check_positive(e, "generator.inference_engine", ("num_engines", "tensor_parallel_size"))
    if e.gpu_memory_utilization is not None and not 0 < e.gpu_memory_utilization <= 1:
        raise ConfigError(f"generator.inference_engine.gpu_memory_utilization={e.gpu_memory_utilization} must be "
                          "in (0, 1]")
    _check_choice(g.weight_sync, WEIGHT_SYNC, "generator.weight_sync")
    _check_positive(g, "generator", ("n_samples_per_prompt", "eval_n_samples_per_prompt"))
    for key, s in (("sampling_params", g.sampling_params), ("eval_sampling_params", g.eval_sampling_params)):
        if s.max_generate_length is None:
            s.max_generate_length = g.sampling_params.max_generate_length
        if s.max_generate_length is None or s.max_generate_length < 1:
            raise ConfigError(f"generator.{key}.max_generate_length={s.max_generate_length} must be >= 1")
        if s.repetition_penalty != 1.0:
            raise ConfigError(f"generator.{key}.repetition_penalty={s.repetition_penalty}: only 1.0 is supported "
                              "(the trainer's log-probs could not reproduce a penalty that depends on the history)")
        if s.temperature < 0 or (key == "sampling_params" and s.temperature == 0):
            raise ConfigError(f"generator.{key}.temperature={s.temperature} must be > 0"
                              + (" for training rollouts (0 is greedy: there is no policy to improve)"
                                 if key == "sampling_params" else " or 0 (greedy)"))
        if not 0 < s.top_p <= 1:
            raise ConfigError(f"generator.{key}.top_p={s.top_p} must be in (0, 1]")


def _resolve_mesh(cfg: TrainConfig, world_size: int) -> None:
    from mlora.formats.hf_config import is_moe_checkpoint

    t = cfg.trainer
    pm, rm = t.policy.megatron_config, t.ref.megatron_config
    base_config = Path(str(t.policy.model.path)).expanduser() / "config.json"
    for role in ("policy", "critic"):  # (a base built at start, e.g. the demo's: add_adapter says it)
        section = getattr(t, role).model.lora
        if section.expert_rank is not None and base_config.is_file() and not is_moe_checkpoint(t.policy.model.path):
            raise ConfigError(f"trainer.{role}.model.lora.expert_rank={section.expert_rank} on "
                              f"{t.policy.model.path}, which has no experts: leave it null")
    if pm.sequence_parallel is None and (pm.tensor_model_parallel_size or 1) > 1 and is_moe_checkpoint(t.policy.model.path):
        # megatron's MoE layer needs sequence parallelism at TP > 1 in training; SkyRL has it on at any TP > 1
        pm.sequence_parallel = True
    defaults = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
                "sequence_parallel": False, "expert_model_parallel_size": 1}
    for name, default in defaults.items():
        if getattr(pm, name) is None:
            setattr(pm, name, default)
        if getattr(rm, name) is None:
            setattr(rm, name, getattr(pm, name))
        elif getattr(rm, name) != getattr(pm, name):
            raise ConfigError(f"trainer.ref.megatron_config.{name}={getattr(rm, name)!r} differs from "
                              f"trainer.policy.megatron_config.{name}={getattr(pm, name)!r}: the reference is the "
                              "policy's own base with the adapters off, so it lives on the same mesh")
    _check_positive(pm, "trainer.policy.megatron_config", ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                           "context_parallel_size", "expert_model_parallel_size"))
    if t.strategy in DATA_PARALLEL_STRATEGIES and (pm.tensor_model_parallel_size, pm.pipeline_model_parallel_size,
                                                   pm.sequence_parallel) != (1, 1, False):
        raise ConfigError(f"trainer.strategy={t.strategy} runs as a data-parallel mesh (TP1 x PP1 x DP=world), but "
                          f"trainer.policy.megatron_config sets tensor_model_parallel_size="
                          f"{pm.tensor_model_parallel_size}, pipeline_model_parallel_size="
                          f"{pm.pipeline_model_parallel_size}, sequence_parallel={pm.sequence_parallel}: for a "
                          "model-parallel mesh use trainer.strategy=megatron")
    if pm.context_parallel_size != 1:
        raise ConfigError(f"trainer.policy.megatron_config.context_parallel_size={pm.context_parallel_size}: "
                          "context parallelism is not supported yet; valid: 1")
    model_size = pm.tensor_model_parallel_size * pm.pipeline_model_parallel_size
    if world_size % model_size:
        raise ConfigError(f"world size {world_size} is not divisible by tensor_model_parallel_size x "
                          f"pipeline_model_parallel_size = {model_size}")
    roles = [("policy", True), ("ref", True), ("critic", t.algorithm.advantage_estimator == "gae")]
    for role, used in roles:
        nodes = getattr(t.placement, f"{role}_num_nodes")
        gpus = getattr(t.placement, f"{role}_num_gpus_per_node")
        if not used or (nodes is None and gpus is None):
            continue
        total = (nodes or 1) * (gpus or 1)
        if total != world_size:
            raise ConfigError(
                f"trainer.placement.{role}_num_nodes x {role}_num_gpus_per_node = {nodes or 1} x {gpus or 1} = "
                f"{total}, but torchrun started {world_size} ranks. mlora runs policy, critic and reference on one "
                f"shared base on every rank: launch {total} ranks (torchrun --nnodes {nodes or 1} "
                f"--nproc_per_node {gpus or 1}) or set the counts to the world size")


def _check_placement(cfg: TrainConfig, world_size: int, gpus_per_node: int | None, ranks_per_node: int) -> None:
    """On GPUs, local engines must have a placement (:func:`mlora.rollout.placement.plan_placement`): SkyRL's
    colocate_all rule (the engines use exactly the trainer's GPUs) or the GPUs the trainer leaves free."""
    from mlora.rollout.placement import PlacementError, plan_placement

    e = cfg.generator.inference_engine
    if gpus_per_node is None or not e.run_engines_locally:
        return
    try:
        plan_placement(world_size // ranks_per_node, gpus_per_node, ranks_per_node, e.num_engines,
                       e.tensor_parallel_size, cfg.trainer.placement.colocate_all)
    except PlacementError as exc:
        raise ConfigError(str(exc)) from None


def _check_trainer(cfg: TrainConfig) -> None:
    t, a = cfg.trainer, cfg.trainer.algorithm
    if t.strategy in REFUSED_STRATEGIES:
        raise ConfigError(f"trainer.strategy={t.strategy!r}: mlora is built on megatron-core (LoRA inside megatron's "
                          "tensor/pipeline-parallel linears, one frozen base for actor, critic and reference); there "
                          "is no DeepSpeed path. Use trainer.strategy=megatron and set the mesh with trainer.policy."
                          "megatron_config.tensor_model_parallel_size / pipeline_model_parallel_size, or "
                          "trainer.strategy=fsdp2 for a data-parallel run")
    _check_choice(t.strategy, STRATEGIES, "trainer.strategy")
    _check_positive(t, "trainer", ("epochs", "total_steps", "train_batch_size", "policy_mini_batch_size",
                                   "critic_mini_batch_size", "micro_forward_batch_size_per_gpu",
                                   "micro_train_batch_size_per_gpu", "update_epochs_per_batch", "max_prompt_length",
                                   "eval_batch_size", "cpu_threads"))
    for key in ("policy_mini_batch_size", "critic_mini_batch_size"):
        mini = getattr(t, key)
        if mini is not None and t.train_batch_size % mini:
            raise ConfigError(f"trainer.train_batch_size={t.train_batch_size} is not divisible by trainer.{key}={mini}")
    if not RUN_NAME.fullmatch(t.run_name) or t.run_name in (".", ".."):
        raise ConfigError(f"trainer.run_name={t.run_name!r}: a run name names folders (the run directory, the adapter "
                          "sync folder), so it may hold letters, digits and . _ + = - only, in parts joined by '/' "
                          "that each start with a letter or digit (no absolute path, no '.' or '..' part)")
    _check_resume(t)
    _check_choice(t.logger, LOGGERS, "trainer.logger")
    package = LOGGER_PACKAGES[t.logger]
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(f"trainer.logger={t.logger} needs the {package} package, which is not installed: "
                          "pip install 'mlora[logging]' (wandb and TensorBoard), or trainer.logger=console")
    _check_choice(t.dtype, ("float32", "bfloat16", "float16"), "trainer.dtype")
    _check_choice(t.lora_compute_dtype, (None, "float32", t.dtype), "trainer.lora_compute_dtype")
    _check_choice(t.fp8, (None, "torch", "te"), "trainer.fp8")
    _check_choice(t.fp8_recipe, ("delayed", "current", "mxfp8"), "trainer.fp8_recipe")
    if not t.flash_attn and t.fp8 == "te":
        raise ConfigError("trainer.flash_attn=false selects megatron's unfused core attention of the local spec; "
                          "trainer.fp8=te uses Transformer Engine's own core attention: drop one of them")
    if t.fp8_recipe != "delayed" and t.fp8 != "te":
        raise ConfigError(f"trainer.fp8_recipe={t.fp8_recipe!r} applies to trainer.fp8=te only (trainer.fp8="
                          f"{t.fp8!r})")
    _check_packing(t, cfg.generator.max_turns > 1)
    _check_choice(a.advantage_estimator, ADVANTAGE_ESTIMATORS, "trainer.algorithm.advantage_estimator")
    _check_choice(a.loss_reduction, tuple(LOSS_REDUCTIONS), "trainer.algorithm.loss_reduction")
    _check_choice(a.policy_loss_type, tuple(POLICY_LOSSES), "trainer.algorithm.policy_loss_type")
    _check_choice(a.kl_estimator_type, KL_ESTIMATORS, "trainer.algorithm.kl_estimator_type")
    _check_choice(a.kl_ctrl.type, KL_CONTROLLERS, "trainer.algorithm.kl_ctrl.type")
    if a.loss_reduction == "seq_mean_token_sum_norm" and a.max_seq_len is None:
        a.max_seq_len = t.max_prompt_length + cfg.generator.sampling_params.max_generate_length
    for role in ("policy", "critic"):
        opt = getattr(t, role).optimizer_config
        _check_choice(opt.scheduler, LR_SCHEDULES, f"trainer.{role}.optimizer_config.scheduler")
        if len(opt.adam_betas) != 2:
            raise ConfigError(f"trainer.{role}.optimizer_config.adam_betas={list(opt.adam_betas)} must be two numbers")
    policy_path = t.policy.model.path
    for role, section in (("critic", t.critic.model), ("ref", t.ref.model)):
        if section.path is None:
            section.path = policy_path
        elif str(section.path) != str(policy_path):
            raise ConfigError(f"trainer.{role}.model.path={section.path!r} differs from trainer.policy.model.path="
                              f"{policy_path!r}: mlora shares one frozen base between policy, critic and reference "
                              "(set both to the same model)")


# SkyRL keys mlora does not implement: refused by name, with why (key -> (value that is off, reason))
NOT_IMPLEMENTED = {
    "generator.step_wise_trajectories": (False, "each turn of a trajectory as a training sample of its own is not "
                                                "implemented: mlora trains a trajectory as one sequence, the "
                                                "environment's tokens masked out of the loss"),
    "generator.merge_stepwise_output": (False, "it merges step_wise_trajectories' samples, which mlora does not "
                                               "make (each trajectory is one sequence already)"),
    "trainer.update_ref_every_epoch": (False, "the reference is the shared base with the RL adapters off (plus a "
                                              "frozen stacked adapter); moving it to the policy at each epoch would "
                                              "need a frozen copy of the policy adapter, which is not implemented"),
    "trainer.fully_async.sample_full_batch": (False, "asynchronous training does not drop zero-variance groups yet; "
                                                     "use trainer.algorithm.zero_variance_filter (their loss masked)"),
}


def loss_settings(a) -> PolicyLossParams:
    """``trainer.algorithm``'s policy-loss settings (clip_ratio_c and the sapo, cispo, dppo, clip_cov, kl_cov
    sections) as :class:`~mlora.rl.policy_losses.PolicyLossParams` (PPO's clip range is the PPOConfig's)."""
    return PolicyLossParams(
        eps_clip_low=a.eps_clip_low, eps_clip_high=a.eps_clip_high, clip_ratio_c=a.clip_ratio_c,
        tau_pos=a.sapo.tau_pos, tau_neg=a.sapo.tau_neg, cispo_eps_clip_low=a.cispo.cispo_eps_clip_low,
        cispo_eps_clip_high=a.cispo.cispo_eps_clip_high, cispo_anchor=a.cispo.cispo_anchor,
        dppo_type=a.dppo.dppo_type, delta_low=a.dppo.delta_low, delta_high=a.dppo.delta_high,
        clip_cov_ratio=a.clip_cov.clip_ratio, clip_cov_lb=a.clip_cov.clip_cov_lb, clip_cov_ub=a.clip_cov.clip_cov_ub, kl_cov_frac=a.kl_cov.kl_cov_frac, ppo_kl_coef=a.kl_cov.ppo_kl_coef)


def _check_algorithm(cfg: TrainConfig) -> list[str]:
    """The algorithm keys a type cannot check: SkyRL's policy-loss sections, KL placement, the signal filters,
    the trainer's temperature, and the SkyRL keys mlora refuses (:data:`NOT_IMPLEMENTED`). Returns notes."""
    a, g, notes = cfg.trainer.algorithm, cfg.generator, []
    for key, (off, why) in NOT_IMPLEMENTED.items():
        if _get(cfg, key) != off:
            raise ConfigError(f"{key}={_get(cfg, key)!r}: {why}; valid: {off!r}")
    if a.use_kl_in_reward and a.use_kl_loss:
        raise ConfigError("trainer.algorithm.use_kl_in_reward=true and trainer.algorithm.use_kl_loss=true: the KL "
                          "penalty goes in the reward or in the loss, not both (SkyRL: mutually exclusive); set "
                          "trainer.algorithm.use_kl_loss=false")
    try:
        loss_settings(a)
    except ValueError as exc:
        raise ConfigError(f"trainer.algorithm.{exc}") from None
    if a.value_clip is not None and not a.value_clip > 0:
        raise ConfigError(f"trainer.algorithm.value_clip={a.value_clip} must be > 0 (or null: unclipped)")
    if a.temperature is not None and not a.temperature > 0:
        raise ConfigError(f"trainer.algorithm.temperature={a.temperature} must be > 0 (or null: "
                          "generator.sampling_params.temperature)")
    if a.temperature is not None and a.temperature != g.sampling_params.temperature:
        notes.append(f"trainer.algorithm.temperature={a.temperature} differs from generator.sampling_params."
                     f"temperature={g.sampling_params.temperature}: the trainer's log-probs are of softmax(logits / "
                     f"{a.temperature}), not of the distribution the engines sampled from")
    from mlora.rollout.chat_template import resolve_chat_template

    try:
        resolve_chat_template(g.chat_template.source, g.chat_template.name_or_path)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not a.zero_variance_filter_tol >= 0:
        raise ConfigError(f"trainer.algorithm.zero_variance_filter_tol={a.zero_variance_filter_tol} must be >= 0")
    ds = a.dynamic_sampling
    if ds.type is not None:
        _check_choice(ds.type, DYNAMIC_SAMPLING_TYPES, "trainer.algorithm.dynamic_sampling.type")
        if cfg.trainer.fully_async.enabled:
            raise ConfigError(f"trainer.algorithm.dynamic_sampling.type={ds.type} with trainer.fully_async.enabled="
                              "true: SkyRL's asynchronous trainer has no dynamic sampling; use trainer.algorithm."
                              "zero_variance_filter")
        if ds.max_sample_batches == 0 or ds.max_sample_batches < -1:
            raise ConfigError(f"trainer.algorithm.dynamic_sampling.max_sample_batches={ds.max_sample_batches} must "
                              "be >= 1 (or -1: no limit)")
        if not 0.0 <= ds.min_replace_ratio <= 1.0:
            raise ConfigError(f"trainer.algorithm.dynamic_sampling.min_replace_ratio={ds.min_replace_ratio} must be "
                              "in [0, 1]")
    if a.gae_skip_observations and a.advantage_estimator != "gae":
        raise ConfigError(f"trainer.algorithm.gae_skip_observations=true applies to advantage_estimator=gae, not "
                          f"{a.advantage_estimator!r}")
    if a.advantage_estimator != "gae" and cfg.generator.n_samples_per_prompt == 1 and a.advantage_estimator in (
            "grpo", "rloo", "maxrl"):
        notes.append(f"trainer.algorithm.advantage_estimator={a.advantage_estimator} with generator."
                     "n_samples_per_prompt=1: every group has one sample (SkyRL's rule: grpo and maxrl give each its "
                     "reward, rloo gives 0)")
    return notes


def _check_off_policy(cfg: TrainConfig) -> list[str]:
    """SkyRL's older ``use_tis``/``tis_imp_ratio_cap`` into ``off_policy_correction`` (as SkyRL does), then the
    correction's values. Returns the note of the rename."""
    from mlora.rl.rollout_correction import OffPolicyCorrection

    a = cfg.trainer.algorithm
    o, notes = a.off_policy_correction, []
    if a.use_tis:
        if not a.tis_imp_ratio_cap > 0:
            raise ConfigError(f"trainer.algorithm.use_tis=true needs trainer.algorithm.tis_imp_ratio_cap > 0 (the TIS "
                              f"cap C of min(π_old/μ, C)), got {a.tis_imp_ratio_cap}")
        if o.tis_ratio_type not in (None, "token"):
            raise ConfigError(f"trainer.algorithm.use_tis=true (token TIS) contradicts trainer.algorithm."
                              f"off_policy_correction.tis_ratio_type={o.tis_ratio_type!r}; set one of them")
        o.tis_ratio_type, o.token_tis_ratio_clip_high = "token", a.tis_imp_ratio_cap
        notes.append(f"trainer.algorithm.use_tis=true is SkyRL's older name: it runs as trainer.algorithm."
                     f"off_policy_correction.tis_ratio_type=token with token_tis_ratio_clip_high={a.tis_imp_ratio_cap}")
    elif a.tis_imp_ratio_cap != -1.0:
        raise ConfigError(f"trainer.algorithm.tis_imp_ratio_cap={a.tis_imp_ratio_cap} applies with "
                          "trainer.algorithm.use_tis=true only (or use off_policy_correction.token_tis_ratio_clip_high)")
    try:
        correction = OffPolicyCorrection(**vars(o))
    except ValueError as exc:
        raise ConfigError(f"trainer.algorithm.{exc}") from None
    if a.policy_loss_type == "cispo" and a.cispo.cispo_anchor == "rollout" and correction.tis_ratio_type is not None:
        raise ConfigError(f"trainer.algorithm.cispo.cispo_anchor=rollout with trainer.algorithm.off_policy_correction."
                          f"tis_ratio_type={correction.tis_ratio_type}: the rollout-anchored ratio is the off-policy "
                          "correction already, TIS would count it twice (SkyRL's rule); set tis_ratio_type=null")
    if correction.enabled and not POLICY_LOSSES[a.policy_loss_type][1]:
        raise ConfigError(f"trainer.algorithm.policy_loss_type={a.policy_loss_type!r} takes no off-policy correction "
                          "(SkyRL applies none to it): turn trainer.algorithm.off_policy_correction off or choose one "
                          "of " + ", ".join(k for k, (_, takes) in POLICY_LOSSES.items() if takes))
    return notes


def _check_async(cfg: TrainConfig, cuda: bool) -> list[str]:
    """``trainer.fully_async``: bounds and what asynchronous generation needs (engines that keep running while
    the trainer updates). Returns notes."""
    f, t = cfg.trainer.fully_async, cfg.trainer
    defaults = TrainConfig().trainer.fully_async
    if not f.enabled:
        changed = [k for k in ("max_staleness_steps", "num_parallel_generation_workers",
                               "clear_kv_cache_on_weight_sync") if getattr(f, k) != getattr(defaults, k)]
        if changed:
            raise ConfigError(f"{', '.join('trainer.fully_async.' + k for k in changed)} set, but "
                              "trainer.fully_async.enabled=false: they apply to asynchronous training only")
        return []
    if cfg.preference.stage not in (None, "null", "none"):
        raise ConfigError(f"trainer.fully_async.enabled=true applies to the RL loop, not preference.stage="
                          f"{cfg.preference.stage}")
    if f.max_staleness_steps < 0:
        raise ConfigError(f"trainer.fully_async.max_staleness_steps={f.max_staleness_steps} must be >= 0 (0: each "
                          "step's groups generate after the previous update, the synchronous loop)")
    if t.policy_mini_batch_size != t.train_batch_size:
        raise ConfigError(f"trainer.fully_async.enabled=true needs trainer.policy_mini_batch_size="
                          f"{t.policy_mini_batch_size} equal to trainer.train_batch_size={t.train_batch_size} (SkyRL's "
                          "rule: each step trains the groups of one mini-batch, the unit the staleness bound counts)")
    if f.num_parallel_generation_workers < t.train_batch_size:
        raise ConfigError(f"trainer.fully_async.num_parallel_generation_workers={f.num_parallel_generation_workers} "
                          f"must be >= trainer.train_batch_size={t.train_batch_size} (prompt groups of one training "
                          "batch generate together)")
    if cuda and t.placement.colocate_all:
        raise ConfigError("trainer.fully_async.enabled=true needs trainer.placement.colocate_all=false: the engines "
                          "generate the next batches while the trainer updates, so they cannot share its GPUs and "
                          "sleep")
    a = t.algorithm
    if not ratio_to_rollout(a.policy_loss_type, loss_settings(a)):
        raise ConfigError(f"trainer.algorithm.policy_loss_type={a.policy_loss_type} with trainer.fully_async.enabled="
                          "true: the loss's ratio is to π_old, the trainer's own log-probs at the step, but stale "
                          "samples came from older policies that are not kept (SkyRL's rule); use a loss against "
                          "the engine's log-probs: rollout_is, dppo, or cispo with cispo.cispo_anchor=rollout")
    in_flight = async_groups_in_flight(cfg)
    notes = [f"trainer.fully_async: up to {in_flight} prompt groups generate at once (num_parallel_generation_workers="
             f"{f.num_parallel_generation_workers}; SkyRL's capacity rule: (max_staleness_steps + step) x "
             f"{t.train_batch_size} groups admitted by step, max_staleness_steps={f.max_staleness_steps}): a batch "
             f"trained at step j was sampled by policy version >= j - 1 - {f.max_staleness_steps}"]
    if f.num_parallel_generation_workers > in_flight:
        notes.append(f"trainer.fully_async.num_parallel_generation_workers={f.num_parallel_generation_workers}: at "
                     f"most {in_flight} = train_batch_size x (max_staleness_steps + 1) groups can be in flight "
                     "(the staleness bound admits no more); SkyRL refuses more")
    return notes


def async_groups_in_flight(cfg: TrainConfig) -> int:
    """The most prompt groups generating at once in asynchronous training: the parallel generation workers, at
    most what the staleness bound admits beyond the step being trained (``train_batch_size x
    (max_staleness_steps + 1)``)."""
    f, b = cfg.trainer.fully_async, cfg.trainer.train_batch_size
    return min(f.num_parallel_generation_workers, b * (f.max_staleness_steps + 1))


def generates_while_training(cfg: TrainConfig) -> bool:
    """Whether engines generate while the trainer updates (asynchronous training with a staleness bound > 0;
    at 0 each step's groups wait for the previous update): then they and the trainer split a node's CPU cores."""
    f = cfg.trainer.fully_async
    return f.enabled and f.max_staleness_steps > 0


def _check_reward_model(cfg: TrainConfig) -> None:
    """``reward_model.*`` (a learned reward, mlora.train.learned_reward): the adapter directory is required
    and checked when ``environment.env_class=reward_model``; otherwise no key of the section may be set
    (it would do nothing). Rows whose own ``env_class`` column names reward_model need it too (checked
    when the data loads)."""
    import math

    from mlora.config.schema import RewardModelSection
    from mlora.rollout.envs import REWARD_MODEL_ENV, registered_envs

    r, default = cfg.reward_model, RewardModelSection()
    if cfg.environment.env_class != REWARD_MODEL_ENV:
        changed = [f"reward_model.{k}" for k in ("adapter_path", "model_weight", "rule_env", "rule_weight")
                   if getattr(r, k) != getattr(default, k)]
        if changed and not r.adapter_path:
            raise ConfigError(f"{', '.join(changed)} set, but environment.env_class={cfg.environment.env_class!r}: "
                              f"they apply to environment.env_class={REWARD_MODEL_ENV} only")
    for key in ("model_weight", "rule_weight"):
        if not math.isfinite(getattr(r, key)):
            raise ConfigError(f"reward_model.{key}={getattr(r, key)} must be a finite number")
    if r.rule_env is not None:
        rules = [n for n in registered_envs() if n != REWARD_MODEL_ENV]
        if r.rule_env not in rules:
            raise ConfigError(f"reward_model.rule_env={r.rule_env!r} is not a rule environment; valid: "
                              f"{', '.join(rules)}")
    elif r.rule_weight != default.rule_weight:
        raise ConfigError(f"reward_model.rule_weight={r.rule_weight} has no effect without reward_model.rule_env "
                          "(name the rule environment to weight)")
    if cfg.environment.env_class == REWARD_MODEL_ENV or r.adapter_path:
        if not r.adapter_path:
            raise ConfigError(f"environment.env_class={REWARD_MODEL_ENV} needs reward_model.adapter_path: a reward "
                              "adapter directory (LoRA + score head) written by mlora-train --config-name rm")
        from mlora.export.reward_adapter import read_reward_config, reward_base_adapter

        try:
            read_reward_config(Path(r.adapter_path).expanduser())
            reward_base_adapter(Path(r.adapter_path).expanduser())  # the frozen adapter it was trained on
        except (OSError, ValueError) as exc:
            raise ConfigError(f"reward_model.adapter_path={r.adapter_path!r}: {exc}") from None


# trainer.* keys of rollouts, PPO epochs and the critic, which the one-step-per-batch stages never read
RL_ONLY_TRAINER_KEYS = ("update_epochs_per_batch", "micro_forward_batch_size_per_gpu", "max_prompt_length",
                        "critic_mini_batch_size", "eval_batch_size", "dump_eval_results", "dump_data_batch")


def _check_preference(cfg: TrainConfig, world_size: int) -> None:
    """``preference.*`` (the SFT / reward-model / DPO stages). A key of another stage may not be set (it would
    do nothing); these stages take one optimizer step per batch, so ``trainer.policy_mini_batch_size`` is the
    batch (set to it, or an error when set to something else)."""
    from mlora.config.schema import PreferenceSection

    p, t, default = cfg.preference, cfg.trainer, PreferenceSection()
    if p.stage in (None, "null", "none"):
        p.stage = None
        changed = [f"preference.{k}" for k in ("beta", "label_smoothing", "loss_type", "margin", "max_length",
                                               "held_out_fraction") if getattr(p, k) != getattr(default, k)]
        if changed:
            raise ConfigError(f"{', '.join(changed)} set, but preference.stage is null (the RL loop): they apply to "
                              f"preference.stage={'|'.join(PREFERENCE_STAGES)} (mlora-train --config-name sft|rm|dpo)")
        return
    _check_choice(p.stage, PREFERENCE_STAGES, "preference.stage")
    fresh = TrainConfig()
    unused = sorted(_set_keys(cfg.generator, fresh.generator, set(), "generator.")
                    | _set_keys(cfg.environment, fresh.environment, set(), "environment.")
                    | _set_keys(cfg.trainer.algorithm, fresh.trainer.algorithm, set(), "trainer.algorithm.")
                    | _set_keys(cfg.trainer.critic, fresh.trainer.critic, set(), "trainer.critic.")
                    | _set_keys(cfg.reward_model, fresh.reward_model, set(), "reward_model.")
                    | {f"trainer.{k}" for k in RL_ONLY_TRAINER_KEYS if getattr(t, k) != getattr(fresh.trainer, k)})
    if unused:
        raise ConfigError(f"{', '.join(unused[:6])}{' ...' if len(unused) > 6 else ''} set, but preference.stage="
                          f"{p.stage} has no rollouts, environment, reward model, critic, PPO epochs or RL algorithm: these keys "
                          "apply to the RL loop only")
    if p.stage == "dpo":
        if not p.beta > 0:
            raise ConfigError(f"preference.beta={p.beta} must be > 0 (DPO's β scales the implicit reward "
                              "β·log π/π_ref; IPO's τ sets the target margin 1/(2τ))")
        _check_choice(p.loss_type, DPO_LOSS_TYPES, "preference.loss_type")
        if not 0 <= p.label_smoothing < 0.5:
            raise ConfigError(f"preference.label_smoothing={p.label_smoothing} must be in [0, 0.5)")
        if p.label_smoothing and p.loss_type != "sigmoid":
            raise ConfigError(f"preference.label_smoothing={p.label_smoothing} applies to preference.loss_type=sigmoid "
                              f"only, not {p.loss_type!r}")
    else:
        for key in ("beta", "label_smoothing", "loss_type"):
            if getattr(p, key) != getattr(default, key):
                raise ConfigError(f"preference.{key}={getattr(p, key)!r} applies to preference.stage=dpo only, not "
                                  f"{p.stage!r}")
    if p.margin is not None and p.stage != "rm":
        raise ConfigError(f"preference.margin={p.margin} applies to preference.stage=rm only, not {p.stage!r}")
    if p.max_length < 2:
        raise ConfigError(f"preference.max_length={p.max_length} must be >= 2 (a prompt token and a response token)")
    if not 0 <= p.held_out_fraction < 1:
        raise ConfigError(f"preference.held_out_fraction={p.held_out_fraction} must be in [0, 1)")
    if not cfg.data.train_data:
        kind = "prompt, response" if p.stage == "sft" else "prompt, chosen, rejected"
        raise ConfigError(f"preference.stage={p.stage} needs data.train_data: parquet or jsonl files with columns "
                          f"{kind}")
    mini = t.policy_mini_batch_size
    if mini != t.train_batch_size and mini != TrainConfig().trainer.policy_mini_batch_size:
        raise ConfigError(f"trainer.policy_mini_batch_size={mini}: preference.stage={p.stage} takes one optimizer "
                          f"step per batch of trainer.train_batch_size={t.train_batch_size} examples; leave it unset")
    t.policy_mini_batch_size = t.train_batch_size
    mc = t.policy.megatron_config
    model_size = (mc.tensor_model_parallel_size or 1) * (mc.pipeline_model_parallel_size or 1)
    dp = max(1, world_size // model_size)
    per = t.micro_train_batch_size_per_gpu * dp
    if t.micro_train_batch_size_per_gpu >= 1 and t.train_batch_size % per:
        raise ConfigError(f"trainer.train_batch_size={t.train_batch_size} is not divisible by "
                          f"trainer.micro_train_batch_size_per_gpu x DP = {t.micro_train_batch_size_per_gpu} x {dp}; "
                          f"valid batch sizes are multiples of {per}")


def _check_resume(t) -> None:
    """``resume_mode``/``resume_path`` (SkyRL's keys). A ``from_path`` checkpoint is checked here, before any
    model loads; ``latest`` looks for one at start-up (none yet: a fresh start)."""
    if t.resume_mode in (None, "null"):
        t.resume_mode = "none"
    _check_choice(t.resume_mode, RESUME_MODES, "trainer.resume_mode")
    if t.resume_mode == "from_path":
        if not t.resume_path:
            raise ConfigError("trainer.resume_mode=from_path needs trainer.resume_path: a checkpoint directory "
                              "<trainer.ckpt_path>/global_step_<k>")
        from mlora.checkpoint.dirs import CheckpointError, check_complete

        try:
            check_complete(Path(t.resume_path).expanduser())
        except CheckpointError as exc:
            raise ConfigError(f"trainer.resume_path={t.resume_path!r}: {exc}") from None
    if t.max_ckpts_to_keep == 0:
        raise ConfigError("trainer.max_ckpts_to_keep=0 would delete every checkpoint; valid: -1 (keep all) or N >= 1")


# expert tensor parallelism: mlora's experts are whole on their EP rank (megatron's expert_tensor_parallel_size 1)
ETP_UNPROVEN = ("expert tensor parallelism (experts split over TP ranks) is not built: mlora's experts are whole on "
                "their expert-parallel rank; valid: 1 or null (expert_model_parallel_size splits the experts)")
# megatron_config.optimizer_config_kwargs entries for a full-model optimizer's memory (offloading its states to the
# CPU, keeping them in lower precision): an adapter-only run's states are tiny and stay float32 on the device
_ADAPTER_STATE = ("the adapter optimizer state is small and stays on device in float32 (SkyRL sets it to save the GPU "
                  "memory of full-model optimizer states, which LoRA-only training does not have)")
OPTIMIZER_KWARGS_NO_EFFECT = {"optimizer_cpu_offload": _ADAPTER_STATE, "optimizer_offload_fraction": _ADAPTER_STATE,
                              "overlap_cpu_optimizer_d2h_h2d": _ADAPTER_STATE,
                              "use_precision_aware_optimizer": _ADAPTER_STATE}
# megatron OptimizerConfig names -> mlora's optimizer_config keys (adam_beta1/2 -> adam_betas[0/1])
OPTIMIZER_KWARGS = {"lr": "lr", "weight_decay": "weight_decay", "clip_grad": "max_grad_norm",
                    "adam_beta1": "adam_betas", "adam_beta2": "adam_betas"}
# megatron TransformerConfig names -> trainer.* recompute keys
TRANSFORMER_KWARGS = {"recompute_granularity": "recompute", "recompute_method": "recompute_method",
                      "recompute_num_layers": "recompute_num_layers", "recompute_modules": "recompute_modules"}


def _leaf_keys(d: Any, prefix: str) -> list[str]:
    if isinstance(d, dict) and d:
        return [k for name, v in d.items() for k in _leaf_keys(v, f"{prefix}.{name}")]
    return [prefix]


def _resolve_megatron_kwargs(cfg: TrainConfig) -> list[str]:
    """SkyRL's ``trainer.policy.megatron_config.optimizer_config_kwargs`` / ``transformer_config_kwargs`` onto
    mlora's keys (SkyRL: they win over ``optimizer_config``; a recompute value that contradicts a ``trainer.*``
    recompute key set differently is an error). Entries of a full-model optimizer's memory get a note;
    any other entry, or any on ``trainer.ref`` (the reference is the policy's base), is an error."""
    t, notes = cfg.trainer, []
    mc, prefix = t.policy.megatron_config, "trainer.policy.megatron_config"
    for name in ("optimizer_config_kwargs", "transformer_config_kwargs"):
        if getattr(t.ref.megatron_config, name):
            raise ConfigError(f"trainer.ref.megatron_config.{name}={getattr(t.ref.megatron_config, name)!r}: the "
                              "reference is the policy's own base with the adapters off; set them on trainer.policy."
                              "megatron_config")
    opt = t.policy.optimizer_config
    for key, value in mc.optimizer_config_kwargs.items():
        where = f"{prefix}.optimizer_config_kwargs.{key}"
        if key in OPTIMIZER_KWARGS_NO_EFFECT:
            notes.append(f"{where}={value!r} has no effect in mlora: {OPTIMIZER_KWARGS_NO_EFFECT[key]}")
        elif key in ("adam_beta1", "adam_beta2"):
            opt.adam_betas = list(opt.adam_betas)
            opt.adam_betas[key == "adam_beta2"] = float(value)
        elif key in OPTIMIZER_KWARGS:
            setattr(opt, OPTIMIZER_KWARGS[key], float(value))
        else:
            raise ConfigError(f"{where}={value!r}: not an optimizer setting of mlora's adapter AdamW; valid: "
                              f"{', '.join([*OPTIMIZER_KWARGS, *OPTIMIZER_KWARGS_NO_EFFECT])} (or trainer.policy."
                              "optimizer_config.*)")
    for key, value in mc.transformer_config_kwargs.items():
        where = f"{prefix}.transformer_config_kwargs.{key}"
        if key == "num_layers_in_last_pipeline_stage":
            raise ConfigError(f"{where}={value!r}: mlora splits the layers evenly over the pipeline stages (uneven "
                              "stages are not supported); pick a pipeline_model_parallel_size that divides the layers")
        if key not in TRANSFORMER_KWARGS:
            raise ConfigError(f"{where}={value!r}: not a TransformerConfig setting mlora takes; valid: "
                              f"{', '.join(TRANSFORMER_KWARGS)} (activation recompute, = trainer.recompute*)")
        if key == "recompute_granularity":
            value = "none" if value is None else value
            if t.gradient_checkpointing is not None and t.recompute is None:
                t.recompute = "full" if t.gradient_checkpointing else "none"
        mine = TRANSFORMER_KWARGS[key]
        if getattr(t, mine) is not None and getattr(t, mine) != value:
            raise ConfigError(f"{where}={value!r} contradicts trainer.{mine}={getattr(t, mine)!r}; set one of them")
        setattr(t, mine, value)
    return notes


def _check_skyrl_keys(cfg: TrainConfig) -> list[str]:
    """SkyRL keys of features mlora does not have (refused, naming the issue that brings them) and the
    DAPO / export / engine keys' values. Returns notes."""
    t, g, e, notes = cfg.trainer, cfg.generator, cfg.generator.inference_engine, []
    for role in ("policy", "ref"):
        mc = getattr(t, role).megatron_config
        if mc.expert_tensor_parallel_size not in (None, 1):
            raise ConfigError(f"trainer.{role}.megatron_config.expert_tensor_parallel_size="
                              f"{mc.expert_tensor_parallel_size}: {ETP_UNPROVEN}")
        if mc.lora_config.merge_lora:
            raise ConfigError(f"trainer.{role}.megatron_config.lora_config.merge_lora=true: mlora hands the adapter "
                              "to the engines as LoRA (vLLM applies it), never merged into their base; valid: false")
    qat = dict(t.policy.model.fake_int4_qat)
    if qat and qat != {"enabled": False}:
        key = "enabled" if "enabled" in qat else next(iter(qat))
        raise ConfigError(f"trainer.policy.model.fake_int4_qat.{key}={qat[key]!r}: INT4 fake-quant QAT (of MoE "
                          "expert GEMMs, for an INT4 engine checkpoint) is not supported. mlora's "
                          "quantized base is trainer.fp8")
    notes += _check_multi_turn(cfg)
    if g.vision_language_generator:
        raise ConfigError("generator.vision_language_generator=true: vision-language (image) rollouts are not "
                          "supported; mlora trains text-only decoder models")
    if t.policy.fsdp_config.cpu_offload:
        raise ConfigError("trainer.policy.fsdp_config.cpu_offload=true: offloading the frozen base to the CPU is not "
                          "supported (only the adapters train; their optimizer state is small and stays on device); "
                          "valid: false")
    if t.fused_lm_head_logprob:
        raise ConfigError("trainer.fused_lm_head_logprob=true: mlora computes log-probs from the vocab-parallel "
                          "logits of each micro-batch (mlora.rl.vocab_parallel); the fused LM-head path is not "
                          "implemented. valid: false")
    if t.max_training_steps is not None:
        if t.max_training_steps < 1:
            raise ConfigError(f"trainer.max_training_steps={t.max_training_steps} must be >= 1")
        if t.total_steps is not None and t.total_steps != t.max_training_steps:
            raise ConfigError(f"trainer.max_training_steps={t.max_training_steps} and trainer.total_steps="
                              f"{t.total_steps} disagree; set one of them")
    a, max_len = t.algorithm, g.sampling_params.max_generate_length
    if a.overlong_buffer_len is not None and not 0 < a.overlong_buffer_len <= max_len:
        raise ConfigError(f"trainer.algorithm.overlong_buffer_len={a.overlong_buffer_len} must be in [1, generator."
                          f"sampling_params.max_generate_length={max_len}] (the penalty ramps over the last "
                          "overlong_buffer_len tokens of a response)")
    if a.overlong_buffer_len is None and a.overlong_buffer_penalty_factor != 1.0:
        raise ConfigError(f"trainer.algorithm.overlong_buffer_penalty_factor={a.overlong_buffer_penalty_factor} "
                          "applies with trainer.algorithm.overlong_buffer_len only (DAPO's soft overlong punishment)")
    if not a.overlong_buffer_penalty_factor >= 0:
        raise ConfigError(f"trainer.algorithm.overlong_buffer_penalty_factor={a.overlong_buffer_penalty_factor} "
                          "must be >= 0 (the penalty at max_generate_length is -factor)")
    if g.max_input_length is None:  # SkyRL's default, multi-turn too: a longer conversation ends ("length")
        g.max_input_length = t.max_prompt_length
    elif g.max_input_length < t.max_prompt_length:
        raise ConfigError(f"generator.max_input_length={g.max_input_length} < trainer.max_prompt_length="
                          f"{t.max_prompt_length}: in single-turn generation the engine's input is the prompt, which "
                          "trainer.max_prompt_length bounds; set them equal or leave max_input_length unset")
    elif g.max_input_length > t.max_prompt_length and g.max_turns == 1:
        notes.append(f"generator.max_input_length={g.max_input_length} > trainer.max_prompt_length="
                     f"{t.max_prompt_length}: single-turn inputs are the prompts, bounded by max_prompt_length (the "
                     "larger bound is for multi-turn conversations)")
    if e.distributed_executor_backend is not None:
        _check_choice(e.distributed_executor_backend, ("mp", "ray", "uni"),
                      "generator.inference_engine.distributed_executor_backend")
    if t.export_path is None:
        t.export_path = t.run_dir
    return notes


MULTI_TURN_ENV_SETTINGS = ("max_env_workers",)  # environment.skyrl_gym.* keys that are not one env's settings


def _check_multi_turn(cfg: TrainConfig) -> list[str]:
    """``generator.max_turns``, ``use_conversation_multi_turn``, ``turn_rewards`` and
    ``environment.skyrl_gym.*`` (per-environment settings under the environment's name, and
    ``max_env_workers``). Returns notes."""
    from mlora.rollout.envs import env_class, registered_envs
    from mlora.rollout.gym import env_config, is_text_env

    g, env, notes = cfg.generator, cfg.environment, []
    if g.max_turns < 1:
        raise ConfigError(f"generator.max_turns={g.max_turns} must be >= 1 (1: single-turn)")
    _check_choice(g.turn_rewards, TURN_REWARDS, "generator.turn_rewards")
    text_envs = [n for n in registered_envs() if is_text_env(env_class(n))]
    for key, value in dict(env.skyrl_gym).items():
        if key in MULTI_TURN_ENV_SETTINGS:
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"environment.skyrl_gym.{key}={value!r} must be an integer >= 1")
            continue
        if key not in text_envs:
            leaf = (_leaf_keys({key: value}, "environment.skyrl_gym") or [f"environment.skyrl_gym.{key}"])[0]
            raise ConfigError(f"{leaf}: settings of environment {key!r}, which is not a "
                              f"registered multi-turn environment; valid: {', '.join(text_envs)} (their settings, "
                              f"passed as env_config) or {', '.join(MULTI_TURN_ENV_SETTINGS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"environment.skyrl_gym.{key}={value!r}: an environment's settings are a dict "
                              f"(environment.skyrl_gym.{key}.NAME=VALUE)")
        try:
            env_config(value, key)  # SkyRL's typed settings (search, text2sql) refuse keys they do not have
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    ratio = env.max_env_error_ratio
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"environment.max_env_error_ratio={ratio!r} must be a number in [0, 1]: the share of a "
                          "batch's trajectories whose environment may fail before the run stops (0: none)")
    multi = env.env_class in text_envs
    if g.max_turns > 1 and not multi:
        notes.append(f"generator.max_turns={g.max_turns}: environment.env_class={env.env_class!r} scores one "
                     "response (rows whose env_class is a multi-turn environment take up to max_turns turns)")
    if g.use_conversation_multi_turn is None:
        g.use_conversation_multi_turn = True
    return notes


def _resolve_recompute(t) -> None:
    """``trainer.recompute`` from itself or SkyRL's ``trainer.gradient_checkpointing`` (true: full, uniform,
    1 layer per group, as SkyRL's megatron defaults), and its method/num_layers/modules, which apply to
    one granularity each. ``recompute_num_layers`` is checked against the layers of a pipeline stage
    here when the model's config.json can be read, else when the model is built."""
    from mlora.models.recompute import RECOMPUTE, recompute_settings

    gc = t.gradient_checkpointing
    if t.recompute is None:
        t.recompute = "full" if gc else "none"
    elif gc is not None and t.recompute in RECOMPUTE and gc != (t.recompute != "none"):
        raise ConfigError(f"trainer.gradient_checkpointing={gc} contradicts trainer.recompute={t.recompute!r}; set one "
                          "of them (trainer.recompute alone says it all: none | selective | full)")
    try:
        recompute_settings(t.recompute, t.recompute_method, t.recompute_num_layers, t.recompute_modules,
                           layers_per_stage=_layers_per_stage(t), key_prefix="trainer.")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _layers_per_stage(t) -> int | None:
    """Transformer layers per pipeline stage of trainer.policy.model.path, None when not readable (yet)."""
    import json

    try:
        hf = json.loads((Path(str(t.policy.model.path)).expanduser() / "config.json").read_text())
        return int(hf["num_hidden_layers"]) // t.policy.megatron_config.pipeline_model_parallel_size
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _set_keys(cfg: TrainConfig, default: TrainConfig, explicit: set[str], prefix: str = "") -> set[str]:
    """Keys whose value differs from the schema's default or that were given on the command line."""
    out = set()
    for f in fields(cfg):
        key = f"{prefix}{f.name}"
        value, base = getattr(cfg, f.name), getattr(default, f.name, None)
        if hasattr(value, "__dataclass_fields__"):
            out |= _set_keys(value, base, explicit, key + ".")
        elif key in explicit or value != base:
            out.add(key)
    return out


def finalize(cfg: TrainConfig, world_size: int, cuda: bool = False, explicit: Iterable[str] = (),
             gpus_per_node: int | None = None, ranks_per_node: int = 1, gpu_memory_bytes: int | None = None
             ) -> list[str]:
    """Validate ``cfg`` in place (aliases merged into their canonical keys, derived defaults filled).

    ``gpus_per_node`` (CUDA runs: the GPUs a node shows) and ``ranks_per_node`` (torchrun's
    ``LOCAL_WORLD_SIZE``) let the engines' placement be checked before anything loads; ``gpu_memory_bytes``
    (a GPU's memory) whether a data-parallel strategy's layout fits (:mod:`mlora.config.layout_fit`).

    Returns one note per key that was set but has no effect here (to be shown once at start-up).
    Raises :class:`ConfigError` naming the key for a value mlora cannot run with.

    With ``experiments`` (:mod:`mlora.config.experiments`) each experiment's configuration (this one with
    its overrides) is validated the same way, and the finalized ones are attached to ``cfg``
    (:func:`mlora.config.experiments.experiment_configs`).
    """
    world = dict(world_size=world_size, cuda=cuda, gpus_per_node=gpus_per_node, ranks_per_node=ranks_per_node,
                 gpu_memory_bytes=gpu_memory_bytes)
    raw = copy.deepcopy(cfg) if cfg.experiments is not None else None
    notes = _finalize_one(cfg, explicit, **world)
    if raw is not None:
        notes += _finalize_experiments(cfg, raw, explicit, notes, world)
    return notes


def _finalize_experiments(cfg: TrainConfig, raw: TrainConfig, explicit: Iterable[str], notes: list[str],
                          world: dict) -> list[str]:
    """Each experiment's configuration from the run's as given (``raw``, before its derived defaults were
    filled in), finalized; attached to ``cfg``. Returns the experiments' own notes (those the run's
    configuration did not give already)."""
    from mlora.config.experiments import RESOLVED, apply_overrides, check_engines_fit, experiment_specs

    if cfg.preference.stage is not None:
        raise ConfigError(f"experiments apply to the RL loop (PPO/GRPO/RLOO), not preference.stage={cfg.preference.stage}")
    if cfg.trainer.fully_async.enabled:
        raise ConfigError("experiments with trainer.fully_async.enabled=true: asynchronous training of several "
                          "experiments is not supported yet; set trainer.fully_async.enabled=false or run one experiment")
    specs = experiment_specs(cfg.experiments)
    configs, extra = {}, []
    for i, spec in enumerate(specs):
        one = apply_overrides(raw, spec, i)
        try:
            own = _finalize_one(one, [*explicit, *spec.overrides], **world)
        except ConfigError as exc:
            raise ConfigError(f"experiments[{i}] {spec.name!r}: {exc}") from None
        if one.trainer.algorithm.dynamic_sampling.type is not None:
            raise ConfigError(f"experiments[{i}] {spec.name!r}: trainer.algorithm.dynamic_sampling.type="
                              f"{one.trainer.algorithm.dynamic_sampling.type} with experiments: the experiments' "
                              "steps generate together, one batch each; dynamic sampling runs without experiments "
                              "(trainer.algorithm.zero_variance_filter works with them)")
        extra += [f"experiment {spec.name!r}: {n}" for n in own if n not in notes]
        configs[spec.name] = one
    check_engines_fit(cfg, configs)
    cfg.experiments = [spec.as_config() for spec in specs]
    setattr(cfg, RESOLVED, configs)
    return extra


def _finalize_one(cfg: TrainConfig, explicit: Iterable[str], world_size: int, cuda: bool, gpus_per_node: int | None,
                  ranks_per_node: int, gpu_memory_bytes: int | None) -> list[str]:
    set_before = _set_keys(cfg, TrainConfig(), {k.lstrip("+~") for k in explicit})
    notes = []
    _check_preference(cfg, world_size)
    cfg.trainer.dtype = trainer_dtype(cfg.trainer.dtype, cuda)
    _check_trainer(cfg)
    _resolve_generator(cfg)
    if cfg.preference.stage is None:  # the RL loop's engines
        engine_dtype(cfg, cuda)
    _resolve_mesh(cfg, world_size)
    notes += _resolve_megatron_kwargs(cfg) + _check_skyrl_keys(cfg)
    _resolve_recompute(cfg.trainer)
    _check_placement(cfg, world_size, gpus_per_node if cuda else None, ranks_per_node)
    _check_reward_model(cfg)
    notes += _check_algorithm(cfg) + _check_off_policy(cfg) + _check_async(cfg, cuda)
    if cfg.trainer.strategy in DATA_PARALLEL_STRATEGIES:
        notes.append(f"trainer.strategy={cfg.trainer.strategy} runs as a data-parallel megatron-core mesh (TP1 x PP1 x "
                     f"DP{world_size}): the frozen base is replicated on every rank, not sharded; only the LoRA "
                     "adapters train, their gradients all-reduced over DP")
        if cuda and gpu_memory_bytes:
            from mlora.config.layout_fit import check_layout_fits

            check_layout_fits(cfg, world_size, gpu_memory_bytes)
    if cuda and gpu_memory_bytes and cfg.preference.stage is None and cfg.generator.inference_engine.run_engines_locally:
        from mlora.config.layout_fit import check_engines_fit

        check_engines_fit(cfg, world_size, gpu_memory_bytes)
    no_effect = {**NO_EFFECT, **({} if cuda else CPU_ONLY_NO_EFFECT)}
    return notes + [f"{key}={_get(cfg, key)!r} has no effect in mlora: {why}" for key, why in no_effect.items()
                    if key in set_before]
