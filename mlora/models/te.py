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
megatron's, not what TE computes. ``tests/test_te_decisions.py`` checks mlora's decisions against fakes
that apply TE's rules: the padded token counts, the mask type per layout, the FP8 weight-cast flag per call.

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
* Core attention is megatron's ``TEDotProductAttention`` with the mask type chosen per call from the
  layout (:func:`te_mask_type`): padded micro-batches (``sbhd``) get ``arbitrary`` with mlora's full
  boolean ``[B, 1, S, S]`` mask (causal + padding + sliding window, True = masked), which TE reads as
  given; packed ones (``thd``) get ``padding_causal`` with the boundaries in ``cu_seqlens`` and the
  sliding window as TE's ``window_size`` (TE asserts a ``padding*`` type for ``thd``, and megatron
  rewrites only ``causal``/``no_mask`` to it).
* Shapes: TE's FP8 GEMMs need the token count of every operand to be a multiple of 8 (32 for MXFP8);
  :class:`mlora.MLoraModel` right-pads micro-batches to :func:`te_padded_length` (see
  :func:`te_token_multiple`), masks the padding and drops its logits.
* The FP8 weight cache: megatron's TE linears pass ``is_first_microbatch`` to TE (True: cast the weight to
  FP8 and cache it; False: reuse the cache) and clear it after each call; megatron's schedules set it again
  at the first micro-batch of every forward/backward call (``forward_step`` -> ``set_is_first_microbatch``),
  but only when ``config.fp8`` is set. :meth:`mlora.MLoraModel.forward_backward` calls
  :func:`reset_fp8_weight_cache` at the start of every call, so the weight is also recast under an
  external :func:`fp8_autocast_context` (``config.fp8`` unset). That matters for delayed scaling: the base
  never changes, but its scale does (amax history, updated after each autocast), and the very first cast
  runs at TE's initial scale of 1, where weights of ~0.02 fall into e4m3's subnormal range.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

