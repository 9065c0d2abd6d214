"""The registry of environments by name (``environment.env_class``, a prompt row's ``env_class``)."""

from __future__ import annotations

from typing import Callable

_REGISTRY: dict[str, Callable] = {}


def register_env(name: str):
    """Class decorator: ``@register_env("my_task")`` makes ``environment.env_class=my_task`` work."""

    def wrap(cls):
        if name in _REGISTRY:
            raise ValueError(f"environment {name!r} is already registered")
        _REGISTRY[name] = cls
        return cls

    return wrap


def env_class(name: str):
    """The class registered as ``name``; ValueError naming the registered ones."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown env_class {name!r}; registered: {', '.join(sorted(_REGISTRY))} "
                         "(add your own with mlora.rollout.envs.register_env or mlora.rollout.gym.register)")
    return _REGISTRY[name]


def registered_envs() -> list[str]:
    return sorted(_REGISTRY)
