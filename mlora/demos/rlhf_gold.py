"""The gold-reward task of the learned-reward RLHF study (``examples/rlhf_smollm2``) on SmolLM2-135M-Instruct.

Small-number addition asked for in one short sentence ("What is 14 + 15? Answer in one short sentence."). The
model answers in many ways: at temperature 1 about one answer in eight ends with the right sum and they run
from one word to dozens. A program is the *gold* reward (Gao, Schulman, Hilton 2022): correctness plus a style
preference,

    gold = [the last number of the answer is a + b] + 0.5 · concise,   concise = 1 up to 10 words, then falling
                                                                        linearly to 0 at 20 words

so gold is in [0, 1.5]. Preference pairs are two answers of one prompt with different gold, labelled by gold
and then flipped with probability ``flip`` (25 % by default: annotators disagree), so a reward model that
agreed with gold on every held-out pair would score ``1 - flip`` against the noisy labels: the noise ceiling.

The prompts are split once, by a seed, into disjoint sets: SFT demonstrations and preference pairs (``sft``),
the RL prompts (``rl``) and the held-out prompts every policy is judged on (``heldout``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from mlora.rollout.envs import gold_parts, gold_score  # noqa: F401 (the task's gold program, defined with its env)

QUESTION = "What is {a} + {b}? Answer in one short sentence."
# the system message, empty: without one SmolLM2's chat template writes its default (16 tokens, a third of a prompt
# and answer), and every stage of the study (SFT, sampling, reward model, PPO, DPO, measurement) pays for it
SYSTEM = ""
LOW, HIGH = 2, 19  # operands, inclusive: 324 questions
SPLIT = {"heldout": 64, "sft": 130}  # the rest (130) are the RL prompts
# what a demonstrator writes: correct and short, in several phrasings (SFT teaches the form, not one string)
DEMONSTRATIONS = ("{a} + {b} = {s}.", "The answer is {s}.", "{a} plus {b} equals {s}.", "The sum of {a} and {b} is {s}.",
                  "{a} + {b} is {s}.", "It is {s}.")


def prompt_row(a: int, b: int, env_class: str) -> dict:
    """A prompt row (chat ``prompt``, ``reward_spec`` with the operands) scored by ``env_class``."""
    return {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION.format(a=a, b=b)}],
            "env_class": env_class,
            "data_source": "rlhf_gold", "reward_spec": {"method": "rule", "ground_truth": str(a + b), "a": a, "b": b}}


def split_questions(seed: int = 0) -> dict[str, list[tuple[int, int]]]:
    """Every ``(a, b)`` with ``LOW <= a, b <= HIGH`` shuffled by ``seed`` into ``heldout``, ``sft`` and ``rl``."""
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)
    h, s = SPLIT["heldout"], SPLIT["sft"]
    return {"heldout": pairs[:h], "sft": pairs[h:h + s], "rl": pairs[h + s:]}


def demonstrations(questions: list[tuple[int, int]], seed: int) -> list[dict]:
    """SFT rows (``prompt`` and ``response`` chat messages): one demonstration per question, a phrasing drawn by ``seed``."""
    rng = random.Random(seed)
    return [{"prompt": prompt_row(a, b, "")["prompt"],
             "response": _assistant(rng.choice(DEMONSTRATIONS).format(a=a, b=b, s=a + b))} for a, b in questions]


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@dataclass(frozen=True)
class Pair:
    a: int
    b: int
    chosen: str
    rejected: str
    flipped: bool  # the label disagrees with gold


def label_pairs(answers: dict[tuple[int, int], list[str]], flip: float, seed: int, per_question: int = 1
                ) -> list[Pair]:
    """Up to ``per_question`` preference pairs per question from its sampled ``answers``: pairs of answers with
    different gold, in order (each answer in at most one pair, so a question's pairs are independent draws;
    questions whose answers all score alike give none), labelled by gold and flipped with probability ``flip``."""
    if not 0.0 <= flip < 0.5:
        raise ValueError(f"flip={flip}: the probability of flipping a gold label must be in [0, 0.5)")
    if per_question < 1:
        raise ValueError(f"per_question={per_question}: at least one pair per question")
    rng = random.Random(seed)
    out = []
    for (a, b), texts in answers.items():
        free = [(gold_score(t, a, b), t) for t in texts]
        made = 0
        while made < per_question and free:
            gi, ti = free.pop(0)
            j = next((j for j, (g, _) in enumerate(free) if g != gi), None)
            if j is None:
                continue
            (_, hi), (_, lo) = sorted([(gi, ti), free.pop(j)], reverse=True)
            flipped = rng.random() < flip
            out.append(Pair(a, b, lo if flipped else hi, hi if flipped else lo, flipped))
            made += 1
    return out


def pair_rows(pairs: list[Pair]) -> list[dict]:
    """TRL's preference columns (chat messages ``prompt``, ``chosen``, ``rejected``) plus the gold scores and the flip."""
    return [{"prompt": prompt_row(p.a, p.b, "")["prompt"], "chosen": _assistant(p.chosen),
             "rejected": _assistant(p.rejected),
             "gold_chosen": gold_score(p.chosen, p.a, p.b), "gold_rejected": gold_score(p.rejected, p.a, p.b),
             "flipped": p.flipped} for p in pairs]
