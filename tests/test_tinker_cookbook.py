"""The real tinker-cookbook 0.6.1, unchanged, against ``python -m mlora.service`` serving SmolLM2-135M-Instruct (the
local directory as ``model_name``; the cookbook's ChatML renderer ``qwen3_instruct``, SmolLM2's chat format).

- ``python -m tinker_cookbook.recipes.math_rl.train env=arithmetic loss_fn=importance_sampling`` (its default,
  ``stable_reinforce``, is refused: Tinker does not publish its objective): 2 steps saved by ``save_every``, then
  resumed with ``behavior_if_log_dir_exists=resume`` for 2 more (evaluation every 2); every step samples
  groups through the server's vLLM engine (the client's sampler weights a LoRA adapter of it, ``lm_head`` included:
  the cookbook trains the unembedding) and trains on them; the reward rises (the answers' format first: a bare
  number closed by ``<|im_end|>`` within ``max_tokens``).
- ``python -m tinker_cookbook.recipes.chat_sl.train dataset=<the cookbook's example_data/conversations.jsonl>`` with
  ``save_every``, ``eval_every`` and rolling saves: the training NLL falls; the rolling checkpoints carry a TTL and
  the superseded ones are deleted (the REST API).
- DPO (``preference.train_dpo.main``, the config its CLI builds, on a local preference JSONL through the cookbook's
  ``ComparisonBuilderFromJsonl``): a reference sampling client of the initial weights scores both completions
  (``compute_logprobs``), the loss runs through ``forward_backward_custom``; the loss starts at log 2 and falls.
- On-policy distillation (``distillation.train_on_policy.main``, the config its CLI builds, on local prompts through
  the cookbook's ``PromptOnlyDataset``): the teacher is the served base model (``create_sampling_client(base_model=)``,
  scored by ``compute_logprobs``); a student drifted from it by a few SFT steps is pulled back, its reverse KL falls.
- ``python -m tinker_cookbook.recipes.multiplayer_rl.guess_number.train`` (multi-turn: up to 10 turns a game) for
  2 steps while the server's and its engine's memory (PSS) is sampled: after the first step it stays within 1.2x
  of its peak through step 1 (its process was OOM-killed at 11.9 GiB before micro-batches were sized at start).

The server's engine is sized by hand (the suite's other worker runs beside it); its micro-batches are sized at start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tinker_server import Server

pytest.importorskip("tinker_cookbook")

RL_STEPS = 4
SL_STEPS = 3
DPO_STEPS = 3
KEY = "tml-mlora-cookbook"


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cookbook_server")
    # sized by hand: the suite's other worker runs beside it (started as docs/tinker.md shows, the engine takes half of
    # what is free then: tests/test_tinker_service.py runs that command, and the memory curve in docs/tinker.md is of it)
    s = Server(smollm2, tmp / "data", tmp / "server.log", ["--kv-cache-bytes", str(256 << 20), "--max-model-len", "1024",
                                                          "--max-lora-rank", "32"], threads=2)
    yield s
    s.stop()


def _run(argv: list[str], server: Server, log: Path) -> None:
    env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_BASE_URL": server.url}
    with open(log, "w") as out:
        code = subprocess.run([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT, env=env,
                              timeout=900).returncode
    assert code == 0, f"{argv[:2]} exited {code}:\n{log.read_text()[-4000:]}\nserver:\n{server.log.read_text()[-3000:]}"


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_math_rl_arithmetic_reward_rises(server, smollm2, tmp_path):
    log_path = tmp_path / "math_rl"
    half = RL_STEPS // 2
    args = ["-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={smollm2}",
            "renderer_name=qwen3_instruct", "loss_fn=importance_sampling", "group_size=4", "groups_per_batch=8",
            "learning_rate=3e-4", "max_tokens=8", "lora_rank=16", f"log_path={log_path}", f"eval_every={half}",
            f"save_every={half}", f"base_url={server.url}"]
    # the first half saves at its end (save_every), the second resumes from that checkpoint as a user would
    _run(args + [f"max_steps={half}", "behavior_if_log_dir_exists=delete"], server, tmp_path / "math_rl.log")
    saved = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert any("state_path" in c for c in saved), saved
    _run(args + [f"max_steps={RL_STEPS}", "behavior_if_log_dir_exists=resume"], server, tmp_path / "math_rl2.log")
    assert "Using last checkpoint" in (tmp_path / "math_rl2.log").read_text()
    steps = [m for m in _metrics(log_path) if "env/all/reward/total" in m]
    assert [m["step"] for m in steps] == list(range(RL_STEPS))  # each step once: the resumed run went on
    reward = [m["env/all/reward/total"] for m in steps]
    fmt = [m["env/all/format"] for m in steps]
    print(f"\ncookbook math_rl on mlora: reward {[round(r, 3) for r in reward]}, format {[round(f, 2) for f in fmt]}")
    late = slice(RL_STEPS // 2, None)
    assert sum(reward[late]) / len(reward[late]) > reward[0] and sum(fmt[late]) / len(fmt[late]) >= fmt[0] + 0.15
    # each step's sampler weights were a new LoRA adapter of the engine, the output layer's included
    assert server.log.read_text().count("requests running (") >= RL_STEPS - 1


def test_chat_sl_on_a_local_jsonl_with_rolling_saves(server, smollm2, tmp_path):
    import tinker
    import tinker_cookbook

    log_path = tmp_path / "sl"
    data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    _run(["-m", "tinker_cookbook.recipes.chat_sl.train", f"dataset={data}", f"model_name={smollm2}",
          "renderer_name=qwen3_instruct", "learning_rate=3e-4", "lora_rank=16", "batch_size=16", "max_length=512",
          f"max_steps={SL_STEPS}", "save_every=2", "eval_every=2", "rolling_save_every=1", f"log_path={log_path}",
          "behavior_if_log_dir_exists=delete", f"base_url={server.url}"], server, tmp_path / "sl.log")
    nll = [m["train_mean_nll"] for m in _metrics(log_path) if "train_mean_nll" in m]
    print(f"\ncookbook chat_sl on mlora: NLL {[round(x, 3) for x in nll]}")
    assert len(nll) == SL_STEPS and sum(nll[1:]) / (SL_STEPS - 1) < 0.8 * nll[0]
    # the rolling saves went through the REST API: a TTL each, the superseded ones deleted; save_every's kept
    saved = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert saved and all("state_path" in c or "sampler_path" in c for c in saved), saved
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    model_id = saved[-1].get("state_path", saved[-1].get("sampler_path")).removeprefix("tinker://").split("/")[0]
    kept = rest.list_checkpoints(model_id).result().checkpoints
    rolling = [c for c in kept if c.expires_at is not None]
    assert len(rolling) <= 1 and any(c.expires_at is None for c in kept), kept


def _preferences(path: Path, n: int = 16) -> None:
    """Comparisons as the cookbook's ComparisonBuilderFromJsonl reads them: a short answer preferred to a rambling
    one."""
    rows = []
    for i in range(n):
        a, b = i % 7 + 2, i % 5 + 3
        prompt = [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}]
        good = [{"role": "assistant", "content": str(a + b)}]
        bad = [{"role": "assistant", "content": f"Well, let me think about {a} and {b} for a while first."}]
        label = "A" if i % 2 == 0 else "B"
        pair = (good, bad) if label == "A" else (bad, good)
        rows.append({"comparison": {"prompt_conversation": prompt, "completion_A": pair[0], "completion_B": pair[1]},
                     "label": label})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_dpo_on_a_local_preference_file(server, smollm2, tmp_path):
    log_path, data = tmp_path / "dpo", tmp_path / "prefs.jsonl"
    _preferences(data)
    _run([str(Path(__file__).parent / "cookbook_dpo.py"), str(smollm2), server.url, str(log_path), str(data),
          str(DPO_STEPS)], server, tmp_path / "dpo.log")
    steps = [m for m in _metrics(log_path) if "dpo_loss" in m]
    print(f"\ncookbook DPO on mlora: loss {[round(m['dpo_loss'], 3) for m in steps]}, "
          f"margin {[round(m['margin'], 3) for m in steps]}")
    assert len(steps) == DPO_STEPS
    assert abs(steps[0]["dpo_loss"] - 0.6931) < 0.01  # the reference is the initial weights: log 2 at step 0
    assert steps[-1]["margin"] > steps[0]["margin"] and steps[-1]["dpo_loss"] < steps[0]["dpo_loss"]


DISTILL_STEPS = 3
PROMPTS = ["Name a colour.", "Say hello.", "What is 2 + 2?", "Name a fruit.", "Name an animal.", "Count to three.",
           "Greet a friend.", "Name a city."]


def _biased_student(server: Server, smollm2: Path) -> str:
    """A student that has drifted from the base: a few SFT steps teaching it to answer every prompt "Turtles all the
    way down."; its state's tinker path."""
    import tinker
    from tinker_cookbook import renderers
    from tinker_cookbook.supervised.data import conversation_to_datum
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    renderer = renderers.get_renderer("qwen3_instruct", tokenizer=get_tokenizer(str(smollm2)))
    data = [conversation_to_datum([{"role": "user", "content": p}, {"role": "assistant", "content": "Turtles all "
                                   "the way down."}], renderer, max_length=128) for p in PROMPTS]
    with tinker.ServiceClient(base_url=server.url, api_key=KEY) as service:  # closed: no heartbeat outlives it
        trainer = service.create_lora_training_client(str(smollm2), rank=8)
        for _ in range(4):
            trainer.forward_backward(data, "cross_entropy").result()
            trainer.optim_step(tinker.AdamParams(learning_rate=1e-3)).result()
        return trainer.save_state("biased").result().path


