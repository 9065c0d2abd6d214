"""The CPU shims must track megatron-core: a moved or renamed patched symbol fails here, loudly."""

from __future__ import annotations

import pytest
import torch

from mlora.parallel.cpu_shims import PATCHED_SITES, CpuRNGStatesTracker, check_patched_sites

pytestmark = pytest.mark.quick


def test_patched_megatron_symbols_still_exist():
    problems = check_patched_sites()
    assert not problems, "megatron-core changed under the CPU shims:\n" + "\n".join(problems)


def test_shims_cover_the_modules_the_model_uses():
    assert "megatron.core.pipeline_parallel.schedules" in PATCHED_SITES
    assert "megatron.core.tensor_parallel.mappings" in PATCHED_SITES


def test_cpu_rng_tracker_forks_and_restores():
    tracker = CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the forked stream advances
    fresh = CpuRNGStatesTracker()
    fresh.add("model-parallel-rng", 7)
    with fresh.fork():
        assert torch.equal(torch.rand(3), a)
