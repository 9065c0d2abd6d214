"""The one typed source of ``mlora-train`` keys: a dataclass tree registered as Hydra's schema.

The YAML files in ``mlora/configs/`` only override these defaults; Hydra rejects any key that is
not declared here and any value of the wrong type. Key names follow SkyRL's ``skyrl_train``
configuration (``trainer.policy.model.lora.rank`` ...), including both generations of its engine
keys (``generator.num_inference_engines`` and ``generator.inference_engine.num_engines``);
:mod:`mlora.config.validate` merges such aliases, checks values and says which SkyRL keys have no
effect here. Defaults are mlora's where SkyRL's would be wrong for LoRA on a shared base (docs/skyrl.md
lists every difference).

Fields typed ``Optional`` with a ``None`` default that are aliases of each other are resolved by
:func:`mlora.config.validate.finalize`: after it, the canonical field holds the value to use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class DataConfig:
    train_data: list[str] = field(default_factory=list)  # prompt parquet files (prompt, reward_spec, ...)
    val_data: list[str] = field(default_factory=list)  # evaluated every trainer.eval_interval steps


@dataclass
class LoraSection:
    # the LoRA rank r of each adapted linear's factors (A: r x in, B: out x r)
    rank: int = 32  # SkyRL's 0 means "no LoRA"; mlora trains adapters only, so r >= 1
    alpha: float = 64.0  # the update is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the LoRA branch's input (PEFT's lora_dropout); 0: none
    # generator.weight_sync=disk writes the policy here, in a folder of its own per run; null: <run_dir>/lora_sync
    lora_sync_path: Optional[str] = None
    target_modules: Any = "all-linear"  # "all-linear", a list of HF / megatron names, or one name
    exclude_modules: Any = None  # names taken out of target_modules (PEFT's exclude_modules); null: none
    init_method: str = "kaiming"  # kaiming (PEFT default) | gaussian | xavier | normal | zero
    # mlora: r of every MoE expert's projections (null: the other modules' r); e.g. that r / experts per
    # token ("LoRA Without Regret")
    expert_rank: Optional[int] = None


def lora_max_rank(section: LoraSection) -> int:
    """The largest r of a LoRA section's modules (what an engine's ``max_lora_rank`` must hold)."""
    return max(section.rank, section.expert_rank or 0)


@dataclass
class ModelSection:
    path: Optional[str] = None  # HF checkpoint directory
    lora: LoraSection = field(default_factory=LoraSection)


@dataclass
class PolicyModelSection(ModelSection):
    path: str = MISSING  # the base: an HF checkpoint directory (required; critic and reference share it)
    frozen_adapter_path: Optional[str] = None  # mlora: a PEFT adapter (e.g. SFT) stacked under policy, critic and ref
    # SkyRL's INT4 fake-quant QAT of MoE experts (enabled, group_size, scale_divisor, bf16_base_path): refused when on
    fake_int4_qat: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizerSection:
    lr: float = 1.0e-5  # AdamW's learning rate of the role's adapter (the critic's: adapter and value head)
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's beta1, beta2
    weight_decay: float = 0.0  # SkyRL: 1e-2; decaying LoRA factors toward 0 is PEFT/TRL's default of 0
    max_grad_norm: float = 1.0  # clip the adapter gradients' global L2 norm to this; <= 0: no clipping
    num_warmup_steps: int = 0  # optimizer steps of linear warm-up
    scheduler: str = "constant_with_warmup"  # constant_with_warmup (= constant) | cosine
    offload_after_step: bool = True  # SkyRL GPU-memory option; no effect on results


@dataclass
class MegatronLoraSection:
    merge_lora: Optional[bool] = None  # SkyRL's true merges LoRA into the engines' base; mlora hands adapters (false)


@dataclass
class MegatronSection:
    """SkyRL's ``megatron_config``: the mesh of the shared base (policy, critic and ref are one model)."""

    tensor_model_parallel_size: Optional[int] = None  # None: the policy's value, 1 for the policy
    pipeline_model_parallel_size: Optional[int] = None  # pipeline stages; None: the policy's value, 1 for the policy
    context_parallel_size: Optional[int] = None  # only 1 is supported
    sequence_parallel: Optional[bool] = None  # mlora: megatron sequence parallelism (needs TP > 1)
    # MoE expert parallelism: the experts split over this many ranks (it must divide the experts); null: 1
    expert_model_parallel_size: Optional[int] = None
    expert_tensor_parallel_size: Optional[int] = None  # TP of each expert: 1 / null only (experts are whole on a rank)
    lora_config: MegatronLoraSection = field(default_factory=MegatronLoraSection)
    # SkyRL's pass-through kwargs of megatron's OptimizerConfig / TransformerConfig: the entries that mean
    # something for an adapter-only run map onto mlora's keys (mlora.config.validate._resolve_megatron_kwargs)
    optimizer_config_kwargs: dict[str, Any] = field(default_factory=dict)
    transformer_config_kwargs: dict[str, Any] = field(default_factory=dict)  # recompute_* only (= trainer.recompute*)


