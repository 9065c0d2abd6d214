"""``mlora-train --config-name sft | rm | dpo`` end to end on the synthetic preference task
(mlora.demos.preference_assets), single process, in this interpreter:

- SFT: the response NLL falls; the final adapter is a PEFT adapter;
- DPO on top of the SFT adapter (frozen, stacked under policy and reference): held-out
  ``rewards/accuracies`` rises from 0 to >= 0.8; its first loss is exactly ln 2 (the reference includes
  the SFT adapter); a run resumed from its step-3 checkpoint logs the same steps 4–6 and ends with the
  same adapter; with ``hf_save_interval`` its adapter is exported every 3 steps;
- reward model: held-out accuracy >= 0.85, and the exported PEFT SEQ_CLS adapter, loaded by
  ``PeftModel.from_pretrained(AutoModelForSequenceClassification(base, num_labels=1), dir)``, scores the
  held-out pairs with the same accuracy.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    from mlora.demos.preference_assets import build_preference_assets

    return build_preference_assets(tmp_path_factory.mktemp("preference_assets"), n_train=128, n_val=32)


def _run(name: str, assets: Path, run_dir: Path, *extra: str) -> list[dict]:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.config.validate import finalize
    from mlora.train.__main__ import CONFIG_DIR
    from mlora.train.preference_stage import run_preference

    register_schema()
    data = "sft_train" if name == "sft" else "pairs_train"
    overrides = [f"trainer.policy.model.path={assets / 'tiny-llama'}", f"data.train_data=[{assets / data}.parquet]",
                 f"trainer.run_dir={run_dir}", "trainer.train_batch_size=8", "trainer.micro_train_batch_size_per_gpu=8",
                 "trainer.policy.optimizer_config.lr=1e-3", "trainer.policy.model.lora.rank=8",
                 "trainer.policy.model.lora.alpha=16"]
    given = {e.split("=", 1)[0] for e in extra}
    overrides = [o for o in overrides if o.split("=", 1)[0] not in given] + list(extra)
    if name != "sft":
        overrides.append(f"data.val_data=[{assets / 'pairs_val'}.parquet]")
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name=name, overrides=overrides))
    run_preference(cfg, finalize(cfg, 1, False, overrides))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft(assets, tmp_path_factory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("sft")
    return run_dir, _run("sft", assets, run_dir, "trainer.total_steps=6", "trainer.eval_interval=6",
                         "preference.held_out_fraction=0.125", "trainer.policy.optimizer_config.lr=5e-3")


@pytest.fixture(scope="module")
def dpo(assets, sft, tmp_path_factory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("dpo")
    rows = _run("dpo", assets, run_dir, "trainer.total_steps=6", "trainer.eval_interval=3", "trainer.ckpt_interval=3",
                "trainer.hf_save_interval=3", f"trainer.policy.model.frozen_adapter_path={sft[0] / 'final_adapter'}")
    return run_dir, rows


def test_sft_lowers_the_response_nll(sft):
    run_dir, rows = sft
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 6
    assert rows[-1]["eval/loss"] < rows[0]["eval/loss"] - 2.0, (rows[0]["eval/loss"], rows[-1]["eval/loss"])
    config = json.loads((run_dir / "final_adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    assert (run_dir / "metrics.png").is_file()


def test_dpo_raises_held_out_accuracy(dpo):
    _, rows = dpo
    first, last = rows[0], rows[-1]
    assert first["step"] == 0 and last["step"] == 6
    # policy = reference at the start (B = 0): the reference includes the frozen SFT adapter
    assert abs(first["eval/loss"] - math.log(2)) < 1e-6
    assert first["eval/rewards/accuracies"] == 0.0
    assert last["eval/rewards/accuracies"] >= 0.8, last
    assert last["eval/rewards/margins"] > 0 and last["eval/rewards/chosen"] > last["eval/rewards/rejected"]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected", "loss", "grad_norm"):
        assert key in last, key


def test_dpo_exports_its_adapter_every_hf_save_interval(dpo):
    """SkyRL's hf_save_interval in the preference stages: <run_dir>/global_step_<k>/policy, PEFT; the last is the
    final adapter, the one before it another."""
    from safetensors.torch import load_file

    run_dir, _ = dpo
    final = load_file(run_dir / "final_adapter" / "adapter_model.safetensors")
    step3, step6 = (load_file(run_dir / f"global_step_{k}" / "policy" / "adapter_model.safetensors") for k in (3, 6))
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == ["global_step_3", "global_step_6"]
    assert all(torch.equal(step6[k], final[k]) for k in final) and not all(torch.equal(step3[k], final[k]) for k in final)


def test_dpo_resume_continues_exactly(dpo, assets, sft, tmp_path):
    from safetensors.torch import load_file

    run_dir, rows = dpo
    resumed = _run("dpo", assets, tmp_path, "trainer.total_steps=6", "trainer.eval_interval=3",
                   f"trainer.policy.model.frozen_adapter_path={sft[0] / 'final_adapter'}",
                   "trainer.resume_mode=from_path", f"trainer.resume_path={run_dir / 'checkpoints' / 'global_step_3'}")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(rows[4:], resumed):
        for key in ("loss", "rewards/margins", "grad_norm", "eval/loss"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])
    x = load_file(str(run_dir / "final_adapter" / "adapter_model.safetensors"))
    y = load_file(str(tmp_path / "final_adapter" / "adapter_model.safetensors"))
    assert set(x) == set(y) and max((x[k] - y[k]).abs().max().item() for k in x) <= 1e-6


@pytest.fixture(scope="module")
def rm(assets, tmp_path_factory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("rm")
    return run_dir, _run("rm", assets, run_dir, "trainer.total_steps=8", "trainer.eval_interval=8",
                         "trainer.ckpt_interval=6")


def test_reward_model_accuracy_and_peft_export(assets, rm):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from mlora.train.preference_data import collate, load_examples

    tmp_path, rows = rm
    assert rows[-1]["eval/accuracy"] >= 0.85, rows[-1]
    assert rows[-1]["eval/margin"] > 0
    # the exported adapter in HF + PEFT, on the same held-out pairs
    base = AutoModelForSequenceClassification.from_pretrained(str(assets / "tiny-llama"), num_labels=1,
                                                              dtype=torch.float32)
    hf = PeftModel.from_pretrained(base, str(tmp_path / "final_adapter")).eval()
    tok = AutoTokenizer.from_pretrained(str(assets / "tiny-llama"))
    val, _ = load_examples([str(assets / "pairs_val.parquet")], tok, True, 1024, "val")
    batch = collate(val, tok.pad_token_id, pairs=True)
    with torch.no_grad():
        scores = hf(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, 0]
    chosen, rejected = scores.chunk(2)
    accuracy = float((chosen > rejected).float().mean())
    assert abs(accuracy - rows[-1]["eval/accuracy"]) < 1e-6, (accuracy, rows[-1]["eval/accuracy"])
    assert abs(float((chosen - rejected).mean()) - rows[-1]["eval/margin"]) < 1e-4


@pytest.mark.slow
def test_reward_model_resumes_on_another_mesh(assets, rm, tmp_path):
    """The single-process run's step-6 checkpoint, resumed by ``mlora-train --config-name rm`` at TP2×PP2
    (adapter, head and AdamW state resharded), logs the same steps 7–8."""

    from conftest import mlora_train

    run_dir, rows = rm
    args = ["--config-name", "rm", f"trainer.policy.model.path={assets / 'tiny-llama'}",
            f"data.train_data=[{assets / 'pairs_train'}.parquet]", f"data.val_data=[{assets / 'pairs_val'}.parquet]",
            f"trainer.run_dir={tmp_path}", "trainer.train_batch_size=8", "trainer.micro_train_batch_size_per_gpu=4",
            "trainer.policy.optimizer_config.lr=1e-3", "trainer.policy.model.lora.rank=8",
            "trainer.policy.model.lora.alpha=16", "trainer.total_steps=8", "trainer.eval_interval=8",
            "trainer.policy.megatron_config.tensor_model_parallel_size=2",
            "trainer.policy.megatron_config.pipeline_model_parallel_size=2", "trainer.resume_mode=from_path",
            f"trainer.resume_path={run_dir / 'checkpoints' / 'global_step_6'}"]
    proc = mlora_train(args, 4, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    resumed = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed] == [7, 8]
    for a, b in zip(rows[7:], resumed):
        for key in ("loss", "accuracy", "margin", "grad_norm", "eval/accuracy", "eval/loss"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (a["step"], key, a[key], b[key])
    assert (tmp_path / "final_adapter" / "adapter_model.safetensors").is_file()
