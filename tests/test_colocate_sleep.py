"""Colocated engines sleep while the trainer works (issue 22): the order of one RL step through the engine
interface is generate -> sleep -> train -> free -> wake -> hand-off -> generate, and the server side
calls vLLM's own API (``LLM.sleep(level=1)``, ``LLM.wake_up()``, ``enable_sleep_mode``). Engines that
cannot sleep (the CPU build) leave the loop as it was: no sleep, no wake. Bit-identical CPU metrics with
and without ``colocate_all`` are checked in test_weight_sync_tensors.py."""

from __future__ import annotations

from unittest import mock

import pytest

from mlora.rollout.generator import Generation

pytestmark = pytest.mark.quick


class FakeEngines:
    """The EngineGroup interface, recording what the loop asks of it, in order."""

    def __init__(self, log: list[str], can_sleep: bool) -> None:
        self.log, self.can_sleep = log, can_sleep

    def submit_generate(self, prompts, sampling, slots=None, total=None, adapters=None):
        self.log.append("generate")
        return [Generation(i, [5, 6, 7], [-0.5, -0.4, -0.3], "x", "stop") for i, _ in enumerate(prompts)
                for _ in range(sampling.n_samples_per_prompt)]

    def finish_generate(self, pending):
        return pending

    def sleep_mode_available(self) -> bool:
        return self.can_sleep

    def sleep(self) -> float:
        self.log.append("sleep")
        return 0.0

    def wake_up(self) -> float:
        self.log.append("wake")
        return 0.0

    def update_adapter(self, adapter_dir, name) -> float:
        self.log.append("hand-off")
        return 0.0

    def close(self) -> None:
        self.log.append("close")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from mlora.demos.rl_assets import build_demo_assets

    return build_demo_assets(tmp_path_factory.mktemp("demo"), n_prompts=16)


def _stage(demo, tmp_path, colocate: bool):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import mlora
    from mlora.config.schema import register_schema
    from mlora.config.validate import finalize
    from mlora.train.__main__ import CONFIG_DIR
    from mlora.train.rl_stage import RLStage

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose("cpu_demo", [
            f"demo.dir={demo}", f"trainer.run_dir={tmp_path / 'run'}", "demo.prepare=false",
            "trainer.policy.megatron_config.tensor_model_parallel_size=1",
            "trainer.policy.megatron_config.pipeline_model_parallel_size=1",
            "trainer.train_batch_size=2", "trainer.policy_mini_batch_size=2", "trainer.critic_mini_batch_size=2",
            "generator.n_samples_per_prompt=2", "trainer.micro_forward_batch_size_per_gpu=2",
            "trainer.micro_train_batch_size_per_gpu=2", f"trainer.placement.colocate_all={str(colocate).lower()}"]))
    finalize(cfg, 1)
    return RLStage(cfg, mlora.init_parallel(tp=1, pp=1))


@pytest.mark.parametrize("can_sleep", [True, False])
def test_one_step_order(demo, tmp_path, monkeypatch, can_sleep):
    from mlora.rollout import vllm_engine
    from mlora.train import rl_stage

    log: list[str] = []
    monkeypatch.setattr(vllm_engine, "build_engines", lambda *a, **k: FakeEngines(log, can_sleep))
    monkeypatch.setattr(rl_stage, "release_cached_memory", lambda: log.append("free"))
    stage = _stage(demo, tmp_path, colocate=True)
    real_step = stage.engine.step
    monkeypatch.setattr(stage.engine, "step", lambda batch: (log.append("train"), real_step(batch))[1])
    stage.open(tmp_path / "run")
    try:
        stage.step(1, [0, 1])
        metrics = stage.step(2, [2, 3])
    finally:
        stage.close()
    if can_sleep:
        assert log == ["hand-off", "generate", "sleep", "train", "free", "wake", "hand-off",
                       "generate", "sleep", "train", "free", "wake", "hand-off", "close"]
        assert "timing/engine_sleep_s" in metrics and "timing/engine_wake_s" in metrics
    else:  # the CPU build: the loop as it was
        assert log == ["hand-off", "generate", "train", "hand-off", "generate", "train", "hand-off", "close"]
        assert "timing/engine_sleep_s" not in metrics


def test_not_colocated_never_sleeps(demo, tmp_path, monkeypatch):
    from mlora.rollout import vllm_engine

    log: list[str] = []
    monkeypatch.setattr(vllm_engine, "build_engines", lambda *a, **k: FakeEngines(log, True))
    stage = _stage(demo, tmp_path, colocate=False)
    stage.open(tmp_path / "run")
    try:
        stage.step(1, [0, 1])
    finally:
        stage.close()
    assert log == ["hand-off", "generate", "hand-off", "close"]


def test_server_calls_vllms_sleep_api():
    """VLLMServer's sleep and wake are vLLM's LLM.sleep(level=1) and LLM.wake_up() (signatures checked against
    the installed vLLM); colocated GPU engines are started with enable_sleep_mode."""
    from vllm import LLM

    from mlora.rollout.vllm_engine import VLLMServer, engine_kwargs

    server = object.__new__(VLLMServer)
    server.llm = mock.create_autospec(LLM, instance=True)
    server.sleep()
    server.wake_up()
    assert server.llm.mock_calls == [mock.call.sleep(level=1), mock.call.wake_up()]
    assert engine_kwargs(8, "bfloat16", 0, sleep_mode=True)["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in engine_kwargs(8, "bfloat16", 0)