@dataclass
class FsdpSection:
    """SkyRL's ``fsdp_config`` (trainer.strategy=fsdp|fsdp2 runs as a data-parallel megatron-core mesh)."""

    cpu_offload: bool = False  # only false: the replicated frozen base stays on the device
    reshard_after_forward: Optional[bool] = None  # FSDP's parameter resharding; the replicated base has no shards


@dataclass
class PolicySection:
    model: PolicyModelSection = field(default_factory=PolicyModelSection)
    optimizer_config: OptimizerSection = field(default_factory=OptimizerSection)
    megatron_config: MegatronSection = field(default_factory=MegatronSection)
    fsdp_config: FsdpSection = field(default_factory=FsdpSection)
    language_model_only: Optional[bool] = None  # SkyRL: train a VL checkpoint's text part; mlora's are text-only


@dataclass
class CriticSection:
    model: ModelSection = field(default_factory=ModelSection)  # path None: the policy's base (must be the same)
    optimizer_config: OptimizerSection = field(default_factory=lambda: OptimizerSection(lr=5.0e-6))


@dataclass
class RefModelSection:
    path: Optional[str] = None  # None: the policy's base (must be the same: the ref is the base, adapters off)


@dataclass
class RefSection:
    model: RefModelSection = field(default_factory=RefModelSection)
    megatron_config: MegatronSection = field(default_factory=MegatronSection)


@dataclass
class PlacementSection:
    """SkyRL's GPU placement. With one shared base every role runs on the same ranks: the counts
    that are given must multiply to the torchrun world size."""

    colocate_all: bool = True  # engines share the trainer's GPUs (sleeping during updates); false: GPUs of their own
    colocate_policy_ref: bool = True  # policy and reference are always one model here (the base, adapters off)
    policy_num_nodes: Optional[int] = None  # nodes x num_gpus_per_node of a role must equal the torchrun world size
    policy_num_gpus_per_node: Optional[int] = None  # null (both): not checked
    critic_num_nodes: Optional[int] = None  # as policy_num_nodes (the critic runs on the same ranks)
    critic_num_gpus_per_node: Optional[int] = None  # as policy_num_gpus_per_node
    ref_num_nodes: Optional[int] = None  # as policy_num_nodes (the reference is the same base)
    ref_num_gpus_per_node: Optional[int] = None  # as policy_num_gpus_per_node


@dataclass
class KLCtrlSection:
    type: str = "fixed"  # fixed | adaptive (only with use_kl_in_reward)
    kl_target: float = 0.1  # adaptive: the KL per token the coefficient is steered toward
    horizon: int = 10000  # adaptive: steps over which the coefficient moves (Ziegler et al.'s controller)


