"""Node-level faults of a cluster run (issue 22), each refused or handled on CPU:

- a checkpoint root that some ranks cannot see is refused before anything is committed (token file);
- the adapter sync folder is this run's own (two runs with default paths never share one) and
  ``trainer.run_name`` cannot take it elsewhere;
- what killed runs left in ``/dev/shm`` is removed at the next start, and only that;
- ``gpu_memory_utilization`` (SkyRL's 0.8) never sizes a CPU engine's KV cache from host RAM.

The FP8 probe's dtype, the per-device RNG state and the tensor hand-off's token check are tested in
test_fp8.py, test_checkpoint.py and tests/dist/tensor_handoff.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as tmp_mp


def _shared_root_worker(rank: int, port: int, cases: list[list[str]], out: str) -> None:
    import torch.distributed as dist

    from mlora.checkpoint.dirs import CheckpointError, check_shared_root

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(cases[0]))
    results = []
    for roots in cases:
        try:
            check_shared_root(Path(roots[rank]), "trainer.ckpt_path")
            results.append("ok")
        except CheckpointError as exc:
            results.append(str(exc))
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_checkpoint_root_must_be_shared_by_every_rank(tmp_path):
    """Then rank 1 sees another directory under the same name (a node-local disk): every rank stops with an
    error naming the key, rank 1 and the requirement. A shared root passes and leaves nothing behind."""
    shared, local = str(tmp_path / "ckpt"), str(tmp_path / "node1-local")
    tmp_mp.spawn(_shared_root_worker, args=(_free_port(), [[shared, shared], [shared, local]], str(tmp_path)),
                 nprocs=2)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r[0] for r in results] == ["ok", "ok"]
    assert all(r[1].startswith("trainer.ckpt_path=") and "rank(s) [1] do not see" in r[1] for r in results), results
    assert "file system every node mounts" in results[0][1]
    assert not Path(shared).exists()  # the token file and the root the check made are gone again


def test_sync_folder_is_the_runs_own(tmp_path):
    """Two runs with identical configs (default paths, one run name) get different sync folders, under the
    run directory (disk) or /dev/shm (memory), named for their host and process."""
    from mlora.config.schema import TrainConfig

    code = ("import sys; from mlora.config.schema import TrainConfig; from mlora.train.rollouts import _sync_dir; "
            "c = TrainConfig(); c.trainer.run_dir = sys.argv[1]; c.generator.weight_sync = sys.argv[2]; "
            "print(_sync_dir(c, 'policy'))")
    for mode in ("disk", "memory"):
        if mode == "memory" and not Path("/dev/shm").is_dir():
            continue
        paths = [Path(subprocess.run([sys.executable, "-c", code, str(tmp_path / "run"), mode], capture_output=True,
                                     text=True, check=True).stdout.strip()) for _ in range(2)]
        assert paths[0] != paths[1] and all(p.name == "policy" for p in paths), paths
        root = tmp_path / "run" / "lora_sync" if mode == "disk" else Path("/dev/shm")
        assert all(p.parent.parent == root and p.parent.name.startswith("mlora_") for p in paths), paths
    assert TrainConfig().trainer.policy.model.lora.lora_sync_path is None  # no fixed /tmp folder by default


@pytest.mark.parametrize("name", ["../elsewhere", "a/../b", "/abs", "a/", "..", "", "-x", "run name"])
def test_run_name_cannot_escape(name):
    from mlora.config.schema import TrainConfig
    from mlora.config.validate import ConfigError, finalize

    cfg = TrainConfig()
    cfg.trainer.run_name = name
    with pytest.raises(ConfigError, match=r"trainer.run_name=.*letters, digits and \. _ \+ = - only, in parts"):
        finalize(cfg, 1)


def test_run_names_of_skyrl_scripts_pass():
    from mlora.config.schema import TrainConfig
    from mlora.config.validate import finalize

    for name in ("gsm8k_0.5b_lora_grpo", "run", "Qwen2.5-7B+lora=32", "Qwen/Qwen3-0.6B-megatron-lora"):
        cfg = TrainConfig()
        cfg.trainer.run_name = name
        finalize(cfg, 1)


def test_leftovers_of_killed_runs_are_removed(tmp_path):
    """Entries of dead mlora processes of this host go; a live process's, another host's and anything not
    named by mlora stay."""
    from mlora.rollout import shm_names

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    host = shm_names._host()
    mine = shm_names.shm_name("adapter")
    assert mine.startswith(f"mlora_{host}_{os.getpid()}_adapter-")
    entries = {
        f"mlora_{host}_{dead_pid}_adapter-0123456789ab": "file",  # a killed run's segment
        f"mlora_{host}_{dead_pid}_sync-run-0123456789ab": "dir",  # its memory-mode adapter folder
        mine: "file",  # this (live) process's
        f"mlora_other-host_{dead_pid}_adapter-0123456789ab": "file",  # another host's (a shared /dev/shm)
        "mlora-0123456789abcdef": "file",  # not named by this scheme: not ours to judge
        "psm_1234": "file",
    }
    for name, kind in entries.items():
        if kind == "dir":
            (tmp_path / name).mkdir()
            (tmp_path / name / "adapter_model.safetensors").write_bytes(b"x")
        else:
            (tmp_path / name).write_bytes(b"x")
    removed = shm_names.remove_stale(tmp_path)
    assert removed == sorted(n for n in entries if n.startswith(f"mlora_{host}_{dead_pid}_"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for n in entries if n not in removed)
    assert shm_names.remove_stale(tmp_path / "absent") == []


def test_gpu_memory_utilization_does_not_size_cpu_engines(tmp_path):
    """SkyRL's generator.gpu_memory_utilization=0.8: a note on CPU, not a fraction of host RAM for the KV
    cache; on CUDA it goes to vLLM."""
    from mlora.config.schema import TrainConfig
    from mlora.config.validate import finalize
    from mlora.train.rollouts import engine_options

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    cfg = TrainConfig()
    cfg.trainer.policy.model.path = str(tmp_path)
    cfg.generator.gpu_memory_utilization = 0.8
    notes = finalize(cfg, 1, cuda=False, explicit=["generator.gpu_memory_utilization"])
    assert any(n.startswith("generator.gpu_memory_utilization=0.8 has no effect") and "kv_cache_memory_bytes" in n
               for n in notes), notes
    assert "gpu_memory_utilization" not in engine_options(cfg, tmp_path, cuda=False)
    from mlora.plan.engines import DeviceMemory

    cfg.trainer.dtype = "bfloat16"  # finalize chose float32 for CPU; CUDA engines are 16-bit
    gpu = DeviceMemory(total=80 << 30, free=60 << 30, cuda=True)
    assert engine_options(cfg, tmp_path, cuda=True, memory=gpu)["gpu_memory_utilization"] == 0.8
