"""The vLLM rollout engine: train-inference agreement, adapter hot swap (disk and shared memory), errors."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mlora.rollout.generator import SamplingConfig
from mlora.rollout.vllm_engine import LocalVLLMEngine

PROMPTS = [[5, 17, 250, 33], [7, 8, 9, 400, 12]]
AGREE = 1e-3  # mean |vLLM log-prob - trainer log-prob| on sampled tokens, float32 (issue 6)


def _mlora_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    seq = torch.tensor([prompt + tokens])
    logp = torch.log_softmax(model.logits(seq)[0], dim=-1)
    n = len(prompt)
    return logp[n - 1:n - 1 + len(tokens)].gather(-1, torch.tensor(tokens)[:, None])[:, 0]


MAX_PROMPT, MAX_GENERATE = 16, 16  # the run's lengths: PROMPTS and every sampling below fit


@pytest.fixture(scope="module")
def engine(tiny_models):
    """Started as the RL loop starts one on CPU: the run's context length, all this process's cores."""
    from mlora.rollout.cpu_threads import available_cores, engine_core_sets
    from mlora.rollout.model_len import read_context_limit, run_max_model_len

    eng = LocalVLLMEngine(tiny_models / "llama", max_lora_rank=8, kv_cache_memory_bytes=64 << 20,
                          max_model_len=run_max_model_len(MAX_PROMPT, [MAX_GENERATE],
                                                          read_context_limit(tiny_models / "llama")),
                          cpu_cores=engine_core_sets(available_cores(), 1)[0])
    yield eng
    eng.close()


def test_context_and_threads(engine):
    """The engine runs with the derived max_model_len (not the model's 256) and one thread per core it was
    given, whatever OMP_NUM_THREADS it inherited, waiting passively when it has several."""
    import os

    assert engine.result(engine.submit("max_model_len")) == MAX_PROMPT + MAX_GENERATE
    cores = len(os.sched_getaffinity(0))
    policy = os.environ.get("OMP_WAIT_POLICY", "PASSIVE" if cores > 1 else None)
    assert engine.result(engine.submit("threads")) == {"torch": cores, "OMP_WAIT_POLICY": policy}


def test_agreement_and_hot_swap(engine, tiny_models, peft_refs_dir, tmp_path):
    import mlora

    mesh = mlora.init_parallel(tp=1, pp=1)
    model = mlora.from_pretrained(tiny_models / "llama", mesh)
    sampling = SamplingConfig(temperature=1.0, max_generate_length=12, n_samples_per_prompt=2, seed=3)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    sync = Path(shm) / f"mlora-test-{id(engine)}"  # in-memory hand-off: tmpfs, no persistent disk
    try:
        for adapter in ("policy", "sft"):  # the second one replaces the first in place
            src = peft_refs_dir / "llama" / adapter
            if sync.exists():
                shutil.rmtree(sync)
            shutil.copytree(src, sync)
            engine.update_adapter(sync, adapter)  # served under the trainer's adapter name
            assert engine.result(engine.submit("adapter")) == adapter
            gens = engine.generate(PROMPTS, sampling)
            assert [g.prompt_index for g in gens] == [0, 0, 1, 1]
            assert gens[0].token_ids != gens[2].token_ids  # per-prompt seeds
            for name in list(model.adapters):
                model.delete_adapter(name)
            model.load_adapter(adapter, src)
            diffs = [(_mlora_logprobs(model, PROMPTS[g.prompt_index], g.token_ids) - torch.tensor(g.logprobs)).abs()
                     for g in gens]
            assert torch.cat(diffs).mean().item() < AGREE, adapter
            assert max(d.max().item() for d in diffs) < 1e-3
    finally:
        shutil.rmtree(sync, ignore_errors=True)


def _rollout_batch(gens, prompts):
    """Right-padded RolloutBatch of prompt + response, the engine's log-probs on the action positions."""
    from mlora.train.batch import RolloutBatch

    seqs = [prompts[g.prompt_index] + g.token_ids for g in gens]
    s = max(map(len, seqs))
    ids, attn, resp = (torch.zeros(len(gens), s, dtype=torch.long) for _ in range(3))
    rollout = torch.zeros(len(gens), s - 1)
    for b, (g, seq) in enumerate(zip(gens, seqs)):
        n = len(prompts[g.prompt_index])
        ids[b, :len(seq)] = torch.tensor(seq)
        attn[b, :len(seq)] = 1
        resp[b, n:len(seq)] = 1
        rollout[b, n - 1:len(seq) - 1] = torch.tensor(g.logprobs)  # position t predicts token t + 1
    return RolloutBatch(ids, attn, resp, torch.zeros(len(gens)), rollout)


def test_tempered_truncated_agreement(engine, tiny_models, peft_refs_dir, tmp_path):
    """vLLM samples at temperature 0.7 with top-p 0.9 (and top-k 20 with min-p 0.05) and reports the
    log-probs of that processed distribution; the trainer's old-logprob pass (PPOConfig with the same
    sampling parameters) reproduces them: mean and max |gap| <= 1e-3 over sampled tokens, as the
    engine's rollout/logprob_abs_diff(_max) metrics. The untempered log-probs (the trainer before
    the fix) and the tempered but untruncated ones are far off."""
    import mlora
    from mlora.train.config import PPOConfig
    from mlora.train.engine import ActorCriticEngine

    adapter = tmp_path / "policy"
    shutil.copytree(peft_refs_dir / "llama" / "policy", adapter)
    engine.update_adapter(adapter, "policy")
    mesh = mlora.init_parallel(tp=1, pp=1)
    for temperature, top_p, top_k, min_p in [(0.7, 0.9, -1, 0.0), (0.7, 1.0, 20, 0.05)]:
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                  max_generate_length=16, n_samples_per_prompt=2, seed=11)
        gens = engine.generate(PROMPTS, sampling)
        batch = _rollout_batch(gens, PROMPTS)
        mask = batch.action_mask.bool()
        model = mlora.from_pretrained(tiny_models / "llama", mesh)
        model.load_adapter("policy", adapter, trainable=True)
        logits = model.logits(batch.input_ids, batch.attention_mask)[:, :-1]
        picked = batch.input_ids[:, 1:, None]
        untempered = torch.log_softmax(logits, -1).gather(-1, picked)[..., 0]
        tempered = torch.log_softmax(logits / temperature, -1).gather(-1, picked)[..., 0]
        rollout = batch.rollout_logprobs
        cfg = PPOConfig(advantage_estimator="grpo", n_samples_per_prompt=2, mini_batch_size=4,
                        micro_train_batch_size=2, micro_forward_batch_size=4, temperature=temperature,
                        top_p=top_p, top_k=top_k, min_p=min_p)
        metrics = ActorCriticEngine(model, cfg).step(batch)
        gap_old = (untempered - rollout).abs()[mask]
        gap_tempered = (tempered - rollout).abs()[mask]
        print(f"T={temperature} top_p={top_p} top_k={top_k} min_p={min_p}: {int(mask.sum())} tokens, "
              f"|vLLM - trainer| mean {metrics['rollout/logprob_abs_diff']:.2e} "
              f"max {metrics['rollout/logprob_abs_diff_max']:.2e}; untempered mean {gap_old.mean():.3f}, "
              f"tempered untruncated mean {gap_tempered.mean():.3f}")
        assert metrics["rollout/logprob_abs_diff"] <= AGREE
        assert metrics["rollout/logprob_abs_diff_max"] <= AGREE
        assert gap_old.mean().item() > 10 * AGREE  # what the trainer compared before
        assert gap_tempered.mean().item() > 10 * AGREE  # the truncation matters too


