"""``experiments``: K named variants of one RL run on one frozen base (A/B tests, multi-task RL).

An experiment overrides what may differ between variants trained side by side on the same base and
engines: data, environment and reward, algorithm (estimator, KL, clipping, rollout correction), its
adapters' LoRA shape, optimizers, sampling, batch sizes, seed and length. Everything else (the base
model, mesh, dtype/FP8, engines, micro-batching, recompute, checkpointing, logging) is one for the job:
an experiment that sets it is refused, naming the key.

Two spellings, both YAML and command line::

    experiments:                         experiments:
      - name: kl_low                       kl_low: {trainer.algorithm.kl_loss_coef: 0.001}
        trainer.algorithm.kl_loss_coef: 0.001   kl_high: {trainer: {algorithm: {kl_loss_coef: 0.1}}}
      - {name: kl_high, trainer: {algorithm: {kl_loss_coef: 0.1}}}

Overrides may be nested or dotted. Each experiment's configuration is the run's configuration with its
overrides applied, type-checked against the schema and validated like a whole run
(:func:`mlora.config.validate.finalize` does both and attaches the results: :func:`experiment_configs`).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from mlora.config.errors import ConfigError
from mlora.config.schema import TrainConfig, lora_max_rank

# Keys an experiment may set: a key equal to one of these or below one ("a.b" covers "a.b.c").
PER_EXPERIMENT_KEYS = (
    "data.train_data", "data.val_data",
    "environment", "reward_model",
    "trainer.algorithm",
    "trainer.policy.optimizer_config", "trainer.critic.optimizer_config",
    *(f"trainer.{role}.model.lora.{k}" for role in ("policy", "critic")
      for k in ("rank", "alpha", "dropout", "target_modules", "exclude_modules", "init_method")),
    "trainer.seed", "trainer.epochs", "trainer.total_steps", "trainer.max_training_steps",
    "trainer.train_batch_size", "trainer.policy_mini_batch_size", "trainer.critic_mini_batch_size",
    "trainer.update_epochs_per_batch",
    "generator.sampling_params", "generator.eval_sampling_params", "generator.n_samples_per_prompt",
    "generator.eval_n_samples_per_prompt", "generator.zero_reward_on_non_stop", "generator.apply_overlong_filtering",
    "generator.max_turns", "generator.turn_rewards", "generator.use_conversation_multi_turn",
)
# PER_EXPERIMENT_KEYS as a person reads them (in errors)
PER_EXPERIMENT_TEXT = ("data.train_data, data.val_data, environment.*, reward_model.*, trainer.algorithm.*, "
                       "trainer.{policy,critic}.optimizer_config.*, trainer.{policy,critic}.model.lora.{rank, alpha, "
                       "dropout, target_modules, exclude_modules, init_method}, trainer.{seed, epochs, total_steps, "
                       "max_training_steps, train_batch_size, policy_mini_batch_size, critic_mini_batch_size, "
                       "update_epochs_per_batch}, generator.{sampling_params, eval_sampling_params}.*, "
                       "generator.{n_samples_per_prompt, eval_n_samples_per_prompt, zero_reward_on_non_stop, "
                       "apply_overlong_filtering, max_turns, turn_rewards, use_conversation_multi_turn}")
SHARED_WHY = ("the base model, its mesh, dtype/FP8, the engines, micro-batching, recompute, checkpoints and logging "
              "are one for the whole job")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
RESOLVED = "resolved_experiments"  # the attribute finalize() attaches to a TrainConfig (not a config key)
_LEAF_DICTS = ("environment.skyrl_gym",)  # dict-typed keys whose entries are values, not sub-keys


@dataclass(frozen=True)
class ExperimentSpec:
    """One experiment as the user wrote it: its name and its overrides as dotted keys."""

    name: str
    overrides: dict[str, Any]

    def as_config(self) -> dict[str, Any]:
        """The normalized form kept in the run's configuration (``config.yaml`` of checkpoints)."""
        return {"name": self.name, **self.overrides}


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    """Whether dotted ``key`` is one of ``prefixes`` or below one."""
    return any(key == k or key.startswith(k + ".") for k in prefixes)


def is_per_experiment(key: str) -> bool:
    """Whether an experiment may set ``key`` (a dotted config key)."""
    return _under(key, PER_EXPERIMENT_KEYS)


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    """Nested and dotted mappings as ``{dotted key: leaf}``; lists stay values (e.g. data.train_data)."""
    if isinstance(value, dict) and not _under(prefix, _LEAF_DICTS):
        for k, v in value.items():
            if not isinstance(k, str) or not k:
                raise ConfigError(f"experiments: key {k!r} under {prefix or 'an experiment'} is not a config key name")
            _flatten(v, f"{prefix}.{k}" if prefix else k, out)
    else:
        out[prefix] = value
    return out