@dataclass
class OffPolicyCorrectionSection:
    """SkyRL's ``trainer.algorithm.off_policy_correction``: correct for the engine's sampling distribution μ
    differing from the trainer's π_old (bf16/FP8 engine vs trainer, async staleness); :mod:`mlora.rl.rollout_correction`."""

    tis_ratio_type: Optional[str] = None  # null | token | sequence: loss x min(π_old/μ, cap) per token / sequence
    token_tis_ratio_clip_high: float = 2.0  # tis_ratio_type=token: the cap of each token's weight
    sequence_tis_ratio_clip_high: float = 5.0  # tis_ratio_type=sequence: the cap of each sequence's weight
    sequence_mask_metric: Optional[str] = None  # null | product | geometric: sequences outside the bounds masked
    geo_mask_high: float = 1.01  # geometric: upper bound of the sequence's geometric-mean ratio
    geo_mask_low: float = 0.99  # geometric: lower bound
    product_mask_high: float = 2.0  # product: upper bound of the sequence's ratio (product over its tokens)
    product_mask_low: float = 0.5  # product: lower bound
    outlier_token_is_threshold_low: Optional[float] = None  # a sequence with any token ratio below: masked
    outlier_token_is_threshold_high: Optional[float] = None  # ... above: masked
    token_mask_is_threshold_low: Optional[float] = None  # tokens with ratio outside [low, high] masked (IcePop)
    token_mask_is_threshold_high: Optional[float] = None  # ... and high (both set or both null)


@dataclass
class SapoSection:
    """SkyRL's ``trainer.algorithm.sapo`` (policy_loss_type=sapo): the soft gate's temperatures."""

    tau_pos: float = 1.0  # the gate's temperature on tokens with a positive advantage
    tau_neg: float = 1.05  # ... with a negative (or zero) advantage


@dataclass
class CispoSection:
    """SkyRL's ``trainer.algorithm.cispo`` (policy_loss_type=cispo): the IS weight's clip offsets (SkyRL HEAD's
    defaults) and what the ratio is to (old: π_old; rollout: the engine's log-probs)."""

    cispo_eps_clip_low: float = 1.0  # the IS weight is clipped to [1 - low, 1 + high] (SkyRL 0.3.0: 0.0)
    cispo_eps_clip_high: float = 4.0  # (SkyRL 0.3.0: 5.0)
    cispo_anchor: str = "old"  # old: ratio to π_old | rollout: to the engine's log-probs (SkyRL HEAD's key)


@dataclass
class DppoSection:
    """SkyRL's ``trainer.algorithm.dppo`` (policy_loss_type=dppo): binary_tv | binary_kl and its thresholds."""

    dppo_type: str = "binary_tv"  # binary_tv: masks tokens by their probability's change | binary_kl: by the token's KL
    delta_low: float = 0.2  # the threshold for tokens with a negative advantage
    delta_high: float = 0.2  # ... with a positive advantage


@dataclass
class ClipCovSection:
    """SkyRL's ``trainer.algorithm.clip_cov`` (policy_loss_type=clip_cov)."""

    clip_ratio: float = 0.0002  # the share of tokens (at least one) whose gradient is cut
    clip_cov_lb: float = 1.0  # candidates: tokens whose centred A·log π covariance is above this ...
    clip_cov_ub: float = 5.0  # ... and below this


@dataclass
class KlCovSection:
    """SkyRL's ``trainer.algorithm.kl_cov`` (policy_loss_type=kl_cov)."""

    kl_cov_frac: float = 0.2  # the share of tokens with the largest centred A·log π covariance that get a KL term
    ppo_kl_coef: float = 1.0  # that term's coefficient (on |log π - log π_old|)


@dataclass
class DynamicSamplingSection:
    """SkyRL's ``trainer.algorithm.dynamic_sampling`` (DAPO's): prompt groups whose rewards are all equal carry no
    GRPO signal. filter: drop them and sample more prompts until the batch is full; replace: put groups with a
    signal in their place (POLARIS); null: off."""

    type: Optional[str] = None  # null | filter | replace
    max_sample_batches: int = 30  # generation calls for one step at most; -1: no limit
    min_replace_ratio: float = 0.3  # replace: the share of groups with a signal needed to replace the others


