"""Transformer Engine backend for the frozen base (``fp8="te"``, GPU only).

UNVERIFIED: no Transformer Engine run has happened on any machine of this project. TE cannot be
installed on the CPU machines (a broken TE import also breaks ``import megatron.core``) and it is
too large to carry to the lent GPU. Everything below that touches TE -- the LoRA linears built on
megatron's TE wrappers, :func:`te_layer_spec` / :func:`te_block_spec` and
:func:`fp8_autocast_context` -- is written against megatron-core 0.16.1's
``megatron.core.extensions.transformer_engine`` and TE 2.x's documented API, and is checked only
by ``tests/gpu/check_fp8_te.py`` where a GPU *with TE* is lent. The CPU tests
(``tests/test_fp8_te.py``) cover what needs no TE: the errors, the recipe names, that importing
this module never imports ``transformer_engine``, and the mlora side of the TE linears with
stand-ins for megatron's TE wrappers (a plain local GEMM) and local core attention: the spec builds
through ``from_pretrained`` and gives the local spec's logits and LoRA gradients at TP1, TP2 and
TP2+SP -- which checks where the LoRA branch joins and that the one collective per layer is
megatron's, not what TE computes.

Importing this module never imports TE; :func:`require_te` does, lazily, and turns a missing or
broken install into one clear error naming the ``gpu`` extra.

Design (mirrors the local spec of :mod:`mlora.lora.layers` exactly, DESIGN principle 3):

* Column-parallel base (``linear_qkv``, ``linear_fc1``): megatron's :class:`TEColumnParallelLinear`
  with a *separate* mlora :class:`~mlora.models.norm.RMSNorm` in the norm slot, not the fused
  ``TELayerNormColumnParallelLinear``. Why unfused: (1) the LoRA branch must read the normalized
  input, which the fused module never exposes unless ``return_layernorm_output=True``, and that
  changes the module's return signature that megatron's attention/MLP unpack; (2) the norm weight
  keeps its local-spec name (``input_layernorm.weight`` / ``pre_mlp_layernorm.weight``), so the
  HF weight map, the loader and the merge/export code work unchanged; (3) mlora's RMSNorm has HF's
  exact arithmetic and works under sequence parallelism. The cost is one unfused norm kernel per
  layer, small next to the GEMMs.
* TE does *no* communication in these layers: after megatron's wrapper has built the weight (and
  its TP attributes, init and sharded checkpoint mapping), the TE module is switched to a local
  GEMM (``parallel_mode=None``, ``sequence_parallel=False``), and the one TP collective is
  megatron's own mapping, exactly as in the local spec:
  - column: ``copy_to_tensor_model_parallel_region`` (or the SP all-gather) once, then the base
    GEMM and the LoRA branch (A replicated, B sharded like W) both read that input; autograd sums
    their input gradients before the mapping's single backward all-reduce / reduce-scatter.
    Letting TE do the column comm would all-reduce only the base's input gradient and leave the
    LoRA branch's partial input gradient unreduced (or need a second collective).
  - row: TE's local GEMM gives this rank's partial ``x_i W_iᵀ``; the LoRA partial
    ``s·(x_i A_iᵀ) Bᵀ`` (A sharded on the input dim, B replicated) is added, and one
    ``reduce_from_tensor_model_parallel_region`` (or SP reduce-scatter) carries both. No extra
    collective.
  What is given up: TE's userbuffer comm/GEMM overlap (``tp_comm_overlap``) and TE's FP8
  all-gather of the SP input; both are optimisations, not semantics.
* FP8: only TE modules look at ``fp8_autocast``; the LoRA branch is plain ``F.linear`` in the
  adapter dtype and therefore stays outside FP8 even when the whole forward runs under
  :func:`fp8_autocast_context`. Base weights stay in the model dtype in memory (TE casts them to
  FP8 per GEMM and caches the cast across micro-batches); storing them in FP8 (TE's
  ``fp8_model_init``) is not done here. TE's recipes keep their own semantics: their scales (delayed
  or current per-tensor scaling, MXFP8 blocks) are taken on each rank's local GEMM operands, so the
  torch backend's mesh independence (weight and input scales over whole rows, :mod:`mlora.fp8.quant`)
  is not promised here.
* Core attention is megatron's ``TEDotProductAttention`` with ``attn_mask_type=arbitrary``: mlora
  passes a full boolean ``[B, 1, S, S]`` mask (causal + padding + sliding window, True = masked),
  which TE's "arbitrary" type reads as given. A ``padding_causal`` / THD path would be faster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

GPU_EXTRA_HINT = ("install the `gpu` extra on a CUDA machine: pip install 'mlora[gpu]' (Transformer Engine); "
                  "fp8=\"torch\" (torch._scaled_mm) works without Transformer Engine, on CPU and GPU")

RECIPES = ("delayed", "current", "mxfp8")
"""``fp8_autocast`` recipes: delayed scaling (amax history), current (per-tensor, just-in-time)
scaling, MXFP8 block scaling (Blackwell, compute capability >= 10.0)."""

# megatron TransformerConfig.fp8_recipe names of the same recipes (config-driven autocast).
MEGATRON_RECIPE = {"delayed": "delayed", "current": "tensorwise", "mxfp8": "mxfp8"}

MIN_FP8_CAPABILITY = (8, 9)  # Ada / Hopper: FP8 tensor cores
MIN_MXFP8_CAPABILITY = (10, 0)  # Blackwell


class TransformerEngineUnavailable(ImportError):
    """Transformer Engine is missing or cannot be imported (``fp8="te"`` asked for)."""


class FP8DeviceUnsupported(RuntimeError):
    """No CUDA device, or one without FP8 support for the asked recipe."""


def require_te(fp8: bool = True, recipe: str | None = None):
    """``transformer_engine`` (imported now, lazily) or a clear error.

    A missing TE raises :class:`TransformerEngineUnavailable` (an ImportError) naming the ``gpu``
    extra. So does a *broken* one: an install without CUDA/cuDNN raises e.g. ``RuntimeError:
    cudnn shared object not found`` on import, hence ``except Exception``. With ``fp8=True`` the
    current CUDA device must also support FP8 (compute capability >= 8.9; >= 10.0 for
    ``recipe="mxfp8"``), else :class:`FP8DeviceUnsupported`. ``fp8=False`` (TE in bf16) needs TE only.
    """
    if recipe is not None:
        check_recipe(recipe)
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine.pytorch as te_pytorch  # noqa: F401
    except Exception as e:  # ImportError when missing; RuntimeError/OSError when broken (no cuDNN, no CUDA)
        raise TransformerEngineUnavailable(
            f'fp8="te" needs NVIDIA Transformer Engine, which cannot be imported here '
            f"({type(e).__name__}: {e}); {GPU_EXTRA_HINT}") from e
    if fp8:
        check_fp8_device(recipe)
    import transformer_engine
    return transformer_engine


def check_fp8_device(recipe: str | None = None, device: int | torch.device | None = None) -> tuple[int, int]:
    """The compute capability of the CUDA ``device`` (default: current), or a clear error when it
    cannot run FP8 GEMMs (< 8.9) or, for ``recipe="mxfp8"``, MXFP8 (< 10.0)."""
    if not torch.cuda.is_available():
        raise FP8DeviceUnsupported(
            'fp8="te" runs FP8 GEMMs on a CUDA GPU with compute capability >= 8.9 (Ada, Hopper, Blackwell); '
            'no CUDA device is available here. fp8="torch" runs on CPU.')
    cap = tuple(torch.cuda.get_device_capability(device))
    name = torch.cuda.get_device_name(device)
    if cap < MIN_FP8_CAPABILITY:
        raise FP8DeviceUnsupported(
            f"{name} has compute capability {cap[0]}.{cap[1]}; FP8 GEMMs need >= 8.9 (Ada, Hopper, Blackwell). "
            f"Use fp8=None (bf16) on this GPU.")
    if recipe == "mxfp8" and cap < MIN_MXFP8_CAPABILITY:
        raise FP8DeviceUnsupported(
            f'fp8 recipe "mxfp8" needs compute capability >= 10.0 (Blackwell); {name} has {cap[0]}.{cap[1]}. '
            f'Use recipe "delayed" or "current".')
    return cap


def check_recipe(recipe: str) -> str:
    """``recipe`` if it is one of :data:`RECIPES`, else a ValueError listing them (needs no TE)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {', '.join(RECIPES)} "
                         f"(delayed scaling, current scaling = Float8CurrentScaling, MXFP8 block scaling on Blackwell)")
    return recipe


