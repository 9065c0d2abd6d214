"""``python -m mlora.service`` in a subprocess for the Tinker tests, stopped by pid."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import _free_port


class Server:
    """The service on 127.0.0.1 with the command line's extra ``args``, ready when constructed: healthz answers and
    the sampling engine has started (tests run on a quiet machine, not beside an engine loading)."""

    def __init__(self, model: Path, data_dir: Path, log: Path, args: list[str], threads: int = 1, nproc: int = 1
                 ) -> None:
        """``nproc`` > 1: that many ranks under torchrun (the command's ``--tp``/``--pp`` among ``args``)."""
        self.model, self.data_dir, self.log, self.args, self.threads = model, data_dir, log, list(args), threads
        self.nproc = nproc
        self.proc = None
        self.start()

    def start(self, port: int | None = None) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        out = open(self.log, "a")
        launch = [sys.executable] if self.nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={self.nproc}", f"--master_port={_free_port()}"]
        self.proc = subprocess.Popen([*launch, "-m", "mlora.service", "--model", str(self.model), "--data-dir",
                                      str(self.data_dir), "--port", str(self.port), *self.args],
                                     stdout=out, stderr=out, env={**os.environ, "OMP_NUM_THREADS": str(self.threads)})
        import httpx

        deadline = time.time() + 180
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                health = httpx.get(f"{self.url}/api/v1/healthz", timeout=2)
                if health.status_code == 200 and health.json()["sampling"] != "starting":
                    assert health.json()["sampling"] != "failed", self.log.read_text()[-4000:]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not come up:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def restart(self, kill: bool = False) -> None:
        """A new process on the same data directory and port (clients of the old one reach it); ``kill``: the old one
        SIGKILLed, nothing of it shut down cleanly."""
        if kill and self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.stop()
        self.start(self.port)

    def weights(self, path: str) -> dict[str, torch.Tensor]:
        """The PEFT tensors of a checkpoint ``tinker://<model>/<kind>/<name>`` (read from the server's files)."""
        from safetensors.torch import load_file

        model_id, kind, name = path.removeprefix("tinker://").split("/")
        return load_file(self.data_dir / "checkpoints" / model_id / kind / name / "adapter" /
                         "adapter_model.safetensors")