@dataclass
class AlgorithmSection:
    advantage_estimator: str = "gae"  # gae | grpo | rloo | reinforce++ | maxrl
    gamma: float = 1.0  # GAE's discount
    lambd: float = 1.0  # GAE's λ
    grpo_norm_by_std: bool = True  # grpo: divide each group's centred rewards by the group's standard deviation
    advantage_batch_normalize: bool = False  # SkyRL: z-score the advantages over the batch before the reduction
    # SkyRL: mask out of the loss the prompt groups (> 1 live sample) whose rewards lie within the tolerance
    zero_variance_filter: bool = False
    zero_variance_filter_tol: float = 1e-6  # rewards closer than this count as equal
    # mlora: GAE of a multi-turn row skips the environment's tokens between the model's turns (false: SkyRL's
    # GAE, through them with the critic's values there)
    gae_skip_observations: bool = False
    # the temperature of the trainer's log-probs (SkyRL: null = generator.sampling_params.temperature)
    temperature: Optional[float] = None
    value_head_prefix: str = "value_head"  # SkyRL's attribute name of the critic's head; no effect here
    eps_clip_low: float = 0.2  # PPO's ratio clip range is [1 - eps_clip_low, 1 + eps_clip_high]
    eps_clip_high: float = 0.2  # (a larger high: DAPO's clip-higher)
    # regular | dual_clip | gspo | sapo | cispo | rollout_is | dppo | clip_cov | kl_cov | cross_entropy |
    # importance_sampling (SkyRL's registry; mlora.rl.policy_losses)
    policy_loss_type: str = "regular"
    clip_ratio_c: float = 3.0  # the dual-clip bound (policy_loss_type=dual_clip)
    value_clip: Optional[float] = 0.2  # null: the critic's loss unclipped
    # token_mean | sequence_mean | seq_mean_token_sum_norm | token_mean_legacy | prompt_mean
    loss_reduction: str = "token_mean"
    max_seq_len: Optional[int] = None  # seq_mean_token_sum_norm; None: max_prompt_length + max_generate_length
    use_kl_loss: bool = True  # a KL penalty to the reference (the frozen base) in the actor's loss
    kl_loss_coef: float = 0.001  # its coefficient
    kl_estimator_type: str = "k3"  # k1 | k2 | k3 | abs
    use_kl_in_reward: bool = False  # the KL penalty subtracted from the rewards instead (not both)
    kl_coef: Optional[float] = None  # mlora: KL-in-reward coefficient; None: kl_loss_coef, as SkyRL does
    kl_ctrl: KLCtrlSection = field(default_factory=KLCtrlSection)
    use_entropy_loss: bool = False  # an entropy bonus in the actor's loss
    entropy_loss_coef: float = 0.01  # its coefficient
    off_policy_correction: OffPolicyCorrectionSection = field(default_factory=OffPolicyCorrectionSection)
    use_tis: bool = False  # SkyRL's older name: = off_policy_correction.tis_ratio_type=token
    tis_imp_ratio_cap: float = -1.0  # SkyRL's older name of token_tis_ratio_clip_high (with use_tis)
    # DAPO's soft overlong punishment (SkyRL's main_dapo.py): reward - factor x (length into the last
    # overlong_buffer_len tokens of max_generate_length) / overlong_buffer_len; null: off
    overlong_buffer_len: Optional[int] = None
    overlong_buffer_penalty_factor: float = 1.0  # the factor above (SkyRL's main_dapo.py; with overlong_buffer_len)
    sapo: SapoSection = field(default_factory=SapoSection)
    cispo: CispoSection = field(default_factory=CispoSection)
    dppo: DppoSection = field(default_factory=DppoSection)
    clip_cov: ClipCovSection = field(default_factory=ClipCovSection)
    kl_cov: KlCovSection = field(default_factory=KlCovSection)
    dynamic_sampling: DynamicSamplingSection = field(default_factory=DynamicSamplingSection)


@dataclass
class FullyAsyncSection:
    """SkyRL's ``trainer.fully_async``: prompt groups generate continuously, admitted by SkyRL's capacity rule
    (:mod:`mlora.train.async_schedule`); a group trained at step j was sampled by policy version
    >= j - 1 - max_staleness_steps (0: the synchronous loop)."""

    enabled: bool = False  # asynchronous training; false: the synchronous loop
    max_staleness_steps: int = 4  # SkyRL: trained at step j, scheduled at step i: j - i <= max_staleness_steps
    # prompt groups generating at once (SkyRL: >= policy_mini_batch_size); the bound admits at most
    # train_batch_size x (max_staleness_steps + 1)
    num_parallel_generation_workers: int = 768
    clear_kv_cache_on_weight_sync: bool = False  # SkyRL: drop the engines' prefix cache at each adapter swap
    sample_full_batch: bool = False  # SkyRL: with zero_variance_filter, keep pulling groups until the batch is full