GPU_EXTRA_HINT = ("set up a CUDA machine with bash scripts/setup_gpu.sh (the `gpu` extra: vLLM and Transformer Engine, "
                  "built against the pinned torch); "
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
    """Make every TE linear of ``model`` recast its weight to FP8 at its next forward (needs no TE).

    megatron's TE wrappers pass ``is_first_microbatch`` to TE, which casts the weight to FP8 when it is
    True, caches the cast and reuses it while it is False; the wrappers clear the flag after each call.
    Megatron's schedules set it again at the first micro-batch of every forward/backward call (via
    ``MegatronModule.set_is_first_microbatch``, which does nothing unless ``config.fp8`` is set);
    :meth:`mlora.MLoraModel.forward_backward` calls this at the start of every call, config or not, so
    that delayed scaling's updated scales reach the weight (see the module docstring). Returns the
    number of modules reset.
    """
    n = 0
    for module in model.modules():
        if hasattr(module, "is_first_microbatch"):
            module.is_first_microbatch = True
            n += 1
    return n


# ---------------------------------------------------------------------------- FP8 shapes

# TE's rule for an FP8 GEMM operand (input [tokens..., in], weight [out, in]): transformer_engine/pytorch/
# utils.py ``assert_dim_for_fp8_exec`` (called by Linear's forward under FP8) needs the product of all
# dims but the last to be a multiple of 8 and the last a multiple of 16. MXFP8 quantizes 32-element
# blocks along both dims (constants.MXFP8_BLOCK_SCALING_SIZE = 32; csrc/quantizer.cpp's MXFP8Quantizer
# checks "MXFP8 requires tensor dims that are divisible by 32"). Feature dims are the model's (checked by
# TE at the first GEMM); the token dim is the micro-batch's, which mlora pads.
FP8_TOKEN_MULTIPLE = 8
MXFP8_BLOCK = 32


def recipe_name(recipe: str) -> str:
    """mlora's name of an FP8 recipe given either its name (:data:`RECIPES`) or megatron's
    (``TransformerConfig.fp8_recipe``: delayed, tensorwise, mxfp8); a ValueError naming both otherwise."""
    if recipe in RECIPES:
        return recipe
    for name, megatron_name in MEGATRON_RECIPE.items():
        if recipe == megatron_name:
            return name
    raise ValueError(f"unknown FP8 recipe {recipe!r}; choose one of {', '.join(RECIPES)} "
                     f"(megatron's names: {', '.join(MEGATRON_RECIPE.values())})")


def te_token_multiple(recipe: str) -> int:
    """The multiple of which the token count of every TE FP8 GEMM operand must be under ``recipe`` (mlora's
    or megatron's name): 8 for delayed and current (per-tensor) scaling, 32 for MXFP8 blocks."""
    return MXFP8_BLOCK if recipe_name(recipe) == "mxfp8" else FP8_TOKEN_MULTIPLE


def te_padded_length(batch: int, seq: int, seq_multiple: int, token_multiple: int) -> int:
    """The smallest length ``L >= seq`` with ``L % seq_multiple == 0`` (TP under sequence parallelism, which
    splits the sequence) and ``batch * L % token_multiple == 0`` (:func:`te_token_multiple`; 1 without FP8).

    The whole ``batch * L`` counts, not a TP shard of it: mlora's TE linears run TE as a local GEMM on the
    sequence-parallel *gathered* input (column) or on all tokens before the reduce-scatter (row), see the
    module docstring. For a packed row ``batch`` is 1.
    """
    for name, value in (("batch", batch), ("seq", seq), ("seq_multiple", seq_multiple),
                        ("token_multiple", token_multiple)):
        if value < 1:
            raise ValueError(f"te_padded_length: {name}={value} must be >= 1")
    length = -(-seq // seq_multiple) * seq_multiple
    while (batch * length) % token_multiple:  # ends by the next multiple of lcm(seq_multiple, token_multiple)
        length += seq_multiple
    return length


# ---------------------------------------------------------------------------- attention mask type

def te_mask_type(qkv_format: str):
    """TE's attention mask type for a micro-batch in ``qkv_format`` (megatron ``AttnMaskType``).

    ``thd`` (packed): ``padding_causal``; TE asserts a ``padding*`` type for ``thd`` (its varlen kernels
    take the segments from ``cu_seqlens``, no mask tensor), and megatron rewrites only ``causal`` and
    ``no_mask`` to one, not the ``arbitrary`` mlora uses otherwise. ``sbhd``/``bshd`` (padded):
    ``arbitrary``, mlora's full boolean mask (causal, padding, window) read as given.
    """
    from megatron.core.transformer.enums import AttnMaskType

    if qkv_format == "thd":
        return AttnMaskType.padding_causal
    if qkv_format in ("sbhd", "bshd"):
        return AttnMaskType.arbitrary
    raise ValueError(f"qkv_format {qkv_format!r} is not one of thd, sbhd, bshd")


def te_window_size(qkv_format: str, sliding_window: int | None) -> tuple[int, int]:
    """TE's ``window_size`` (keys ``[i - left, i + right]``, inclusive) for :func:`te_mask_type`'s type.

    ``thd``: ``(sliding_window - 1, 0)`` (HF's window ``w`` lets a query see ``w`` keys, itself included,
    as :func:`mlora.models.attention.attention_mask`), ``(-1, 0)`` without one. Padded layouts: ``(-1, -1)``,
    the window is in the boolean mask already.
    """
    te_mask_type(qkv_format)  # the format check
    if qkv_format != "thd":
        return (-1, -1)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 or None")
    return (-1, 0) if sliding_window is None else (sliding_window - 1, 0)


@functools.lru_cache(maxsize=None)
def _te_core_attention(base: type) -> type:
    """``base`` (megatron's ``TEDotProductAttention``) with the mask type and window chosen per call from the
    layout (UNVERIFIED with real TE). Keyed by ``base`` so that a stand-in base gets its own subclass."""
    from mlora.models.attention import WINDOW_CONFIG_ATTR

    class MLoraTEDotProductAttention(base):
        """megatron's TEDotProductAttention given :func:`te_mask_type` and :func:`te_window_size` per call."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):
            fmt = packed_seq_params.qkv_format if packed_seq_params is not None else "sbhd"
            # TE's forward reads self.window_size when megatron's wrapper passes none (it never does)
            self.window_size = te_window_size(fmt, getattr(self.config, WINDOW_CONFIG_ATTR, None))
            return super().forward(query, key, value, attention_mask, te_mask_type(fmt),
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)

    return MLoraTEDotProductAttention


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
    - core attention: ``TEDotProductAttention`` given the mask type of each call's layout
      (:func:`te_mask_type`; the spec's ``attn_mask_type=arbitrary`` is the padded layout's).

    ``config`` (megatron TransformerConfig) is accepted for symmetry with :func:`te_block_spec`;
    the layer spec does not depend on it. Without TE: :class:`TransformerEngineUnavailable`
    naming the ``gpu`` extra.
    """
    require_te(fp8=False)
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    col, row = te_lora_linear_classes()
    return _swap_te_spec(col, row, _te_core_attention(TEDotProductAttention))


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
