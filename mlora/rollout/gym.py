"""Multi-turn text environments in SkyRL-Gym's shape.

An environment is one trajectory's world: ``init(prompt)`` gives the first conversation the model
sees, and each ``step(action_text)`` takes the model's turn and returns new observations (chat
messages), a reward, whether the trajectory is done, and metadata::

    from mlora.rollout.gym import BaseTextEnv, BaseTextEnvStepOutput, register

    class MultiplyEnv(BaseTextEnv):
        def __init__(self, env_config={}, extras={}):
            super().__init__()
            self.ground_truth = extras["reward_spec"]["ground_truth"]
            self.max_turns = extras.get("max_turns", 5)

        def step(self, action: str) -> BaseTextEnvStepOutput:
            self.turns += 1
            ...
            return BaseTextEnvStepOutput(observations=[{"role": "user", "content": "try again"}],
                                         reward=0.0, done=False, metadata={})

    register(id="multiply", entry_point=MultiplyEnv)   # or "package.module:MultiplyEnv"

What differs from SkyRL-Gym: the import (``mlora.rollout.gym`` instead of ``skyrl_gym.envs.base_text_env``
and ``skyrl_gym.envs.registration``); the tool-group helpers (``_init_tool_groups``, ``_execute_tool``) are
not part of the base class (an environment calls its tools itself); ``env_config`` is a plain dict
(``environment.skyrl_gym.<env_class>``), ``extras`` the prompt row (with ``reward_spec``) plus
``max_turns`` (``generator.max_turns``) when the row has none. One environment object is made per
trajectory, as in SkyRL.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable, Dict, List, Optional, Tuple, TypedDict

MessageType = Dict[str, str]
ConversationType = List[MessageType]


class BaseTextEnvStepOutput(TypedDict, total=False):
    """What :meth:`BaseTextEnv.step` returns (SkyRL-Gym's fields)."""

    observations: List[MessageType]  # new chat messages from the environment (OpenAI format)
    reward: float  # this turn's reward
    done: bool  # the trajectory ends after this turn
    metadata: Dict[str, Any]
    postprocessed_action: Optional[str]  # SkyRL: the action as the environment rewrote it (not used here)


class BaseTextEnv:
    """Text in, text out, one object per trajectory: override :meth:`step` (and :meth:`init`, :meth:`close`
    where needed). ``turns`` counts the steps taken; ``max_turns`` is the environment's own bound (the
    generator also ends a trajectory at ``generator.max_turns``)."""

    def __init__(self) -> None:
        self.turns = 0
        self.max_turns = 1

    def init(self, prompt: ConversationType) -> Tuple[ConversationType, Dict[str, Any]]:
        """The first conversation given to the model, and optional metadata."""
        return prompt, {}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """One turn: the model's ``action`` in, observations, reward, done and metadata out."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def close(self) -> None:
        """Release what the environment holds (called when its trajectory ends)."""


def is_text_env(cls: Any) -> bool:
    """Whether a registered environment class is a multi-turn text environment (not a reward function)."""
    return isinstance(cls, type) and issubclass(cls, BaseTextEnv)


def register(id: str, entry_point: str | Callable) -> None:  # noqa: A002 (SkyRL-Gym's argument name)
    """SkyRL-Gym's registration: ``environment.env_class=<id>`` builds ``entry_point`` (a class or
    ``"module:Class"``) for each trajectory."""
    from mlora.rollout.registry import register_env

    register_env(id)(resolve_entry_point(entry_point))


def resolve_entry_point(entry_point: str | Callable) -> Callable:
    """A class from ``"package.module:Class"`` (or the class itself)."""
    if not isinstance(entry_point, str):
        return entry_point
    module, _, name = entry_point.partition(":")
    if not module or not name:
        raise ValueError(f"entry_point={entry_point!r}: expected 'package.module:Class'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"entry_point={entry_point!r} cannot be loaded: {exc}") from None


def check_step_output(out: Any) -> tuple[list[MessageType], float, bool, dict]:
    """``(observations, reward, done, metadata)`` of a :meth:`BaseTextEnv.step` result; ValueError naming
    what is malformed (the trajectory then ends, counted, and the run goes on)."""
    if not isinstance(out, dict):
        raise ValueError(f"step() returned {type(out).__name__}, not a BaseTextEnvStepOutput dict")
    missing = [k for k in ("observations", "reward", "done") if k not in out]
    if missing:
        raise ValueError(f"step() output lacks {missing}")
    obs = out["observations"]
    if not isinstance(obs, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
            for m in obs):
        raise ValueError("step() observations must be a list of {'role': str, 'content': str} messages, got "
                         f"{str(obs)[:120]}")
    reward = out["reward"]
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"step() reward must be a finite number, got {reward!r}")
    if not isinstance(out["done"], bool):
        raise ValueError(f"step() done must be a bool, got {out['done']!r}")
    metadata = out.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"step() metadata must be a dict, got {type(metadata).__name__}")
    return obs, float(reward), out["done"], metadata
