"""The local vLLM engine's process: the environment it starts with on CUDA (vLLM forks its workers unless told to
spawn them), no CUDA touched in it before vLLM starts, and the engines of a group started all at once.

The engine processes here run a stand-in server (:class:`SleepyServer`, no vLLM) and Ray is faked
(:class:`_FakeRay`): what is checked is mlora's process handling, not vLLM's or Ray's. The tests that start
engine processes are not in the quick tier (each process imports mlora, ~10 s on 2 cores)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from types import SimpleNamespace

import pytest

from mlora.rollout.vllm_engine import (
    LocalVLLMEngine,
    RayVLLMEngine,
    VLLMServer,
    build_engines,
    engine_kwargs,
    engine_process_env,
    local_engine_env,
)

NVML_CHECK, METHOD = "PYTORCH_NVML_BASED_CUDA_CHECK", "VLLM_WORKER_MULTIPROC_METHOD"


class SleepyServer:
    """Stands in for :class:`VLLMServer` in an engine process: takes ``sleep_s`` seconds to start (raises at once
    when its cores are ``fail_cores``); with ``pid_dir``, writes a file named by its pid there when it begins and
    another (``<pid>.ready``) when it is ready."""

    def __init__(self, model: str, kwargs: dict, cpu_cores: list[int] | None = None) -> None:
        self.began = time.time()
        if kwargs.get("pid_dir"):
            with open(os.path.join(kwargs["pid_dir"], str(os.getpid())), "w"):
                pass
        if kwargs.get("fail_cores") is not None and cpu_cores == kwargs["fail_cores"]:
            raise RuntimeError("this engine fails to start on purpose")
        time.sleep(kwargs.get("sleep_s", 0))
        self.ready_at = time.time()
        if kwargs.get("pid_dir"):
            with open(os.path.join(kwargs["pid_dir"], f"{os.getpid()}.ready"), "w"):
                pass

    def ready(self) -> bool:
        return True

    def window(self) -> tuple[float, float]:
        """When this engine began starting and when it was ready (wall clock)."""
        return self.began, self.ready_at

    def environment(self, names: list[str]) -> dict:
        return {n: os.environ.get(n) for n in names}

    def shutdown(self) -> None:
        pass


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return tmp_path


# -- fault 3: the engine process's environment, and no CUDA before vLLM starts -----------------------------------


@pytest.mark.quick
def test_cuda_tp_engine_spawns_its_workers_and_checks_cuda_through_nvml():
    """A CUDA engine with TP workers: vLLM must spawn them, and torch's availability check must not initialise the
    driver; TP=1 (vLLM's in-process executor) starts no process, so only the check is set."""
    assert engine_process_env(True, 2, {}) == {METHOD: "spawn", NVML_CHECK: "1"}
    assert engine_process_env(True, 1, {}) == {NVML_CHECK: "1"}
    assert engine_process_env(True, 1, {}, executor="mp") == {METHOD: "spawn", NVML_CHECK: "1"}
    # vLLM's engine core in a process of its own (the user turned V1 multiprocessing on): forked too
    assert engine_process_env(True, 1, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) == {METHOD: "spawn", NVML_CHECK: "1"}


@pytest.mark.quick
def test_users_own_choices_are_kept():
    env = engine_process_env(True, 4, {METHOD: "fork", NVML_CHECK: "0"})
    assert env == {}  # what the user exported reaches the engine as it is


@pytest.mark.quick
def test_cpu_engine_environment_unchanged():
    assert engine_process_env(False, 2, {}) == {}
    assert engine_process_env(False, 1, {}, executor="mp") == {}
    # the whole set of a local engine: on CPU the threads alone (as before), on CUDA its GPUs and the above
    assert local_engine_env(cpu_cores=[0, 1], cuda_devices=None, cuda=False, tensor_parallel_size=2, env={}) == {
        "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    assert local_engine_env(cpu_cores=None, cuda_devices=None, cuda=False, tensor_parallel_size=1, env={}) == {}
    assert local_engine_env(cpu_cores=None, cuda_devices="2,3", cuda=True, tensor_parallel_size=2, env={}) == {
        "CUDA_VISIBLE_DEVICES": "2,3", METHOD: "spawn", NVML_CHECK: "1"}


class _FakeLLM:
    """``vllm.LLM`` without an engine: records what the engine process had set when it was constructed."""

    def __init__(self, model: str, **kwargs) -> None:
        self.bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(
            lora_config=SimpleNamespace(max_loras=kwargs["max_loras"])))


def _unset(monkeypatch, *names: str) -> None:
    """Unset ``names`` now and restore them after the test (also when the code under test sets them)."""
    for name in names:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.mark.quick
@pytest.mark.parametrize("platform_cpu", [True, False], ids=["cpu-platform", "cuda-platform"])
def test_engine_process_touches_no_cuda_before_vllm(monkeypatch, platform_cpu):
    """What the engine process runs before ``LLM(...)`` (a TP2 engine, no thread binding from the user) never asks
    torch about CUDA: ``torch.cuda.is_available()`` without the NVML check initialises the driver, and vLLM, seeing
    torch's CUDA uninitialised, then forks TP workers that cannot initialise CUDA. The vLLM CPU build binds each
    worker's threads; on a GPU platform nothing is bound."""
    import torch
    import vllm
    from vllm.platforms import current_platform

    def touched(*args, **kwargs):
        raise AssertionError("torch.cuda called in the engine process before vLLM started")

    for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, touched)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: platform_cpu)
    monkeypatch.setitem(vllm.__dict__, "LLM", _FakeLLM)
    _unset(monkeypatch, "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING", "HF_HUB_OFFLINE",
           "OMP_NUM_THREADS")
    server = VLLMServer("model", engine_kwargs(8, "float32", 0, tensor_parallel_size=2), cpu_cores=[0, 1])
    assert server.llm.bind == ("0|1" if platform_cpu else None)