@dataclass
class TrainerSection:
    strategy: str = "megatron"  # megatron | fsdp / fsdp2 (run as a data-parallel megatron-core mesh); deepspeed: refused
    seed: int = 42  # seeds the prompts' order, the adapters' initialisation and the held-out split
    # mlora: torch threads of each trainer rank; null: on CPU the user's OMP_NUM_THREADS when provably theirs, else
    # cores // local ranks (torchrun's OMP_NUM_THREADS=1 is not a choice); with CUDA left alone (mlora.rollout.cpu_threads)
    cpu_threads: Optional[int] = None
    epochs: int = 1  # passes over data.train_data
    total_steps: Optional[int] = None  # mlora: None = epochs x (prompts // train_batch_size)
    max_training_steps: Optional[int] = None  # SkyRL: stop after this many steps at most (caps epochs' steps)
    # SkyRL: tokens per micro-batch (> 0, with use_sample_packing: packed micro-batches of sequences grouped
    # first-fit decreasing under it); -1: micro_train_batch_size_per_gpu (micro_forward_batch_size_per_gpu) x the
    # batch's padded width, the tokens of a padded micro-batch (mlora.train.micro_batches)
    max_tokens_per_microbatch: int = -1
    train_batch_size: int = 8  # prompts per step
    policy_mini_batch_size: int = 4  # prompts per actor optimizer step (x n_samples_per_prompt sequences)
    critic_mini_batch_size: Optional[int] = None  # prompts per critic optimizer step; None: policy_mini_batch_size
    micro_forward_batch_size_per_gpu: int = 4  # sequences
    micro_train_batch_size_per_gpu: int = 2  # sequences
    update_epochs_per_batch: int = 1  # passes of the optimizer over each step's batch (PPO epochs)
    update_ref_every_epoch: bool = False  # SkyRL: the reference becomes the policy at each epoch's start
    max_prompt_length: int = 512  # tokens after the chat template; longer prompts are dropped (as SkyRL)
    # mlora: compute dtype of the trainer's base and the engines' dtype; null: bfloat16 on CUDA (vLLM's CUDA LoRA
    # kernels take 16-bit only), float32 on CPU (exact checks). Adapters, heads and AdamW state stay float32
    # (master weights) under bfloat16/float16
    dtype: Optional[str] = None
    lora_compute_dtype: Optional[str] = None  # mlora: dtype the LoRA branches compute in: null = float32 (PEFT) | trainer.dtype
    fp8: Optional[str] = None  # mlora: frozen linears of the base in FP8: null | torch (_scaled_mm) | te (GPU)
    fp8_recipe: str = "delayed"  # mlora, fp8=te only: delayed | current | mxfp8 (Transformer Engine recipes)
    # mlora's activation recompute of the shared base in the update passes (megatron-core's recompute_granularity;
    # SkyRL sets the same fields in megatron_config.transformer_config_kwargs). recompute_num_layers: layers per
    # checkpointed group with uniform (must divide the layers of a stage), recomputed layers per stage with block.
    recompute: Optional[str] = None  # mlora: none | selective | full; null: full if gradient_checkpointing else none
    recompute_method: Optional[str] = None  # mlora, recompute=full only: uniform (default) | block
    recompute_num_layers: Optional[int] = None  # mlora, recompute=full only: default 1
    recompute_modules: Optional[list[str]] = None  # mlora, recompute=selective only: core_attn (default), mlp
    gradient_checkpointing: Optional[bool] = None  # SkyRL (true by default there): true = recompute full, uniform, 1
    gradient_checkpointing_use_reentrant: bool = False  # SkyRL's HF checkpoint flavour; no effect here
    # sequence packing (SkyRL's key; SkyRL's default is true, mlora's false): a micro-batch's sequences are
    # concatenated with no padding, attention never crossing a sequence (mlora.train.micro_batches)
    use_sample_packing: Optional[bool] = None  # null: false
    remove_microbatch_padding: Optional[bool] = None  # newer SkyRL name of use_sample_packing
    flash_attn: bool = True  # true: torch's fused scaled_dot_product_attention; false: megatron's unfused attention
    # complete training state, any mesh can resume it; preemption (SIGTERM/SIGUSR1) saves one as well
    ckpt_interval: int = 0  # <= 0: no periodic checkpoints (as SkyRL); k: every k steps and at the end
    ckpt_path: Optional[str] = None  # None: <run_dir>/checkpoints (global_step_<k>/, latest_ckpt_global_step.txt)
    max_ckpts_to_keep: int = -1  # as SkyRL: -1 keeps all; N keeps the newest N (pruned after a save completes)
    resume_mode: Optional[str] = None  # none / null (SkyRL: latest) | latest (none yet: fresh start) | from_path
    resume_path: Optional[str] = None  # resume_mode=from_path: a <ckpt_path>/global_step_<k> directory
    eval_batch_size: int = 1024  # prompts per engine call during evaluation
    eval_before_train: bool = True  # evaluate on data.val_data before the first step
    eval_interval: int = 5  # <= 0: no evaluation
    dump_eval_results: bool = True  # <run_dir>/dumped_evals/eval_step_<k>.jsonl
    # SkyRL: every hf_save_interval steps (and at the end) the policy adapter (PEFT) goes to
    # <export_path>/global_step_<k>/policy; <= 0: never. export_path null: trainer.run_dir
    hf_save_interval: int = -1
    export_path: Optional[str] = None  # where those exports go (see hf_save_interval)
    dump_data_batch: bool = False  # <export_path>/dumped_data/global_step_<k>_training_input.pt (each step's batch)
    log_path: Optional[str] = None  # SkyRL's infra log folder; mlora logs to stdout/stderr and run_dir
    fused_lm_head_logprob: bool = False  # SkyRL's fused LM-head log-probs; only false
    logger: str = "console"  # console | wandb | tensorboard (SkyRL: wandb)
    project_name: str = "mlora"  # the tracker's project; part of run_dir
    run_name: str = "run"  # the tracker's run name; part of run_dir
    run_dir: str = "runs/${trainer.project_name}/${trainer.run_name}"  # mlora: metrics, plots, adapters
    placement: PlacementSection = field(default_factory=PlacementSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    fully_async: FullyAsyncSection = field(default_factory=FullyAsyncSection)
    policy: PolicySection = field(default_factory=PolicySection)
    critic: CriticSection = field(default_factory=CriticSection)
    ref: RefSection = field(default_factory=RefSection)


@dataclass
class SamplingSection:
    max_generate_length: Optional[int] = 256  # eval: None follows sampling_params
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling's probability mass; 1.0: off
    top_k: int = -1  # -1: off
    min_p: float = 0.0  # tokens below min_p x the top token's probability are dropped; 0: off
    repetition_penalty: float = 1.0  # only 1.0: the trainer could not reproduce a history-dependent penalty
    logprobs: Optional[int] = 1  # SkyRL's engine setting; mlora always takes the sampled token's log-prob
    stop: Optional[list[str]] = None  # stop strings


@dataclass
class InferenceEngineSection:
    """SkyRL's current ``generator.inference_engine.*`` names (None: the old flat key, else the default)."""

    num_engines: Optional[int] = None  # default 1
    tensor_parallel_size: Optional[int] = None  # default 1
    backend: Optional[str] = None  # default vllm (the only one)
    run_engines_locally: Optional[bool] = None  # default true: child processes here; false: Ray actors
    weight_sync_backend: Optional[str] = None  # SkyRL's NCCL broadcast; mlora hands adapters over as files
    gpu_memory_utilization: Optional[float] = None  # passed to vLLM (GPU engines)
    # vLLM's enforce_eager (no CUDA graphs / torch.compile); null: true (mlora's engines, eager on CPU and GPU)
    enforce_eager: Optional[bool] = None
    engine_init_kwargs: dict[str, Any] = field(default_factory=dict)  # alias of generator.engine_init_kwargs
    distributed_executor_backend: Optional[str] = None  # vLLM's executor of a TP > 1 engine: mp | ray; null: mlora's
    language_model_only: Optional[bool] = None  # SkyRL: serve a VL checkpoint's text part; mlora's are text-only


@dataclass
class ChatTemplateSection:
    """SkyRL's ``generator.chat_template``: the chat template prompts and conversations are rendered with.
    source name: ``name_or_path`` names one of SkyRL's templates; source file: a Jinja file; null name_or_path:
    the tokenizer's own."""

    source: str = "name"  # name | file: what name_or_path is
    name_or_path: Optional[str] = None  # a SkyRL template's name or a Jinja file; null: the tokenizer's template


@dataclass
class GeneratorSection:
    inference_engine: InferenceEngineSection = field(default_factory=InferenceEngineSection)
    # the flat names of skyrl_train (aliases of inference_engine.*)
    num_inference_engines: Optional[int] = None
    inference_engine_tensor_parallel_size: Optional[int] = None  # = inference_engine.tensor_parallel_size
    backend: Optional[str] = None  # = inference_engine.backend
    run_engines_locally: Optional[bool] = None  # = inference_engine.run_engines_locally
    weight_sync_backend: Optional[str] = None  # = inference_engine.weight_sync_backend (no effect here)
    gpu_memory_utilization: Optional[float] = None  # = inference_engine.gpu_memory_utilization
    async_engine: bool = True  # SkyRL's AsyncLLMEngine switch; mlora batches every call either way
    batched: bool = True  # SkyRL's batched single-turn generation; mlora always batches
    # mlora: disk (PEFT files in lora_sync_path) | memory (PEFT files in shared memory) | tensors (no files:
    # each rank copies its shards into one shared-memory segment, vLLM loads the tensors; mlora.rollout.tensor_sync)
    weight_sync: str = "disk"
    kv_cache_memory_bytes: Optional[int] = None  # mlora: KV cache cap; None: vLLM decides
    engine_init_kwargs: dict[str, Any] = field(default_factory=dict)  # more vllm.LLM arguments
    n_samples_per_prompt: int = 1  # SkyRL: 5 (GRPO groups); PPO with a critic needs one
    zero_reward_on_non_stop: bool = False  # reward 0 for responses cut at max_generate_length
    apply_overlong_filtering: bool = False  # DAPO: responses cut at max_generate_length are masked out of the loss
    max_input_length: Optional[int] = None  # SkyRL: the engine's input bound; single-turn: = trainer.max_prompt_length
    # multi-turn rollouts with text environments (mlora.rollout.multi_turn): at most this many model turns per
    # trajectory (1: single-turn); observations as chat messages through the chat template (null: true) or as
    # plain text; turn rewards on each turn's last model token (turn_end, SkyRL's) or summed on the last (final)
    max_turns: int = 1
    use_conversation_multi_turn: Optional[bool] = None  # observations as chat messages (null: true) or plain text
    turn_rewards: str = "turn_end"  # mlora: turn_end (each turn's last model token, SkyRL's) | final (summed)
    # SkyRL: with use_conversation_multi_turn and sampling_params.stop, a turn that ended on a stop string gets
    # the tokenizer's EOS appended (a turn cut at max_generate_length does not)
    append_eos_token_after_stop_str_in_multi_turn: bool = True
    chat_template: ChatTemplateSection = field(default_factory=ChatTemplateSection)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # SkyRL: passed to apply_chat_template
    step_wise_trajectories: bool = False  # SkyRL: each turn of a trajectory a training sample of its own
    merge_stepwise_output: bool = False  # SkyRL: step_wise_trajectories' turns merged back where prefixes match
    vision_language_generator: bool = False  # SkyRL's image rollouts: only false (mlora's models are text-only)
    sampling_params: SamplingSection = field(default_factory=SamplingSection)
    eval_sampling_params: SamplingSection = field(
        default_factory=lambda: SamplingSection(max_generate_length=None, temperature=0.0))
    eval_n_samples_per_prompt: int = 1  # samples per prompt in evaluation


@dataclass
class EnvironmentSection:
    env_class: str = "gsm8k"  # a registered environment (mlora.rollout.envs.register_env)
    # SkyRL-Gym's: <env_class>.* = a multi-turn environment's env_config; max_env_workers = threads stepping them
    skyrl_gym: dict[str, Any] = field(default_factory=dict)
    # mlora (SkyRL has no such key: there an environment's exception ends the run): the share of a batch's
    # multi-turn trajectories whose environment may raise or return malformed output before the run stops with a
    # report (env id, trajectory, traceback); within it they are counted (multi_turn/env_failure_ratio), logged
    # and score 0 from the failing turn. 0: any failure stops the run.
    max_env_error_ratio: float = 0.0


@dataclass
class RewardModelSection:
    """mlora: ``environment.env_class=reward_model``: a learned reward scored on the trainer's own base.

    Reward of a rollout = ``model_weight`` · (reward adapter's score of prompt+response)
    + ``rule_weight`` · (``rule_env``'s reward, when one is named)."""

    adapter_path: Optional[str] = None  # a reward adapter (PEFT SEQ_CLS dir: LoRA + score head; mlora-train rm)
    model_weight: float = 1.0  # multiplies the reward model's score
    rule_env: Optional[str] = None  # a registered rule environment added to the score (e.g. target_token)
    rule_weight: float = 1.0  # multiplies rule_env's reward


@dataclass
class PreferenceSection:
    """mlora: the SFT, reward-model and DPO stages (``mlora-train --config-name sft | rm | dpo``).

    They train one adapter on the shared base from ``data.train_data`` (TRL's columns: ``prompt`` +
    ``response`` for SFT, ``prompt`` + ``chosen`` + ``rejected`` for rm/dpo), with the trainer's keys:
    ``train_batch_size`` examples (pairs) per optimizer step, ``micro_train_batch_size_per_gpu`` per
    micro-batch, ``total_steps``/``epochs``, ``policy.optimizer_config``, ``policy.model.lora`` (also the
    reward adapter's), ``policy.model.frozen_adapter_path`` (stacked under it; part of DPO's reference),
    the mesh, checkpoints, resume, ``eval_interval``/``eval_before_train`` on the held-out split."""

    stage: Optional[str] = None  # null: the RL loop (PPO/GRPO/RLOO); sft | rm | dpo
    beta: float = 0.1  # dpo: β of the implicit reward β·log π/π_ref (ipo: τ); must be > 0
    label_smoothing: float = 0.0  # dpo, sigmoid: conservative DPO's ε in [0, 0.5)
    loss_type: str = "sigmoid"  # dpo: sigmoid | ipo
    margin: Optional[float] = None  # rm: Bradley-Terry margin subtracted from r_chosen - r_rejected
    max_length: int = 1024  # tokens of prompt + response; longer examples are dropped (as TRL)
    held_out_fraction: float = 0.1  # share of data.train_data held out when data.val_data is empty


@dataclass
class DemoSection:
    """mlora: the CPU demo's assets (``--config-name cpu_demo``)."""

    prepare: bool = False  # build the CPU demo's tiny model and prompts in `dir` if missing
    dir: str = "runs/cpu_demo_assets"  # where the demo's model and prompts live
    task: str = "target_token"  # the prompts: target_token, or calculator | guess_number (multi-turn)
    # the tiny base built at `dir`/tiny-<model>: llama (the CPU demo of docs/getting-started.md), or a mixture of experts (qwen3_moe,
    # mixtral, olmoe); the prompts' targets follow the model last built there
    model: str = "llama"


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    generator: GeneratorSection = field(default_factory=GeneratorSection)
    environment: EnvironmentSection = field(default_factory=EnvironmentSection)
    reward_model: RewardModelSection = field(default_factory=RewardModelSection)
    demo: DemoSection = field(default_factory=DemoSection)
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    # mlora: K named variants of the RL run trained side by side on one base and one engine set
    # (mlora.config.experiments): a list of {name: ..., <key>: <value>, ...} or a mapping name -> overrides;
    # null: one run as configured above
    experiments: Optional[Any] = None


SCHEMA_NAME = "mlora_schema"


def register_schema() -> None:
    """Register :class:`TrainConfig` with Hydra's ConfigStore (the YAML files name it in ``defaults``)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)