def test_on_policy_distillation_from_the_served_base(server, smollm2, tmp_path):
    """The cookbook's on-policy distillation, teacher = the served base model: a drifted student is pulled back to
    it, its reverse KL to the teacher (log p - log q on its own samples, the teacher's by compute_logprobs) falls."""
    student = _biased_student(server, smollm2)
    log_path, prompts = tmp_path / "distill", tmp_path / "prompts.txt"
    # the same prompts every step (the dataset is read in order, GROUPS a batch): each step's KL is of one set
    prompts.write_text("\n".join(PROMPTS * DISTILL_STEPS) + "\n")
    _run([str(Path(__file__).parent / "cookbook_distillation.py"), str(smollm2), server.url, str(log_path),
          str(prompts), str(DISTILL_STEPS), student], server, tmp_path / "distill.log")
    kl = [m["teacher_kl"] for m in _metrics(log_path) if "teacher_kl" in m]
    print(f"\ncookbook on-policy distillation on mlora: teacher KL {[round(x, 3) for x in kl]}")
    assert len(kl) == DISTILL_STEPS and kl[0] > 0.3 and kl[-1] < 0.6 * kl[0], kl


MEMORY_STEPS = 2
MEMORY_GROWTH = 1.2  # the bound: later peaks over the peak through step 1