# -- fault 8: a group's engines start at once ---------------------------------------------------------------------


def test_local_engine_alone_starts_with_its_environment(model_dir):
    """One engine, started as before (its constructor returns once it is ready), with a CUDA TP2 engine's
    environment in its process; this process's environment is left as it was."""
    before = dict(os.environ)
    engine = LocalVLLMEngine(model_dir, tensor_parallel_size=2, cuda=True, cuda_devices="0,1",
                             server_factory=SleepyServer, sleep_s=0)
    try:
        assert engine.result(engine.submit("ready")) is True
        env = engine.result(engine.submit("environment", [METHOD, NVML_CHECK, "CUDA_VISIBLE_DEVICES"]))
        assert env == {METHOD: os.environ.get(METHOD, "spawn"), NVML_CHECK: os.environ.get(NVML_CHECK, "1"),
                       "CUDA_VISIBLE_DEVICES": "0,1"}
    finally:
        engine.close()
    assert dict(os.environ) == before


def test_group_engines_start_at_once(model_dir):
    """Two engines that take ``slow`` s each to start: the second begins before the first is ready (one start's
    time for the group, not two)."""
    slow = 6.0
    t0 = time.perf_counter()
    group = build_engines(model_dir, num_engines=2, server_factory=SleepyServer, sleep_s=slow)
    took = time.perf_counter() - t0
    try:
        windows = [group.wait(c) for c in group.submit_all("window")]
    finally:
        group.close()
    began, ready = max(w[0] for w in windows), min(w[1] for w in windows)
    print(f"2 engines of {slow:.0f} s each: group started in {took:.1f} s; starts overlap {ready - began:.1f} s")
    assert began < ready, f"engine start windows {windows} do not overlap: started one after another"


