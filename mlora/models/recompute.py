"""Activation recompute: megatron-core's ``recompute_granularity`` behind one keyword of the model
build, and the two things a frozen base with LoRA needs for it to be exact.

``none``: every activation is kept for the backward pass. ``selective``: megatron recomputes the
listed submodules of each layer (default ``core_attn``: the attention scores and softmax of the
unfused path, megatron's default; the SDPA core attention keeps no scores, so it saves little there;
``mlp``: the MLP's intermediate activations). ``full``: megatron keeps only the input of each
checkpointed group of layers and reruns the group's forward during backward; ``uniform`` cuts the
stage's layers into groups of ``num_layers``, ``block`` checkpoints the first ``num_layers`` layers of
the stage one by one and keeps the rest. megatron recomputes in training mode only (its selective
``mlp`` checkpoint also wraps eval passes, where there is no backward and so nothing is recomputed);
forward-only passes give the same results either way.

What mlora adds (:func:`prepare_for_recompute`):

- megatron's ``CheckpointFunction`` is reentrant: the output of a checkpointed group requires grad
  only if one of its inputs does. On the first pipeline stage the hidden states come from the frozen
  embedding and require none, so the first group's output would carry no graph and its LoRA factors
  would silently get no gradient. The embedding's output is therefore made to require grad.
- a recompute reruns LoRA dropout; its masks are keyed by each branch's call counter
  (:data:`mlora.lora.layers.DROPOUT_CALLS`), which must read what it read in the original forward.
  megatron saves and restores its RNG-states tracker around every recompute (``CheckpointFunction``,
  ``CheckpointWithoutOutput``, Transformer Engine's checkpoint), so the counters ride in the
  tracker's states (:func:`install_dropout_replay`). So do the adapter routes of a mixed-adapter
  micro-batch (:mod:`mlora.lora.routing`): megatron's 1F1B schedule recomputes one micro-batch while
  another one's routes are set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_METHODS = ("uniform", "block")
# Submodules selective recompute may name on mlora's dense layers (megatron's other choices are MoE or
# MLA parts). "layernorm" is left out: megatron-core 0.16.1's CheckpointWithoutOutput takes its FP8 branch
# for fp8=False too (``fp8 is not None``) and then needs Transformer Engine (NameError without it).
RECOMPUTE_MODULES = ("core_attn", "mlp")
DEFAULT_METHOD = "uniform"  # megatron-LM's and SkyRL's default with full recompute
DEFAULT_NUM_LAYERS = 1
DEFAULT_MODULES = ("core_attn",)  # megatron's default


@dataclass(frozen=True)
class Recompute:
    """Validated recompute settings of a model build (see :func:`recompute_settings`)."""

    granularity: str = "none"
    method: str | None = None  # full only
    num_layers: int | None = None  # full only
    modules: tuple[str, ...] | None = None  # selective only

    @property
    def enabled(self) -> bool:
        """Whether any activation is recomputed."""
        return self.granularity != "none"

    def config_kwargs(self) -> dict:
        """The TransformerConfig fields that say it to megatron."""
        if self.granularity == "none":
            return {"recompute_granularity": None}
        if self.granularity == "selective":
            return {"recompute_granularity": "selective", "recompute_modules": list(self.modules)}
        return {"recompute_granularity": "full", "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}


def _choices(values) -> str:
    return ", ".join(str(v) for v in values)


def recompute_settings(recompute: str = "none", method: str | None = None, num_layers: int | None = None,
                       modules: Sequence[str] | None = None, layers_per_stage: int | None = None,
                       key_prefix: str = "") -> Recompute:
    """Check the recompute arguments of :func:`mlora.from_pretrained` and fill the defaults.

    ``method`` (default ``uniform``) and ``num_layers`` (default 1) apply to ``recompute="full"`` only,
    ``modules`` (default ``("core_attn",)``) to ``"selective"`` only; giving one with another setting is
    an error rather than silently ignored. With ``layers_per_stage`` (the transformer layers this
    pipeline stage holds) ``num_layers`` is checked against it: ``uniform`` needs a divisor (megatron
    would index past the stage's last layer), ``block`` at most the stage's layers.
    Raises ValueError naming the argument (after ``key_prefix``, e.g. ``"trainer."``), its value and the
    valid ones.
    """
    k = key_prefix
    if recompute not in RECOMPUTE:
        raise ValueError(f"{k}recompute={recompute!r} is not valid; valid: {_choices(RECOMPUTE)}")
    for name, value, owner in (("recompute_method", method, "full"), ("recompute_num_layers", num_layers, "full"),
                               ("recompute_modules", modules, "selective")):
        if value is not None and recompute != owner:
            shown = list(value) if name == "recompute_modules" and not isinstance(value, str) else value
            raise ValueError(f"{k}{name}={shown!r} applies to {k}recompute={owner} only ({k}recompute={recompute!r})")
    if recompute == "none":
        return Recompute()
    if recompute == "selective":
        modules = DEFAULT_MODULES if modules is None else (modules,) if isinstance(modules, str) else tuple(modules)
        if not modules or any(m not in RECOMPUTE_MODULES for m in modules):
            raise ValueError(f"{k}recompute_modules={list(modules)!r} is not valid; valid: a non-empty list of "
                             f"{_choices(RECOMPUTE_MODULES)}")
        return Recompute("selective", modules=tuple(dict.fromkeys(modules)))
    method = DEFAULT_METHOD if method is None else method
    if method not in RECOMPUTE_METHODS:
        raise ValueError(f"{k}recompute_method={method!r} is not valid; valid: {_choices(RECOMPUTE_METHODS)}")
    num_layers = DEFAULT_NUM_LAYERS if num_layers is None else num_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{k}recompute_num_layers={num_layers!r} is not valid: it must be a positive integer")
    if layers_per_stage is not None:
        if method == "uniform" and layers_per_stage % num_layers:
            divisors = [d for d in range(1, layers_per_stage + 1) if layers_per_stage % d == 0]
            raise ValueError(f"{k}recompute_num_layers={num_layers} with {k}recompute_method=uniform must divide the "
                             f"{layers_per_stage} layers of each pipeline stage; valid: {_choices(divisors)}")
        if method == "block" and num_layers > layers_per_stage:
            raise ValueError(f"{k}recompute_num_layers={num_layers} with {k}recompute_method=block exceeds the "
                             f"{layers_per_stage} layers of each pipeline stage; valid: 1 to {layers_per_stage}")
    return Recompute("full", method=method, num_layers=num_layers)


class _TrackerStates(dict):
    """The tracker's states (name -> generator state, as before) plus, as attributes, the LoRA dropout
    counters and the adapter routes: whoever lists the states (megatron's checkpointing of RNG states,
    mlora's training checkpoints) sees generator states only, and whoever hands the object back restores
    both."""

    dropout_calls: list[int] | None = None
    routes: dict | None = None


class _DropoutReplay:
    """Mixed into megatron's RNG-states tracker: its states also carry the LoRA dropout counters and the
    current adapter routes (:data:`mlora.lora.routing.ROUTES`), so every checkpoint that saves the
    tracker's states before a forward and sets them before the recompute makes the recompute draw the
    original forward's masks on the original forward's rows (under the 1F1B schedule another
    micro-batch's routes are set when a recompute runs)."""

    def get_states(self):
        from mlora.lora.layers import DROPOUT_CALLS
        from mlora.lora.routing import ROUTES

        states = _TrackerStates(super().get_states())
        states.dropout_calls = list(DROPOUT_CALLS)
        states.routes = dict(ROUTES)
        return states

    def set_states(self, states):
        from mlora.lora.layers import DROPOUT_CALLS
        from mlora.lora.routing import set_routes

        super().set_states(states)
        calls = getattr(states, "dropout_calls", None)
        if calls is not None:  # branches built after the snapshot keep their counters
            DROPOUT_CALLS[:len(calls)] = calls
        routes = getattr(states, "routes", None)
        if routes is not None:
            set_routes(routes)


_REPLAY_CLASSES: dict[type, type] = {}


def install_dropout_replay() -> None:
    """Make megatron's current RNG-states tracker carry the LoRA dropout counters (idempotent).

    The tracker object stays the same (its class becomes a subclass of its own class), so
    megatron's ``isinstance`` checks and the CPU tracker of :mod:`mlora.parallel.cpu_shims` hold."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    if isinstance(tracker, _DropoutReplay):
        return
    cls = type(tracker)
    if cls not in _REPLAY_CLASSES:
        _REPLAY_CLASSES[cls] = type(f"DropoutReplay{cls.__name__}", (_DropoutReplay, cls), {})
    tracker.__class__ = _REPLAY_CLASSES[cls]


def _embedding_output_requires_grad(module, args, output):
    # A leaf without history (the embedding is frozen): flag it so that the first checkpointed group's
    # output carries a graph. Only when a backward can follow: no-grad passes stay graph-free.
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)
    return output


def _before_block(module, args):
    install_dropout_replay()  # again on every forward: a reinitialised megatron tracker gets it back


def prepare_for_recompute(gpt: torch.nn.Module, settings: Recompute) -> None:
    """Hooks on this rank's GPTModel that make ``settings`` exact with a frozen base and LoRA (see the
    module docstring); nothing with recompute off."""
    if not settings.enabled:
        return
    install_dropout_replay()
    gpt.decoder.register_forward_pre_hook(_before_block)
    if getattr(gpt, "pre_process", False):
        gpt.embedding.register_forward_hook(_embedding_output_requires_grad)