def test_stop_strings_reach_the_environment(engine, tiny_models, peft_refs_dir, tmp_path):
    """A turn that ends on a stop string (SkyRL's text-to-SQL script stops at ``</sql>``): the environment's
    step sees the text up to and including the stop string (SkyRL's ``include_stop_str_in_output``), and that
    text is the decoding of the tokens kept for training."""
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
    from transformers import AutoTokenizer

    from mlora.rollout.data import Prompt
    from mlora.rollout.multi_turn import TurnFormat, run_episodes

    adapter = tmp_path / "policy"
    shutil.copytree(peft_refs_dir / "llama" / "policy", adapter)
    engine.update_adapter(adapter, "policy")
    tok = AutoTokenizer.from_pretrained(str(tiny_models / "llama"))
    # the random tiny model's vocabulary outgrows its tokenizer's: find a seed whose sample has text to stop in
    for seed in range(50):
        sampling = SamplingConfig(max_generate_length=16, seed=seed)
        (free,) = engine.generate(PROMPTS[:1], sampling)
        stop = free.text[len(free.text) // 2:][:3]  # a closing tag the sample reaches mid-generation
        if len(stop) == 3 and free.text.index(stop) + 3 < len(free.text):
            break
    else:
        pytest.fail("no sample with text")
    seen = []

    class Recorder(BaseTextEnv):
        def step(self, action):
            seen.append(action)
            return BaseTextEnvStepOutput(observations=[], reward=1.0, done=True, metadata={})

    prompt = Prompt({"prompt": "p"}, PROMPTS[0], "recorder")
    sampling = replace(sampling, stop=(stop,))  # the same seed: the same tokens up to the stop string
    (gen,) = run_episodes(engine.generate, [prompt], sampling, lambda p: Recorder(), TurnFormat(tok, False), 1,
                          64, lambda p, c: PROMPTS[0])
    assert seen == [free.text[:free.text.index(stop) + len(stop)]] and seen[0].endswith(stop)
    assert tok.decode(gen.token_ids) == seen[0] + tok.eos_token  # the stop-string turn closed by an EOS


def test_engine_start_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an HF model directory"):
        LocalVLLMEngine(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    with pytest.raises(RuntimeError, match="vLLM engine for .* (failed to start|did not start|died)"):
        LocalVLLMEngine(tmp_path, start_timeout=300)


def test_shipped_files_keep_the_adapter_name():
    """Ray engines in memory mode receive the adapter as file contents; they serve it under the name the
    trainer gave, not under the last file's name (the loop variable once shadowed it)."""
    from mlora.rollout.vllm_engine import VLLMServer

    server = VLLMServer.__new__(VLLMServer)  # no engine: only the file handling runs
    server._segments, server._shipped = {}, {}
    served = []
    server.set_adapter = lambda path, name: served.append((Path(path), name, sorted(p.name for p in Path(path).iterdir())))
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"\0"}
    server.set_adapter_files(files, "policy")
    server.set_adapter_files(files, "policy")
    assert [s[1:] for s in served] == [("policy", sorted(files))] * 2
    assert not served[0][0].exists() and served[1][0].exists()  # the previous copy is removed
    server.shutdown()
    assert not served[1][0].exists()