def test_failing_engine_releases_the_group_and_names_itself(model_dir, tmp_path):
    """Engine 1 of 3 fails at once while the others are still starting (they would take ``slow`` s): the error names
    it and carries its traceback, comes without waiting for the others (none of them got ready), and every engine
    process is gone."""
    pids = tmp_path / "pids"
    pids.mkdir()
    slow = 300.0  # what a serial start waits for engine 0 before it even starts engine 1
    children = set(mp.active_children())
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"(?s)engine 1 of 3 .*this engine fails to start on purpose") as info:
        build_engines(model_dir, num_engines=3, engine_cores=[[0], [1], [2]], server_factory=SleepyServer,
                      sleep_s=slow, fail_cores=[1], pid_dir=str(pids))
    print(f"failure reported after {time.perf_counter() - t0:.1f} s: {str(info.value).splitlines()[0]}")
    assert not list(pids.glob("*.ready")), "the error waited for a slow engine to be ready"
    assert set(mp.active_children()) <= children
    for pid in (int(p.name) for p in pids.iterdir()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class _Ref:
    """A fake Ray object ref: ready ``delay`` s after it was made, with ``value`` (or raising ``error``)."""

    def __init__(self, delay: float = 0.0, value=True, error: BaseException | None = None) -> None:
        self.at, self.value, self.error = time.monotonic() + delay, value, error


class _FakeRay:
    """What :class:`RayVLLMEngine` and :func:`build_engines` call of Ray, recorded: each actor is ready ``start_s``
    after its creation, the actor made with ``fail_index`` raises instead."""

    def __init__(self, start_s: float, fail_index: int | None = None) -> None:
        self.start_s, self.fail_index, self.log = start_s, fail_index, []

    def install(self, monkeypatch) -> None:
        import sys

        import ray

        pg = sys.modules["ray.util.placement_group"]  # the module (ray.util.placement_group is its function)
        monkeypatch.setattr(ray, "is_initialized", lambda: True)
        monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0, "GPU": 8.0})
        monkeypatch.setattr(ray, "remote", self.remote)
        monkeypatch.setattr(ray, "wait", self.wait)
        monkeypatch.setattr(ray, "get", self.get)
        monkeypatch.setattr(ray, "kill", lambda actor: self.log.append(("kill", actor.index)))
        monkeypatch.setattr(pg, "placement_group", lambda bundles, strategy: SimpleNamespace(ready=_Ref))
        monkeypatch.setattr(pg, "remove_placement_group", lambda group: self.log.append(("remove group",)))

    def remote(self, **resources):
        fake = self

        class Options:
            def options(self, **options):
                def remote(model, kwargs):
                    index = sum(e[0] == "create" for e in fake.log)
                    fake.log.append(("create", index, options.get("runtime_env")))
                    error = RuntimeError(f"actor {index} fails on purpose") if index == fake.fail_index else None
                    ready = _Ref(fake.start_s, error=error)
                    return SimpleNamespace(index=index, ready=SimpleNamespace(remote=lambda: ready),
                                           shutdown=SimpleNamespace(remote=_Ref))
                return SimpleNamespace(remote=remote)

        return lambda cls: Options()

    def wait(self, refs, num_returns, timeout):
        self.log.append(("wait",))
        first = min(refs, key=lambda r: r.at)
        time.sleep(max(0.0, min(first.at - time.monotonic(), timeout)))
        done = [first] if first.at <= time.monotonic() else []
        return done, [r for r in refs if r is not first or not done]

    def get(self, ref, timeout=None):
        if ref.error is not None:
            raise ref.error
        return ref.value


@pytest.mark.quick
def test_ray_engines_start_at_once_with_their_environment(monkeypatch, model_dir):
    """Ray: every actor is created before any is waited for (a group of 3 actors that start in ``start_s`` each is
    ready in about one start), and a CUDA engine's actor starts with the engine process environment."""
    fake = _FakeRay(start_s=1.0)
    fake.install(monkeypatch)
    _unset(monkeypatch, METHOD, NVML_CHECK)
    t0 = time.perf_counter()
    group = build_engines(model_dir, num_engines=3, tensor_parallel_size=2, run_locally=False, use_gpu=True)
    took = time.perf_counter() - t0
    kinds = [e[0] for e in fake.log]
    assert kinds.index("wait") > max(i for i, k in enumerate(kinds) if k == "create")
    assert took < 2 * fake.start_s
    assert [e[2] for e in fake.log if e[0] == "create"] == [{"env_vars": {METHOD: "spawn", NVML_CHECK: "1"}}] * 3
    assert len(group.engines) == 3
    # a CPU cluster's engine: its environment as it was
    RayVLLMEngine(model_dir, use_gpu=False)
    assert [e for e in fake.log if e[0] == "create"][-1] == ("create", 3, None)


@pytest.mark.quick
def test_ray_failing_engine_releases_the_group_and_names_itself(monkeypatch, model_dir):
    fake = _FakeRay(start_s=0.2, fail_index=1)
    fake.install(monkeypatch)
    with pytest.raises(RuntimeError, match=r"(?s)vLLM engine 1 of 3 \(Ray actor\) .*actor 1 fails on purpose"):
        build_engines(model_dir, num_engines=3, run_locally=False, use_gpu=False)
    assert sorted(e[1] for e in fake.log if e[0] == "kill") == [0, 1, 2]
    assert sum(e[0] == "remove group" for e in fake.log) == 3