def fp8_recipe(recipe: str = "delayed", fp8_format: str = "hybrid"):
    """The TE recipe object for ``recipe`` (UNVERIFIED).

    ``fp8_format``: "hybrid" (e4m3 forward, e5m2 gradients; TE's and megatron's default for
    training) or "e4m3" (e4m3 everywhere). MXFP8 always uses e4m3 data with its block scales.
    """
    check_recipe(recipe)
    if fp8_format not in ("hybrid", "e4m3"):
        raise ValueError(f"unknown FP8 format {fp8_format!r}; choose 'hybrid' or 'e4m3'")
    require_te(fp8=False)
    from transformer_engine.common import recipe as te_recipe

    fmt = te_recipe.Format.HYBRID if fp8_format == "hybrid" else te_recipe.Format.E4M3
    if recipe == "delayed":
        return te_recipe.DelayedScaling(fp8_format=fmt, amax_history_len=16, amax_compute_algo="max")
    if recipe == "current":
        return te_recipe.Float8CurrentScaling(fp8_format=fmt)
    return te_recipe.MXFP8BlockScaling()


def fp8_autocast_context(recipe: str = "delayed", enabled: bool = True, fp8_group=None, fp8_format: str = "hybrid"):
    """``transformer_engine.pytorch.fp8_autocast`` with the named recipe (UNVERIFIED).

    Wrap a forward (and its backward-producing loss) with it: the TE base GEMMs run in FP8, the
    LoRA branch (plain torch ops) is untouched. ``fp8_group``: the amax reduction group for delayed
    scaling (megatron uses its amax reduction group; None = the default world group). An unknown
    recipe is a ValueError even without TE; a missing TE or a GPU without FP8 a clear error.
    ``enabled=False`` returns a null context without touching TE.
    """
    check_recipe(recipe)
    if not enabled:
        return contextlib.nullcontext()
    require_te(fp8=True, recipe=recipe)
    import transformer_engine.pytorch as te_pytorch

    rec = fp8_recipe(recipe, fp8_format)
    autocast = getattr(te_pytorch, "fp8_autocast", None)
    if autocast is not None:
        return autocast(enabled=True, fp8_recipe=rec, fp8_group=fp8_group)
    return te_pytorch.autocast(enabled=True, recipe=rec, amax_reduction_group=fp8_group)  # TE >= 2.8 name


