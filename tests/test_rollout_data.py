"""Environments, GSM8K scoring and the prompt data pipeline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from doc_commands import GSM8K_DATA, split

from mlora.rollout.data import load_prompts
from mlora.rollout.envs import gsm8k_reference, last_number, make_env, register_env, registered_envs, response_reward

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]


def test_gsm8k_scoring():
    """``gsm8k`` is SkyRL's GSM8kEnv (strict ``#### N``, compared as text); mlora's lenient last-number scoring
    of the arithmetic demo is ``arithmetic``."""
    assert gsm8k_reference("so 3 + 4 = 7\n#### 1,234") == "1234"
    env = make_env("arithmetic")
    sample = {"prompt": [{"role": "user", "content": "q"}], "reward_spec": {"ground_truth": "72"}}
    assert env.reward(sample, "She sold 48/2 = 24 ... 48+24 = 72", []) == 1.0
    assert env.reward(sample, "the answer is 72.0, not 71", []) == 0.0  # the last number counts
    assert env.reward(sample, "total 72.00", []) == 1.0
    assert last_number("no numbers here") is None
    assert response_reward("gsm8k", sample, "The answer is 72.", []) == 0.0  # SkyRL's: no '#### 72'
    assert response_reward("gsm8k", sample, "... #### 72", []) == 1.0
    assert response_reward("arithmetic", sample, "The answer is 72.", []) == 1.0
    with pytest.raises(ValueError, match="'gsm8k' is a multi-turn text environment"):
        make_env("gsm8k")


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
    """The preparation command docs/getting-started.md shows (tests/doc_commands.py), into a temporary directory and
    from the bundled sample instead of the Hub."""
    _, argv = split(GSM8K_DATA)
    assert argv[0] == "python" and argv[2:] == ["--output_dir", "data/gsm8k"], argv
    sample = ROOT / "examples" / "gsm8k" / "sample" / "gsm8k_sample.jsonl"
    subprocess.run([sys.executable, str(ROOT / argv[1]), "--output_dir", str(tmp_path), "--from-file", str(sample)],
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
    with pytest.raises(ValueError, match=r"lacks columns \['prompt'\]"):
        load_prompts(tmp_path / "raw.parquet")


def test_chat_prompts_are_tokenized_once(tiny_models):
    """A template that writes BOS itself (Llama-3's, Gemma's): the prompt has one BOS (SkyRL tokenizes through
    the template), not the two that rendering to text and tokenizing with special tokens gives."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from mlora.rollout.data import prompt_ids, prompt_text

    tok = AutoTokenizer.from_pretrained(str(tiny_models / "llama"))
    # special tokens add a BOS, as Llama-3's tokenizer does
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{tok.bos_token} $A",
                                                              special_tokens=[(tok.bos_token, tok.bos_token_id)])
    assert tok("x", add_special_tokens=True)["input_ids"][0] == tok.bos_token_id
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    row = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}]}
    ids = prompt_ids(row, tok)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok(prompt_text(row, tok), add_special_tokens=True)["input_ids"].count(tok.bos_token_id) == 2
    assert prompt_ids({"prompt": "plain text"}, tok)[0] == tok.bos_token_id  # text prompts: the tokenizer's BOS


def test_arithmetic_demo_formats(tmp_path):
    """The demo's two formats: the same split, scored by mlora's last-number ``arithmetic`` or by skyrl_gym's
    strict ``gsm8k`` (the worked example turn's answer is no question's sum); an unknown format is refused."""
    from mlora.demos.arithmetic import GSM8K_SHOT, build_arithmetic_data

    lenient = load_prompts(build_arithmetic_data(tmp_path / "a") / "val.parquet")
    strict = load_prompts(build_arithmetic_data(tmp_path / "g", format="gsm8k") / "val.parquet")
    assert {r["env_class"] for r in lenient} == {"arithmetic"} and {r["env_class"] for r in strict} == {"gsm8k"}
    assert [r["reward_spec"] for r in lenient] == [r["reward_spec"] for r in strict]
    assert all(r["prompt"][:2] == GSM8K_SHOT for r in strict) and "40" not in {r["reward_spec"]["ground_truth"]
                                                                              for r in strict}
    row = strict[0]
    truth = row["reward_spec"]["ground_truth"]
    assert response_reward("gsm8k", row, f"x = {truth}\n#### {truth}", []) == 1.0
    assert response_reward("gsm8k", row, f"x = {truth}", []) == 0.0
    with pytest.raises(ValueError, match="unknown format 'json'; one of last_number, gsm8k"):
        build_arithmetic_data(tmp_path / "j", format="json")
