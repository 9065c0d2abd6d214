"""Environments: GSM8K, synthetic tasks a tiny model learns on CPU, multi-turn ones, user-registered ones.

A reward environment scores one response: ``env.reward(sample, response_text, response_ids) -> float``.
``sample`` is the prompt row (with its ``reward_spec``). A multi-turn text environment
(:class:`mlora.rollout.gym.BaseTextEnv`: ``calculator``, ``guess_number``, or your own) is one object per
trajectory that answers each model turn (:mod:`mlora.rollout.multi_turn`). Select one with
``environment.env_class`` (or a row's ``env_class``); register your own with :func:`register_env` or
:func:`mlora.rollout.gym.register`.
"""

from __future__ import annotations

import re
from typing import Protocol

from mlora.rollout.gym import is_text_env
from mlora.rollout.registry import env_class, register_env, registered_envs  # noqa: F401 (the registry's doors)
from mlora.rollout.tool_envs import CalculatorEnv, GuessNumberEnv


class Environment(Protocol):
    def reward(self, sample: dict, response_text: str, response_ids: list[int]) -> float: ...


def make_env(name: str, **kwargs) -> Environment:
    """A reward environment (one per run); multi-turn text environments are made per trajectory."""
    return env_class(name)(**kwargs)


def is_multi_turn(name: str) -> bool:
    """Whether ``name`` is a multi-turn text environment (:class:`mlora.rollout.gym.BaseTextEnv`)."""
    return is_text_env(env_class(name))


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _normalise(number: str) -> str:
    number = number.replace(",", "").rstrip(".")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return number


def gsm8k_reference(answer: str) -> str:
    """The final answer of a GSM8K solution: the number after ``####``."""
    if "####" not in answer:
        raise ValueError(f"GSM8K answer without '####': {answer[-80:]!r}")
    found = _NUMBER.findall(answer.split("####")[-1])
    if not found:
        raise ValueError(f"no number after '####' in {answer[-80:]!r}")
    return _normalise(found[0])


def gsm8k_extract(response: str, strict: bool = False) -> str | None:
    """The model's answer: the number in ``#### N`` (strict) or the last number in the response."""
    if strict:
        m = re.search(r"####\s*(-?[\d,]*\.?\d+)", response)
        return _normalise(m.group(1)) if m else None
    found = _NUMBER.findall(response)
    return _normalise(found[-1]) if found else None


@register_env("gsm8k")
class GSM8KEnv:
    """Reward 1 when the extracted answer equals ``reward_spec.ground_truth``, else 0."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict

    def reward(self, sample: dict, response_text: str, response_ids: list[int]) -> float:
        truth = _normalise(str(sample["reward_spec"]["ground_truth"]))
        return float(gsm8k_extract(response_text, self.strict) == truth)


@register_env("target_token")
class TargetTokenEnv:
    """Synthetic: the fraction of response tokens in the target set.

    ``reward_spec`` gives ``targets`` (token ids) or ``target`` (one id). A tiny random model
    learns it in a few dozen CPU steps when the targets are tokens its output layer can favour
    together (see :mod:`mlora.demos.rl_assets`), so the reward visibly rises in a demo.
    """

    def reward(self, sample: dict, response_text: str, response_ids: list[int]) -> float:
        spec = sample["reward_spec"]
        targets = set(spec["targets"]) if spec.get("targets") is not None else {int(spec["target"])}
        return sum(t in targets for t in response_ids) / max(len(response_ids), 1)


@register_env("copy_first")
class CopyFirstEnv:
    """Synthetic: 1 when the first response token repeats the prompt's last token."""

    def reward(self, sample: dict, response_text: str, response_ids: list[int]) -> float:
        return float(bool(response_ids) and response_ids[0] == int(sample["reward_spec"]["last_prompt_token"]))


register_env("calculator")(CalculatorEnv)
register_env("guess_number")(GuessNumberEnv)

REWARD_MODEL_ENV = "reward_model"


@register_env(REWARD_MODEL_ENV)
class RewardModelEnv:
    """A learned reward: ``reward_model.model_weight`` · the reward adapter's score of prompt+response
    (``reward_model.adapter_path``) + ``rule_weight`` · ``rule_env``'s reward.

    The score needs the model, so the trainer computes it on its own shared base after the batch is
    built (:mod:`mlora.train.learned_reward`); this object gives the rule part, where the other
    environments score: ``rule_weight`` · ``rule_env.reward(...)``, or 0 without a rule environment.
    """

    def __init__(self, rule_env: str | None = None, rule_weight: float = 1.0) -> None:
        if rule_env == REWARD_MODEL_ENV:
            raise ValueError(f"reward_model.rule_env={rule_env!r}: the rule part must be a rule environment; "
                             f"valid: {', '.join(n for n in registered_envs() if n != REWARD_MODEL_ENV)}")
        self.rule = make_env(rule_env) if rule_env else None
        self.rule_weight = float(rule_weight)

    def reward(self, sample: dict, response_text: str, response_ids: list[int]) -> float:
        if self.rule is None:
            return 0.0
        return self.rule_weight * self.rule.reward(sample, response_text, response_ids)