def megatron_fp8_settings(recipe: str, fp8_format: str = "hybrid") -> dict:
    """TransformerConfig fields that make megatron wrap its transformer block in the same
    ``fp8_autocast`` itself (an alternative to :func:`fp8_autocast_context`): ``fp8``, ``fp8_recipe``."""
    check_recipe(recipe)
    return {"fp8": fp8_format, "fp8_recipe": MEGATRON_RECIPE[recipe]}


def reset_fp8_weight_cache(model: torch.nn.Module) -> int:
    """Make every TE linear of ``model`` recast its weight to FP8 at its next forward (UNVERIFIED).

    megatron's TE wrappers pass ``is_first_microbatch`` to TE, which then casts the weight once
    and reuses the cached FP8 copy: right for a frozen base within one recipe. Call this after
    changing the recipe (or the base weights). Returns the number of modules reset (no TE needed).
    """
    n = 0
    for module in model.modules():
        if hasattr(module, "is_first_microbatch"):
            module.is_first_microbatch = True
            n += 1
    return n


# ---------------------------------------------------------------------------- TE LoRA linears

def _local_gemm_only(module) -> None:
    """Make a TE linear a plain local GEMM: TE skips its input all-gather / output reduction; the
    caller does megatron's single collective instead (see the module docstring)."""
    module.parallel_mode = None
    module.sequence_parallel = False


