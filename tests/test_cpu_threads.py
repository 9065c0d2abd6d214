"""Threads per process on CPU: trainer ranks get cores // local ranks (or trainer.cpu_threads, or a provably
user-set OMP_NUM_THREADS), local engines share the cores and wait passively; torchrun's OMP_NUM_THREADS=1 does
not decide. The started engine's threads are checked in test_vllm_engine.py."""

from __future__ import annotations

import os

import pytest
import torch

from mlora.rollout.cpu_threads import (
    apply_trainer_threads,
    engine_core_sets,
    engine_environment,
    local_engine_cores,
    overlap_split,
    trainer_threads,
    user_omp_threads,
)

pytestmark = pytest.mark.quick

CORES = sorted(os.sched_getaffinity(0))


def test_trainer_threads():
    assert trainer_threads(2, 1) == 2  # one rank on a 2-core machine: both cores
    assert trainer_threads(2, 4) == 1  # more ranks than cores: one each
    assert trainer_threads(16, 4) == 4  # torchrun's 1 would leave 12 cores idle
    assert trainer_threads(16, 4, explicit=3, user_omp=2) == 3  # trainer.cpu_threads wins
    assert trainer_threads(16, 4, user_omp=2) == 2  # then the user's OMP_NUM_THREADS
    with pytest.raises(ValueError, match="trainer.cpu_threads=0 must be >= 1"):
        trainer_threads(2, 1, explicit=0)


def test_user_omp_threads():
    assert user_omp_threads({}, 4) is None
    assert user_omp_threads({"OMP_NUM_THREADS": "1"}, 4) is None  # what torchrun sets for several ranks
    assert user_omp_threads({"OMP_NUM_THREADS": "1"}, 1) == 1  # torchrun sets nothing for one rank
    assert user_omp_threads({"OMP_NUM_THREADS": "3"}, 4) == 3  # torchrun only ever sets 1
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='x' must be a positive integer"):
        user_omp_threads({"OMP_NUM_THREADS": "x"}, 1)


def test_engine_core_sets_and_environment():
    assert engine_core_sets([1, 0], 1) == [[0, 1]]  # one engine: every core (the trainer waits on it)
    assert engine_core_sets([0, 1, 2, 3, 4], 2) == [[0, 1], [2, 3]]  # engines generate at the same time
    assert engine_core_sets([5], 2) == [[5], [5]]
    with pytest.raises(ValueError, match="num_engines=0 must be >= 1"):
        engine_core_sets([0], 0)
    assert engine_environment(2, {}) == {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_environment(2, {"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_NUM_THREADS": "2"}  # the user's policy
    assert engine_environment(1, {}) == {"OMP_NUM_THREADS": "1"}
    assert local_engine_cores(1, {"LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}) == [CORES]  # torchrun's 1
    assert local_engine_cores(1, {}) == [CORES]
    assert local_engine_cores(1, {"LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}) is None  # the user's


@pytest.fixture
def restore_threads():
    before, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    yield
    torch.set_num_threads(before)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


def test_apply_trainer_threads(restore_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what torchrun sets for every rank of a multi-rank launch
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(len(CORES)))
    torch.set_num_threads(3)
    assert apply_trainer_threads(None, cuda=False) == 1 == torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert apply_trainer_threads(None, cuda=False) == len(CORES) == torch.get_num_threads()
    assert os.environ.get("OMP_NUM_THREADS") is None  # left as launched (it tells the engines whose it is)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one rank: the user's
    assert apply_trainer_threads(None, cuda=False) == 1 == torch.get_num_threads()
    assert apply_trainer_threads(3, cuda=False) == 3 == torch.get_num_threads()  # trainer.cpu_threads
    torch.set_num_threads(1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert apply_trainer_threads(None, cuda=True) is None and torch.get_num_threads() == 1  # CUDA: left alone


def test_start_run_applies_trainer_cpu_threads(restore_threads, monkeypatch, tmp_path):
    """The key does what it says: every stage's start-up (RL and SFT/RM/DPO) sets the rank's threads."""
    from mlora.config.schema import TrainConfig
    from mlora.train.loop import start_run

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cfg = TrainConfig()
    cfg.trainer.policy.model.path = str(tmp_path)
    cfg.trainer.run_dir = str(tmp_path / "run")
    cfg.trainer.policy.megatron_config.tensor_model_parallel_size = 1
    cfg.trainer.policy.megatron_config.pipeline_model_parallel_size = 1
    for value, expected in ((1, 1), (None, len(os.sched_getaffinity(0)))):
        cfg.trainer.cpu_threads = value
        torch.set_num_threads(5)
        start_run(cfg, [], lambda d: None)
        assert torch.get_num_threads() == expected, value


def test_engine_options_place_local_cpu_engines(tmp_path, monkeypatch):
    import json

    from mlora.config.schema import TrainConfig
    from mlora.config.validate import ConfigError, finalize
    from mlora.train.rollouts import engine_options

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    cfg = TrainConfig()
    cfg.trainer.policy.model.path = str(tmp_path)
    finalize(cfg, 1, cuda=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's
    assert engine_options(cfg, tmp_path, cuda=False)["engine_cores"] == [CORES]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # now the user's: the engines keep it
    assert engine_options(cfg, tmp_path, cuda=False)["engine_cores"] is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    cfg.trainer.dtype = "bfloat16"  # CUDA engines are 16-bit (finalize chose float32 for this CPU run)
    assert engine_options(cfg, tmp_path, cuda=True)["engine_cores"] is None  # GPUs: vLLM decides
    cfg.generator.inference_engine.run_engines_locally = False
    assert engine_options(cfg, tmp_path, cuda=False)["engine_cores"] is None  # Ray places its actors

    bad = TrainConfig()
    bad.trainer.policy.model.path = str(tmp_path)
    bad.trainer.cpu_threads = 0
    with pytest.raises(ConfigError, match="trainer.cpu_threads=0 must be >= 1"):
        finalize(bad, 1, cuda=False)


def test_overlap_split():
    """Asynchronous training: engines and trainer ranks compute at once, each on cores of its own."""
    assert overlap_split(2, 1, 1) == (1, 1)
    assert overlap_split(16, 1, 1) == (8, 8)
    assert overlap_split(16, 4, 1) == (3, 3)  # engines 16 / 5 -> 3 cores, 13 left: 3 per rank
    assert overlap_split(1, 1, 1) == (1, 1)  # one core: shared (the split cannot give less than one)
    assert overlap_split(4, 2, 2) == (1, 2)
    cores = sorted(os.sched_getaffinity(0))
    engines = local_engine_cores(1, {}, overlap=True)
    assert engines == [cores[len(cores) - overlap_split(len(cores), 1, 1)[1]:]]  # the last cores