def _plain(value: Any) -> Any:
    """OmegaConf containers as plain Python (the field is typed Any: lists and dicts come as containers)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def experiment_specs(raw: Any) -> list[ExperimentSpec]:
    """The ``experiments`` value (a list of mappings with ``name``, or a mapping name -> overrides) as specs,
    in order. Raises :class:`ConfigError` for a malformed value, a bad or repeated name, or a key an
    experiment may not set (naming it)."""
    raw = _plain(raw)
    if isinstance(raw, dict):
        items = []
        for name, body in raw.items():
            body = {} if body is None else body
            if not isinstance(body, dict):
                raise ConfigError(f"experiments.{name}={body!r}: an experiment is a mapping of config keys to values")
            if "name" in body and body["name"] != name:
                raise ConfigError(f"experiments.{name}.name={body['name']!r} differs from its key {name!r}")
            items.append((str(name), {k: v for k, v in body.items() if k != "name"}))
    elif isinstance(raw, list):
        items = []
        for i, body in enumerate(raw):
            if not isinstance(body, dict) or "name" not in body:
                raise ConfigError(f"experiments[{i}]={body!r}: each experiment is a mapping with a 'name' and the "
                                  "config keys it overrides, e.g. {name: kl_high, trainer.algorithm.kl_loss_coef: 0.1}")
            items.append((str(body["name"]), {k: v for k, v in body.items() if k != "name"}))
    else:
        raise ConfigError(f"experiments={raw!r}: give a list of experiments ([{{name: a, ...}}, ...]) or a mapping "
                          "(name: {overrides})")
    if not items:
        raise ConfigError("experiments is empty: give at least one experiment, or leave experiments unset")
    specs, seen = [], set()
    for i, (name, body) in enumerate(items):
        where = f"experiments[{i}] {name!r}"
        if not NAME.fullmatch(name):
            raise ConfigError(f"{where}: an experiment name names adapters, metrics and folders, so it may hold "
                              "letters, digits, '_' and '-' only, starting with a letter or digit")
        if name in seen:
            raise ConfigError(f"{where}: two experiments are named {name!r}; names must be unique")
        seen.add(name)
        flat = _flatten(body, "", {})
        for key in flat:
            if not is_per_experiment(key):
                raise ConfigError(f"{where}: {key} cannot differ per experiment ({SHARED_WHY}); set it outside "
                                  f"experiments. An experiment may set: {PER_EXPERIMENT_TEXT}")
        specs.append(ExperimentSpec(name, flat))
    return specs


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def apply_overrides(base: TrainConfig, spec: ExperimentSpec, index: int) -> TrainConfig:
    """A copy of ``base`` (not yet finalized) with ``spec``'s overrides, type-checked against the schema;
    its own ``experiments`` unset."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = copy.deepcopy(base)
    cfg.experiments = None
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.create(_nested(spec.overrides)))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"experiments[{index}] {spec.name!r}: {str(exc).splitlines()[0]}") from None


def experiment_configs(cfg: TrainConfig) -> dict[str, TrainConfig] | None:
    """The finalized configuration of each experiment, in order, as :func:`mlora.config.validate.finalize`
    attached them; None when the run has no ``experiments``."""
    if cfg.experiments is None:
        return None
    resolved = getattr(cfg, RESOLVED, None)
    if resolved is None:
        raise ValueError("experiments are set but the configuration was not finalized "
                         "(mlora.config.validate.finalize resolves each experiment's configuration)")
    return resolved


def check_engines_fit(cfg: TrainConfig, configs: dict[str, TrainConfig]) -> None:
    """The engines serve one policy adapter per experiment at once: vLLM's ``max_loras`` (and
    ``max_cpu_loras``), when the user sets them, must hold them all, and ``max_lora_rank`` the largest rank."""
    from mlora.rollout.serve import VLLM_LORA_RANKS

    extra, k = cfg.generator.engine_init_kwargs, len(configs)
    for key in ("max_loras", "max_cpu_loras"):
        if extra.get(key) is not None and int(extra[key]) < k:
            raise ConfigError(f"generator.engine_init_kwargs.{key}={extra[key]}: the engines serve one policy adapter "
                              f"per experiment at once ({k} experiments: {', '.join(configs)}); set it >= {k} or "
                              "leave it unset (mlora sets max_loras to the number of experiments)")
    ranks = {name: lora_max_rank(c.trainer.policy.model.lora) for name, c in configs.items()}
    top = max(ranks.values())
    if top > VLLM_LORA_RANKS[-1]:
        name = max(ranks, key=ranks.get)
        raise ConfigError(f"experiment {name!r}: trainer.policy.model.lora.rank={top} exceeds the largest LoRA rank "
                          f"vLLM serves ({VLLM_LORA_RANKS[-1]}); valid: 1 to {VLLM_LORA_RANKS[-1]}")
    if extra.get("max_lora_rank") is not None and int(extra["max_lora_rank"]) < top:
        raise ConfigError(f"generator.engine_init_kwargs.max_lora_rank={extra['max_lora_rank']} is below the largest "
                          f"policy rank of the experiments ({', '.join(f'{n}: {r}' for n, r in ranks.items())}); "
                          f"set it >= {top} or leave it unset")