@functools.lru_cache(maxsize=None)
def te_lora_linear_classes():
    """``(LoraTEColumnParallelLinear, LoraTERowParallelLinear)`` (UNVERIFIED).

    Built on first call: the megatron TE wrappers are imported only here, after
    :func:`require_te`, so that importing :mod:`mlora.models.te` never imports TE.
    """
    require_te(fp8=False)
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear

    from mlora.lora.layers import LoraHost, add_deltas, branch_deltas, column_input, row_output

    def _tp_size(group) -> int:
        return group.size() if group is not None else 1

    class LoraTEColumnParallelLinear(LoraHost, TEColumnParallelLinear):
        """megatron's TEColumnParallelLinear (TE GEMM, FP8 under ``fp8_autocast``) with LoRA
        branches inside megatron's single TP collective (A replicated, B sharded like W)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.mlora_tp_group = self._tp_group
            self.mlora_sequence_parallel = bool(self.config.sequence_parallel) and _tp_size(self._tp_group) > 1
            _local_gemm_only(self)
            self._init_lora()
            self.weight_scale = None  # the torch-FP8 per-row scale of the local spec; TE keeps its own

        def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                    runtime_gather_output: bool | None = None):
            if weight is not None:
                raise ValueError("LoraTEColumnParallelLinear does not take an external weight")
            if runtime_gather_output:
                raise ValueError("Transformer Engine linears do not gather their output")
            x = column_input(input_, self.mlora_sequence_parallel, self.mlora_tp_group)
            out, bias = super().forward(x)  # TE GEMM on the gathered input, no collective
            # plain torch: never under FP8; routed branches as in the local spec's mixed-precision path
            branches, routes = self._routed_branches()
            out = add_deltas(out, branch_deltas(branches, x, self.lora_site, routes))
            return out, bias

    class LoraTERowParallelLinear(LoraHost, TERowParallelLinear):
        """megatron's TERowParallelLinear (TE GEMM, FP8 under ``fp8_autocast``) with the LoRA
        partial (A sharded on the input dim, B replicated) added before megatron's one reduction."""

        def __init__(self, *args, **kwargs) -> None:
            if kwargs.get("bias"):
                # TE adds a bias inside its GEMM, i.e. before the reduction that now happens
                # outside TE: it would be summed TP times. mlora's models have no o_proj/down_proj bias.
                raise NotImplementedError("LoraTERowParallelLinear: a row-parallel bias is not supported "
                                          "(add_bias_linear=False in mlora's configs)")
            super().__init__(*args, **kwargs)
            self.mlora_tp_group = self._tp_group
            self.mlora_sequence_parallel = bool(self.config.sequence_parallel) and _tp_size(self._tp_group) > 1
            _local_gemm_only(self)
            self._init_lora()
            self.weight_scale = None

        def forward(self, input_: torch.Tensor):
            out, bias = super().forward(input_)  # this rank's partial x_i W_iᵀ; TE does not reduce
            # input_ is this rank's slice of the features; dropout applies this slice of the full mask
            branches, routes = self._routed_branches()
            out = add_deltas(out, branch_deltas(branches, input_, self.lora_site, routes))
            return row_output(out, self.mlora_sequence_parallel, self.mlora_tp_group), bias

    return LoraTEColumnParallelLinear, LoraTERowParallelLinear


def is_te_lora_linear(module) -> bool:
    """Whether ``module`` is one of the TE LoRA linears (False without building them)."""
    if te_lora_linear_classes.cache_info().currsize == 0:
        return False
    return isinstance(module, te_lora_linear_classes())


# ---------------------------------------------------------------------------- specs

def te_layer_spec(config=None):
    """mlora's tested local layer spec with the Transformer Engine modules swapped in (UNVERIFIED).

    The same modules as megatron's ``get_gpt_layer_with_transformer_engine_spec()`` except that
    the norm stays unfused (see the module docstring); built from megatron's local spec (the one
    :func:`mlora.models.megatron_build.block_spec` uses and the CPU tests hold to HF/PEFT) so that
    only these slots differ from it:

    - ``linear_qkv``, ``linear_fc1``: ``LoraTEColumnParallelLinear``; ``linear_proj``,
      ``linear_fc2``: ``LoraTERowParallelLinear``;
    - ``input_layernorm``, ``pre_mlp_layernorm``: mlora's RMSNorm (as in the local spec);
    - core attention: ``TEDotProductAttention``, ``attn_mask_type=arbitrary`` (mlora's full
      boolean mask: causal, padding, sliding window).

    ``config`` (megatron TransformerConfig) is accepted for symmetry with :func:`te_block_spec`;
    the layer spec does not depend on it. Without TE: :class:`TransformerEngineUnavailable`
    naming the ``gpu`` extra.
    """
    require_te(fp8=False)
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    col, row = te_lora_linear_classes()
    return _swap_te_spec(col, row, TEDotProductAttention)


def _swap_te_spec(col, row, core_attention):
    """The swaps of :func:`te_layer_spec` on megatron's local GPT layer spec (separate so that the
    CPU tests can check the wiring with stand-in classes)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    from mlora.models.norm import RMSNorm

    layer = get_gpt_layer_local_spec(normalization="RMSNorm")
    sub = layer.submodules
    attn = sub.self_attention
    attn.params = {**(attn.params or {}), "attn_mask_type": AttnMaskType.arbitrary}
    attn.submodules = dataclasses.replace(attn.submodules, linear_qkv=col, linear_proj=row,
                                          core_attention=core_attention)
    sub.mlp.submodules = dataclasses.replace(sub.mlp.submodules, linear_fc1=col, linear_fc2=row)
    layer.submodules = dataclasses.replace(sub, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm)
    return layer


def te_block_spec(config):
    """Drop-in for :func:`mlora.models.megatron_build.block_spec` with the TE layer spec
    (UNVERIFIED): this stage's layers and mlora's final RMSNorm."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from mlora.models.norm import RMSNorm

    layer = te_layer_spec(config)
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config), layer_norm=RMSNorm)
