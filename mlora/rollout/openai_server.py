"""A vLLM OpenAI server in a child process for the examples that evaluate served adapters: started from
:func:`mlora.rollout.serve.serve_command`'s argv, ready when ``/v1/models`` answers, stopped by its process group."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, body: dict, timeout: float = 600) -> dict:
    """POST ``body`` as JSON; the JSON answer."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_ready(url: str, proc: subprocess.Popen, log: Path, limit_s: float = 600) -> None:
    """Until ``url``/v1/models answers; an error with the log's tail when the server exits or ``limit_s`` passes."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode} before it was ready; its log: {log}\n"
                               + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"the vLLM server was not ready after {limit_s:.0f} s; its log: {log}")


class OpenAIServer:
    """``with OpenAIServer(argv, port, log) as server: server.chat(...)``: the server of ``argv`` (which must listen
    on ``port``), stopped with its whole process group on exit, also after an error."""

    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.argv, self.url, self.log = argv, f"http://127.0.0.1:{port}", log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "OpenAIServer":
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            wait_ready(self.url, self.proc, self.log)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def chat(self, model: str, messages: list[dict], max_tokens: int, temperature: float = 0.0) -> str:
        """One chat completion's text from adapter (or model) ``model``."""
        out = post_json(f"{self.url}/v1/chat/completions", {"model": model, "messages": messages,
                                                             "temperature": temperature, "max_tokens": max_tokens})
        return out["choices"][0]["message"]["content"]
