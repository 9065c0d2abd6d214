"""The gold-reward task of the RLHF study (mlora.demos.rlhf_gold): the gold program's two parts, the fixed seeded
split, the label noise (its rate, and that a flipped pair is the gold pair reversed), and the registered
``arithmetic_gold`` environment scoring held-out rows as the pipeline writes them."""

from __future__ import annotations

import random

import pytest

from mlora.demos import rlhf_gold

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("text, parts", [
    ("14 + 15 = 29.", (1.0, 1.0)),
    ("The answer is 28.", (0.0, 1.0)),  # wrong sum, concise
    ("29 is what you get, though some would say 30", (0.0, 1.0)),  # the last number counts
    (" ".join(["word"] * 15) + " 29", (1.0, 0.4)),  # 16 words: (20 - 16) / 10
    (" ".join(["word"] * 30) + " 29", (1.0, 0.0)),
    ("", (0.0, 1.0)),
])
def test_gold_parts(text, parts):
    assert rlhf_gold.gold_parts(text, 14, 15) == pytest.approx(parts)
    assert rlhf_gold.gold_score(text, 14, 15) == pytest.approx(parts[0] + 0.5 * parts[1])


def test_split_is_fixed_disjoint_and_complete():
    split = rlhf_gold.split_questions(0)
    assert split == rlhf_gold.split_questions(0) and split != rlhf_gold.split_questions(1)
    sets = [set(v) for v in split.values()]
    assert sum(map(len, sets)) == len(set().union(*sets)) == (rlhf_gold.HIGH - rlhf_gold.LOW + 1) ** 2
    assert len(split["heldout"]) == 64 and len(split["sft"]) == 130


def test_demonstrations_are_gold_best():
    rows = rlhf_gold.demonstrations(rlhf_gold.split_questions(0)["sft"], seed=3)
    for row in rows:
        a, b = (int(x) for x in row["prompt"][-1]["content"].removeprefix("What is ").split("?")[0].split(" + "))
        assert rlhf_gold.gold_score(row["response"][0]["content"], a, b) == 1.5


def test_label_noise_rate_and_flips():
    rng = random.Random(0)
    answers = {(a, b): [str(a + b), f"{a + b + rng.randint(1, 5)}", "no idea " * rng.randint(1, 12)]
               for a in range(2, 40) for b in range(2, 40)}
    pairs = rlhf_gold.label_pairs(answers, flip=0.25, seed=7)
    assert len(pairs) == len(answers)  # every question has answers of different gold
    for p in pairs:
        gold_order = rlhf_gold.gold_score(p.chosen, p.a, p.b) > rlhf_gold.gold_score(p.rejected, p.a, p.b)
        assert gold_order != p.flipped
    rate = sum(p.flipped for p in pairs) / len(pairs)
    # 1,444 Bernoulli(0.25) draws: the standard deviation of the rate is 0.0114; 5 of them either side
    assert abs(rate - 0.25) < 0.057, rate
    assert rlhf_gold.label_pairs(answers, 0.25, 7) == pairs  # seeded
    assert rlhf_gold.label_pairs({(2, 3): ["5", "5."]}, 0.25, 7) == []  # equal gold: no pair
    # several pairs per question: each answer in one pair at most, each pair of different gold
    many = rlhf_gold.label_pairs({(2, 3): ["5", "6", "5.", "5", "7", "five " * 25]}, 0.0, 7, per_question=4)
    assert [(p.chosen, p.rejected) for p in many] == [("5", "6"), ("5.", "7"), ("5", "five " * 25)]
    with pytest.raises(ValueError, match="per_question=0: at least one pair per question"):
        rlhf_gold.label_pairs(answers, 0.25, 7, per_question=0)
    with pytest.raises(ValueError, match=r"flip=0.5: the probability of flipping a gold label must be in \[0, 0.5\)"):
        rlhf_gold.label_pairs(answers, 0.5, 7)


def test_the_registered_environment_is_the_gold_program():
    from mlora.rollout.envs import response_reward

    row = rlhf_gold.prompt_row(14, 15, "arithmetic_gold")
    for text in ("14 + 15 = 29.", "It is 30.", "Let me think. " * 5 + "29"):
        assert response_reward("arithmetic_gold", row, text, []) == rlhf_gold.gold_score(text, 14, 15)
