"""The vLLM rollout engine: train-inference agreement, adapter hot swap (disk and shared memory), errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mlora.rollout.generator import SamplingConfig
from mlora.rollout.vllm_engine import LocalVLLMEngine

PROMPTS = [[5, 17, 250, 33], [7, 8, 9, 400, 12]]
AGREE = 1e-3  # mean |vLLM log-prob - trainer log-prob| on sampled tokens, float32 (issue 6)


def _mlora_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    seq = torch.tensor([prompt + tokens])
    logp = torch.log_softmax(model.logits(seq)[0], dim=-1)
    n = len(prompt)
    return logp[n - 1:n - 1 + len(tokens)].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.fixture(scope="module")
def engine(tiny_models):
    eng = LocalVLLMEngine(tiny_models / "llama", max_lora_rank=8, kv_cache_memory_bytes=64 << 20)
    yield eng
    eng.close()


def test_agreement_and_hot_swap(engine, tiny_models, peft_refs_dir, tmp_path):
    import mlora

    mesh = mlora.init_parallel(tp=1, pp=1)
    model = mlora.from_pretrained(tiny_models / "llama", mesh)
    sampling = SamplingConfig(temperature=1.0, max_generate_length=12, n_samples_per_prompt=2, seed=3)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    sync = Path(shm) / f"mlora-test-{id(engine)}"  # in-memory hand-off: tmpfs, no persistent disk
    try:
        for adapter in ("policy", "sft"):  # the second one replaces the first in place
            src = peft_refs_dir / "llama" / adapter
            if sync.exists():
                shutil.rmtree(sync)
            shutil.copytree(src, sync)
            engine.update_adapter(sync)
            gens = engine.generate(PROMPTS, sampling)
            assert [g.prompt_index for g in gens] == [0, 0, 1, 1]
            assert gens[0].token_ids != gens[2].token_ids  # per-prompt seeds
            for name in list(model.adapters):
                model.delete_adapter(name)
            model.load_adapter(adapter, src)
            diffs = [(_mlora_logprobs(model, PROMPTS[g.prompt_index], g.token_ids) - torch.tensor(g.logprobs)).abs()
                     for g in gens]
            assert torch.cat(diffs).mean().item() < AGREE, adapter
            assert max(d.max().item() for d in diffs) < 1e-3
    finally:
        shutil.rmtree(sync, ignore_errors=True)


def test_engine_start_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an HF model directory"):
        LocalVLLMEngine(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(RuntimeError, match="vLLM engine for .* (failed to start|did not start|died)"):
        LocalVLLMEngine(tmp_path, start_timeout=300)
