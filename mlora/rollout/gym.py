"""mlora's side of SkyRL-Gym: text environments are ``skyrl_gym``'s, found in its registry.

A multi-turn environment is a subclass of ``skyrl_gym.envs.base_text_env.BaseTextEnv``, registered with
``skyrl_gym.register(id=..., entry_point=..., kwargs=...)`` exactly as for SkyRL (mlora's ``calculator`` and
``guess_number`` are registered there too), or named by entry point ``package.module:Class``. This module
resolves ``environment.env_class`` (an id or an entry point) to such a class, makes one environment per
trajectory as SkyRL's generator does (``skyrl_gym.make(id, env_config=<OmegaConf DictConfig of
environment.skyrl_gym.<id>>, extras=<the prompt row + max_turns>)``), and checks what ``step`` returns.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, NamedTuple, Optional

import numpy as np
import skyrl_gym
from omegaconf import DictConfig, OmegaConf
from skyrl_gym.envs.base_text_env import BaseTextEnv
from skyrl_gym.envs.registration import load_env_creator

MessageType = dict[str, str]


class UnknownTextEnv(ValueError):
    """``name`` is neither a registered skyrl_gym id nor a ``module:Class`` entry point."""


def is_text_env(cls: Any) -> bool:
    """Whether ``cls`` is a SkyRL-Gym text environment class (a ``skyrl_gym`` ``BaseTextEnv`` subclass)."""
    return isinstance(cls, type) and issubclass(cls, BaseTextEnv)


def _load(entry_point: Any) -> Any:
    return entry_point if callable(entry_point) else load_env_creator(entry_point)


def text_env_id(name: str) -> str:
    """The skyrl_gym registry id of ``name``: a registered id as is; an entry point ``package.module:Class``
    is imported (on the rank that calls this) and registered under that string, so that ``skyrl_gym.make``
    and SkyRL's metric aggregation find it. UnknownTextEnv when it is neither."""
    if name in skyrl_gym.registry:
        return name
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise UnknownTextEnv(f"{name!r} is not a registered skyrl_gym environment id nor an entry point "
                             "'package.module:Class'")
    try:
        cls = load_env_creator(name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment entry point {name!r} cannot be loaded: {type(exc).__name__}: {exc}") from None
    if not is_text_env(cls):
        raise ValueError(f"environment entry point {name!r} is {cls!r}, not a subclass of "
                         "skyrl_gym.envs.base_text_env.BaseTextEnv")
    skyrl_gym.register(id=name, entry_point=cls)
    return name


def text_env_class(name: str) -> type:
    """The class an id or entry point names (:func:`text_env_id`)."""
    return _load(skyrl_gym.registry[text_env_id(name)].entry_point)


# the environments whose settings SkyRL's trainer config types, with its defaults (skyrl.train.config's
# SkyRLGymConfig: search's search_url/topk/timeout/log_requests, text2sql's db_path)
TYPED_SETTINGS = {"search": "skyrl_gym.envs.search.env:SearchEnvConfig",
                  "text2sql": "skyrl_gym.envs.sql.env:Text2SQLEnvConfig"}


def env_config(settings: Mapping | None, name: str | None = None) -> DictConfig:
    """``environment.skyrl_gym.<name>`` as SkyRL passes it: an OmegaConf DictConfig (``env_config.db_path``
    and ``env_config.get("db_path")`` both work); for ``search`` and ``text2sql`` the settings over SkyRL's
    defaults, a key they do not have refused (ValueError naming it and the valid ones)."""
    settings = dict(settings or {})
    if name not in TYPED_SETTINGS:
        return OmegaConf.create(settings)
    defaults = OmegaConf.structured(load_env_creator(TYPED_SETTINGS[name]))
    unknown = sorted(set(settings) - set(defaults))
    if unknown:
        raise ValueError(f"environment.skyrl_gym.{name}.{unknown[0]}: not a setting of {name!r}; valid: "
                         f"{', '.join(defaults)}")
    return OmegaConf.merge(defaults, settings)


def make_text_env(name: str, settings: Mapping | None, extras: dict) -> BaseTextEnv:
    """One environment for one trajectory: ``skyrl_gym.make`` (so ``register(..., kwargs=...)`` applies, the
    call's ``env_config``/``extras`` over them) with ``settings`` as :func:`env_config`."""
    return skyrl_gym.make(text_env_id(name), env_config=env_config(settings, name), extras=extras)


class StepResult(NamedTuple):
    observations: list[MessageType]
    reward: float
    done: bool
    metadata: dict
    postprocessed_action: Optional[str]


def check_step_output(out: Any) -> StepResult:
    """A ``BaseTextEnvStepOutput`` made plain: numpy booleans and numbers (``np.bool_``, ``np.float32``) become
    Python ones, as SkyRL's generator uses them unchecked. ValueError naming what is malformed."""
    if not isinstance(out, Mapping):
        raise ValueError(f"step() returned {type(out).__name__}, not a BaseTextEnvStepOutput dict")
    missing = [k for k in ("observations", "reward", "done") if k not in out]
    if missing:
        raise ValueError(f"step() output lacks {missing}")
    obs = out["observations"]
    if not isinstance(obs, list) or not all(
            isinstance(m, Mapping) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
            for m in obs):
        raise ValueError("step() observations must be a list of {'role': str, 'content': str} messages, got "
                         f"{str(obs)[:120]}")
    reward = out["reward"]
    if not isinstance(reward, (numbers.Real, np.bool_)) or not math.isfinite(float(reward)):
        raise ValueError(f"step() reward must be a finite number, got {reward!r}")
    done = out["done"]
    # SkyRL reads done as a truth value: an integer 0/1 (or numpy's) is as good as a bool
    if not isinstance(done, (bool, np.bool_, numbers.Integral)) or (
            isinstance(done, numbers.Integral) and not isinstance(done, bool) and int(done) not in (0, 1)):
        raise ValueError(f"step() done must be a bool (or 0/1), got {done!r} ({type(done).__name__})")
    metadata = out.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise ValueError(f"step() metadata must be a dict, got {type(metadata).__name__}")
    action = out.get("postprocessed_action")
    if action is not None and not isinstance(action, str):
        raise ValueError(f"step() postprocessed_action must be a str or None, got {type(action).__name__}")
    return StepResult([dict(m) for m in obs], float(reward), bool(done), dict(metadata), action)


def plain_metrics(metrics: Any) -> dict:
    """``env.get_metrics()`` with numpy scalars as Python numbers (SkyRL's default aggregation averages only
    ``int``/``float`` values and would drop an ``np.float32``). ValueError when it is not a dict."""
    if not isinstance(metrics, Mapping):
        raise ValueError(f"get_metrics() must return a dict, got {type(metrics).__name__}")
    return {str(k): (v.item() if isinstance(v, np.generic) else v) for k, v in metrics.items()}


def aggregate_env_metrics(name: str, metrics: list[dict]) -> dict[str, float]:
    """The class's ``aggregate_metrics`` over its episodes' metrics (SkyRL's ``aggregate_for_environment``),
    numeric results only."""
    from skyrl_gym.metrics import aggregate_for_environment

    out = aggregate_for_environment(text_env_id(name), metrics)
    return {str(k): float(v) for k, v in out.items()
            if isinstance(v, (numbers.Real, np.generic)) and math.isfinite(float(v))}
