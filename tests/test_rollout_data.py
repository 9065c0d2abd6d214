"""Environments, GSM8K scoring and the prompt data pipeline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlora.rollout.data import load_prompts
from mlora.rollout.envs import gsm8k_extract, gsm8k_reference, make_env, register_env, registered_envs

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]


def test_gsm8k_scoring():
    assert gsm8k_reference("so 3 + 4 = 7\n#### 1,234") == "1234"
    env = make_env("gsm8k")
    sample = {"reward_spec": {"ground_truth": "72"}}
    assert env.reward(sample, "She sold 48/2 = 24 ... 48+24 = 72", []) == 1.0
    assert env.reward(sample, "the answer is 72.0, not 71", []) == 0.0  # the last number counts
    assert env.reward(sample, "total 72.00", []) == 1.0
    strict = make_env("gsm8k", strict=True)
    assert strict.reward(sample, "... so 72", []) == 0.0
    assert strict.reward(sample, "... #### 72", []) == 1.0
    assert gsm8k_extract("no numbers here") is None


def test_synthetic_envs_and_registry():
    assert make_env("target_token").reward({"reward_spec": {"target": 5}}, "", [5, 1, 5, 5]) == 0.75
    assert make_env("target_token").reward({"reward_spec": {"targets": [1, 2]}}, "", [5, 1, 2, 9]) == 0.5
    assert make_env("copy_first").reward({"reward_spec": {"last_prompt_token": 9}}, "", [9, 2]) == 1.0

    @register_env("always_one_test")
    class One:
        def reward(self, sample, text, ids):
            return 1.0

    assert "always_one_test" in registered_envs() and make_env("always_one_test").reward({}, "", []) == 1.0
    with pytest.raises(ValueError, match="unknown env_class 'nope'; registered: .*gsm8k"):
        make_env("nope")


def test_gsm8k_preparation_from_sample(tmp_path):
    script = ROOT / "examples" / "gsm8k" / "gsm8k_dataset.py"
    sample = ROOT / "examples" / "gsm8k" / "sample" / "gsm8k_sample.jsonl"
    subprocess.run([sys.executable, str(script), "--output_dir", str(tmp_path), "--from-file", str(sample)],
                   check=True, capture_output=True)
    train, val = load_prompts(tmp_path / "train.parquet"), load_prompts(tmp_path / "validation.parquet")
    assert len(train) + len(val) == 20
    row = train[0]
    assert row["env_class"] == "gsm8k" and row["prompt"][0]["role"] == "user" and "####" in row["prompt"][0]["content"]
    assert row["reward_spec"]["ground_truth"] == gsm8k_reference(row["extra_info"]["answer"])


def test_bad_data_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(tmp_path / "missing.parquet")
    pq.write_table(pa.Table.from_pylist([{"question": "q", "answer": "a"}]), tmp_path / "raw.parquet")
    with pytest.raises(ValueError, match=r"lacks columns \['prompt', 'reward_spec'\]"):
        load_prompts(tmp_path / "raw.parquet")
