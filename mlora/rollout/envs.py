"""Environments: GSM8K, synthetic tasks a tiny model learns on CPU, multi-turn ones, user-registered ones.

Two kinds, one ``environment.env_class`` (or a row's ``env_class``):

- a reward environment (mlora's own registry, :func:`register_env`) scores one response:
  ``env.reward(sample, response_text, response_ids) -> float``, ``sample`` the prompt row (with its
  ``reward_spec``): ``arithmetic`` (the last number of the response), ``arithmetic_gold`` (the RLHF study's gold
  reward), ``target_token``, ``copy_first``, ``reward_model``;
- a SkyRL-Gym text environment (``skyrl_gym``'s registry, ``skyrl_gym.register``, or an entry point
  ``package.module:Class``) is one object per trajectory that answers each model turn
  (:mod:`mlora.rollout.multi_turn`): SkyRL's shipped ones (``gsm8k`` with its strict ``#### N`` reward,
  ``gsm8k_multi_turn``, ``aime``, ``text2sql``, ``search``, ``lcb``, ``searchcode``), mlora's ``calculator``
  and ``guess_number``, or your own.

A name is in one registry only: mlora registers no reward environment under a skyrl_gym id.
"""

from __future__ import annotations

import copy
import re
from typing import Protocol

import skyrl_gym

from mlora.rollout import registry
from mlora.rollout.gym import UnknownTextEnv, check_step_output, is_text_env, make_text_env, text_env_class
from mlora.rollout.registry import register_env  # noqa: F401 (the reward registry's door)

# mlora's text environments, in skyrl_gym's registry as a SkyRL user's would be
MLORA_TEXT_ENVS = {"calculator": "mlora.rollout.tool_envs:CalculatorEnv",
                   "guess_number": "mlora.rollout.tool_envs:GuessNumberEnv"}


def _register_text_envs() -> None:
    for env_id, entry_point in MLORA_TEXT_ENVS.items():
        spec = skyrl_gym.registry.get(env_id)
        if spec is None:
            skyrl_gym.register(id=env_id, entry_point=entry_point)
        elif spec.entry_point != entry_point:
            raise ValueError(f"skyrl_gym id {env_id!r} is registered to {spec.entry_point!r}; mlora registers "
                             f"{entry_point!r} under it: register yours under another id")


_register_text_envs()


class Environment(Protocol):
    def reward(self, sample: dict, response_text: str, response_ids: list[int]) -> float: ...


def registered_envs() -> list[str]:
    """Every name ``environment.env_class`` takes besides entry points: mlora's reward environments and the
    ids in skyrl_gym's registry."""
    return sorted(set(registry.registered_envs()) | set(skyrl_gym.registry))


def env_class(name: str):
    """The class ``name`` selects: a reward environment of mlora's registry, else a skyrl_gym id or entry
    point (:func:`mlora.rollout.gym.text_env_class`); ValueError naming the registered ones."""
    if name in registry.registered_envs():
        return registry.env_class(name)
    try:
        return text_env_class(name)
    except UnknownTextEnv:
        raise ValueError(f"unknown env_class {name!r}; registered: {', '.join(registered_envs())}, or an entry point "
                         "'package.module:Class' (add your own with skyrl_gym.register(id=..., entry_point=...) "
                         "or mlora.rollout.envs.register_env)") from None


def make_env(name: str, **kwargs) -> Environment:
    """A reward environment (one per run); text environments are made per trajectory
    (:func:`mlora.rollout.gym.make_text_env`)."""
    cls = env_class(name)
    if is_text_env(cls):
        raise ValueError(f"env_class {name!r} is a multi-turn text environment: it is made per trajectory, "
                         "not as a reward environment")
    return cls(**kwargs)


def response_reward(name: str, row: dict, text: str, ids: list[int], settings: dict | None = None) -> float:
    """The reward of one response ``text`` (tokens ``ids``) to prompt ``row`` under environment ``name``: a
    reward environment's ``reward``, or a text environment's first step (``settings``: its
    ``environment.skyrl_gym.<name>``). For scoring responses produced elsewhere (a served model)."""
    if not is_multi_turn(name):
        return make_env(name).reward(row, text, ids)
    env = make_text_env(name, settings, {**row, "max_turns": 1})
    try:
        env.init(copy.deepcopy(row.get("prompt")))
        return check_step_output(env.step(text)).reward
    finally:
        env.close()


def is_multi_turn(name: str) -> bool:
    """Whether ``name`` is a SkyRL-Gym text environment (its rollouts are episodes)."""
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


def last_number(response: str) -> str | None:
    """The last number in the response (commas and trailing zeros of decimals dropped), None when none."""
    found = _NUMBER.findall(response)
    return _normalise(found[-1]) if found else None


@register_env("arithmetic")
class LastNumberEnv:
    """Reward 1 when the last number of the response equals ``reward_spec.ground_truth``, else 0: the lenient
    scoring of mlora's arithmetic demo (SkyRL's ``gsm8k`` wants ``#### N``)."""

    def reward(self, sample: dict, response_text: str, response_ids: list[int]) -> float:
        truth = _normalise(str(sample["reward_spec"]["ground_truth"]))
        return float(last_number(response_text) == truth)


GOLD_CONCISE_WORDS, GOLD_ZERO_WORDS = 10, 20
GOLD_STYLE_WEIGHT = 0.5
_INTEGER = re.compile(r"-?\d+")


def gold_parts(text: str, a: int, b: int) -> tuple[float, float]:
    """(correct, concise) of an answer to ``a + b`` (the RLHF study's gold reward, :mod:`mlora.demos.rlhf_gold`):
    1 when its last integer is the sum; 1 up to :data:`GOLD_CONCISE_WORDS` words, linearly down to 0 at
    :data:`GOLD_ZERO_WORDS`."""
    numbers = _INTEGER.findall(text)
    correct = float(bool(numbers) and int(numbers[-1]) == a + b)
    words = len(text.split())
    concise = min(1.0, max(0.0, (GOLD_ZERO_WORDS - words) / (GOLD_ZERO_WORDS - GOLD_CONCISE_WORDS)))
    return correct, concise


def gold_score(text: str, a: int, b: int) -> float:
    """The RLHF study's gold reward: correct + 0.5 · concise (:func:`gold_parts`), in [0, 1.5]."""
    correct, concise = gold_parts(text, a, b)
    return correct + GOLD_STYLE_WEIGHT * concise


@register_env("arithmetic_gold")
class GoldArithmeticEnv:
    """The gold reward of the RLHF study (:func:`gold_score`); ``reward_spec`` gives the operands ``a`` and ``b``."""

    def reward(self, sample: dict, response_text: str, response_ids: list[int]) -> float:
        spec = sample["reward_spec"]
        return gold_score(response_text, int(spec["a"]), int(spec["b"]))


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
                             f"valid: {', '.join(n for n in registry.registered_envs() if n != REWARD_MODEL_ENV)}")
        self.rule = make_env(rule_env) if rule_env else None
        self.rule_weight = float(rule_weight)

    def reward(self, sample: dict, response_text: str, response_ids: list[int]) -> float:
        if self.rule is None:
            return 0.0
        return self.rule_weight * self.rule.reward(sample, response_text, response_ids)