def _pss_mib(pid: int) -> float:
    """PSS of ``pid`` and its children (the sampling engine), MiB."""
    total = 0
    pids = [pid] + [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:  # a child that just ended
            pass
    return total / 1024


def test_guess_number_multi_turn_memory_is_held(server, smollm2, tmp_path):
    import threading
    import time

    log_path = tmp_path / "guess_number"
    samples: list[tuple[int, float]] = []  # (steps finished, PSS MiB), every 0.25 s
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            metrics = log_path / "metrics.jsonl"
            finished = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
            samples.append((finished, _pss_mib(server.proc.pid)))
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        _run(["-m", "tinker_cookbook.recipes.multiplayer_rl.guess_number.train", f"model_name={smollm2}",
              "renderer_name=qwen3_instruct", "batch_size=1", "group_size=2", "max_tokens=4",
              f"max_steps={MEMORY_STEPS}", "eval_every=0", "save_every=0", f"log_path={log_path}",
              "behavior_if_log_dir_exists=delete"], server, tmp_path / "guess_number.log")
    finally:
        done.set()
        sampler.join()
    assert len([m for m in _metrics(log_path) if "time/total" in m]) == MEMORY_STEPS
    first = max(v for n, v in samples if n == 0)
    later = max(v for n, v in samples if n >= 1)
    curve = [round(max(v for n, v in samples if n == k)) for k in range(MEMORY_STEPS) if any(n == k for n, _ in samples)]
    print(f"\nguess_number on mlora: PSS of server + engine, peak per step {curve} MiB; later / first step "
          f"{later / first:.2f}x")
    assert later <= MEMORY_GROWTH * first, curve
