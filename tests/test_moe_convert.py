"""tools/convert_checkpoint.py on mixtures of experts (Qwen3-MoE with a dense layer among its sparse ones,
Qwen2-MoE's gated shared expert, Mixtral's block_sparse_moe w1/w3/w2, OLMoE's full-width q/k norm, GLM-4.5's
router correction bias and ungated shared experts, DeepSeek-V3's multi-latent attention, gpt-oss's stacked
interleaved experts with their biases and its attention sinks) and Qwen3's per-head q/k norm.

In this process (TP1, EP1): HF -> megatron-core dist checkpoint -> megatron's dist_checkpointing.load into a
model built by mlora gives exactly the parameters mlora's own HF loader gives, and into a GPTModel of
megatron's own local MoE spec too; mcore -> HF gives the HF files back byte for byte, each expert's tensors
under its HF name. A checkpoint laid out as Megatron-LM writes one with an integer --moe-layer-freq and the
Transformer Engine spec (layers stacked, TE's name for the MoE layers' pre-MLP norm) converts back too.
One 2-rank launch (tests/dist/moe_convert.py) writes at EP 2, PP 2 and TP 2 (OLMoE's q/k norm split over
TP) and loads at other layouts; its checkpoints come back bit for bit here, and the EP-2 one loads at EP 1.
Plus the refusals.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_records

from mlora.formats.checkpoint_reader import CheckpointError
from mlora.models.mcore_checkpoint import CONVERT_INFO, HF_SIDE_DIR, RELEASE_DIR, mcore_to_hf
from mlora.testing import load_checkpoint_tensors

TOOL = Path(__file__).resolve().parents[1] / "tools" / "convert_checkpoint.py"
MODELS = ("qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "gpt_oss")
MOE = ("qwen3_moe", "mixtral", "olmoe")


def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _spec(model_dir: Path):
    from mlora.formats.hf_config import load_hf_config, model_spec

    return model_spec(load_hf_config(model_dir))


def _assert_same_hf_files(src: Path, out: Path) -> None:
    a, b = load_checkpoint_tensors(src), load_checkpoint_tensors(out)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    weights = sorted(p.name for p in src.iterdir() if p.suffix == ".safetensors" or p.name.endswith("index.json"))
    for file in weights:  # same files, byte for byte (header, tensor order)
        assert (src / file).read_bytes() == (out / file).read_bytes(), file
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def _load_into_mlora_model(ckpt: Path, model_dir: Path) -> tuple[dict, dict]:
    """(parameters of a model built by mlora and filled by megatron's dist_checkpointing.load from ``ckpt``,
    parameters of mlora's HF loader), both at TP1/PP1/EP1 in this process."""
    from megatron.core import dist_checkpointing

    import mlora
    from mlora.models.loader import load_shard
    from mlora.models.mcore_checkpoint import model_sharded_state_dict
    from mlora.models.megatron_build import build_gpt_model

    mesh = mlora.init_parallel(tp=1, pp=1)
    ref = load_shard(model_dir, mesh, torch.float32)
    model = build_gpt_model(ref.spec, mesh, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # everything must come from the checkpoint
    state = dist_checkpointing.load({"model": model_sharded_state_dict(model, ref.spec)}, str(ckpt))
    model.load_state_dict(state["model"], strict=True)
    return dict(model.named_parameters()), dict(ref.gpt.named_parameters())


@pytest.fixture(scope="module")
def tp1(tiny_models, tmp_path_factory) -> Path:
    """The four models converted in this process at TP1 with mlora's vocabulary padding (none at TP1)."""
    from mlora.models.mcore_checkpoint import hf_to_mcore

    out = tmp_path_factory.mktemp("moe_mcore")
    for name in MODELS:
        hf_to_mcore(tiny_models / name, out / name, make_vocab_size_divisible_by=1, progress=False)
    return out


@pytest.fixture(scope="module")
def launched(tiny_models, tmp_path_factory) -> tuple[Path, list[dict]]:
    """The 2-rank launch's checkpoints and records (see tests/dist/moe_convert.py)."""
    out = tmp_path_factory.mktemp("moe_mcore_2ranks")
    return out, run_records(2, "moe_convert.py", out / "records.json", tiny_models, out)


# ------------------------------------------------------------------ one process
@pytest.mark.quick
@pytest.mark.parametrize("name", MODELS)
def test_tp1_checkpoint_loads_into_mlora_model_and_converts_back_bit_for_bit(tp1, tiny_models, tmp_path, name):
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = tp1 / name / RELEASE_DIR
    spec = _spec(tiny_models / name)
    stored = {k: tuple(md.size) for k, md in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata.items()
              if hasattr(md, "size")}
    h = spec.hidden_size
    if spec.moe is None:  # dense: layers stacked, per-head q/k norm weights
        assert stored["decoder.layers.self_attention.q_layernorm.weight"] == (spec.num_layers, spec.head_dim)
    else:  # one key per layer; the experts stacked in global order, [gate; up] each
        moe = spec.moe
        for i in range(spec.num_layers):
            fc1 = stored.get(f"decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight")
            if i in moe.sparse_layers:
                assert fc1 == (moe.num_experts, 2 * moe.ffn_size, h)
                assert stored[f"decoder.layers.{i}.mlp.experts.experts.linear_fc2.weight"] == (
                    moe.num_experts, h, moe.ffn_size)
                assert stored[f"decoder.layers.{i}.mlp.router.weight"] == (moe.num_experts, h)
                shared = f"decoder.layers.{i}.mlp.shared_experts."  # Qwen2-MoE's shared expert and its gate
                assert (stored.get(shared + "gate_weight"), stored.get(shared + "linear_fc2.weight")) == (
                    (None, None) if moe.shared_ffn_size is None
                    else ((1, h) if moe.shared_gate else None, (h, moe.shared_ffn_size)))
                # GLM-4.5's correction bias, as megatron's moe_router_enable_expert_bias names it
                assert stored.get(f"decoder.layers.{i}.mlp.router.expert_bias") == (
                    (moe.num_experts,) if moe.expert_bias else None)
            else:  # Qwen3-MoE's mlp_only_layers: a dense MLP
                assert fc1 is None and stored[f"decoder.layers.{i}.mlp.linear_fc1.weight"] == (
                    2 * spec.intermediate_size, h)
        q_norm = {None: None, "head": (spec.head_dim,), "full": (spec.num_heads * spec.head_dim,)}[spec.qk_norm]
        if spec.mla is not None:  # DeepSeek-V3: multi-latent attention's norm of the query's low rank
            q_norm = (spec.mla.q_lora_rank,)
            assert stored["decoder.layers.0.self_attention.linear_kv_down_proj.weight"] == (
                spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim, h)
        assert stored.get("decoder.layers.0.self_attention.q_layernorm.weight") == q_norm
    if name == "qwen3_moe":
        assert spec.moe.sparse_layers == (0, 2, 3)  # layer 1 is dense: both kinds are covered
    if name == "gpt_oss":  # the sinks under megatron's key, the experts' biases stacked like their weights
        moe = spec.moe
        assert stored["decoder.layers.1.self_attention.core_attention.softmax_offset"] == (spec.num_heads,)
        assert stored["decoder.layers.1.mlp.experts.experts.linear_fc1.bias"] == (moe.num_experts, 2 * moe.ffn_size)
        assert stored["decoder.layers.1.mlp.experts.experts.linear_fc2.bias"] == (moe.num_experts, h)
        assert stored["decoder.layers.1.mlp.router.bias"] == (moe.num_experts,)
        assert stored["decoder.layers.1.self_attention.linear_proj.bias"] == (h,)

    ours, ref = _load_into_mlora_model(ckpt, tiny_models / name)
    assert sorted(ours) == sorted(ref)
    differ = [n for n in ref if not torch.equal(ours[n], ref[n])]
    assert not differ, differ
    if spec.moe is not None:
        per_expert = 4 if spec.linear_bias else 2  # fc1 and fc2 (and their biases)
        assert sum(".local_experts." in n for n in ours) == per_expert * spec.moe.num_experts * len(
            spec.moe.sparse_layers)

    out = mcore_to_hf(tp1 / name, tmp_path / "hf", progress=False)
    _assert_same_hf_files(tiny_models / name, out)
    if name == "mixtral":  # Mixtral's own expert names came back
        assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in load_checkpoint_tensors(out)


def _megatron_spec_model(spec, mesh, padded: int):
    """A GPTModel of megatron's own local decoder block spec (its MoE layer and norms, no mlora module)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from mlora.models.megatron_build import gpt_model, transformer_config

    config = transformer_config(spec, mesh, torch.float32)
    return gpt_model(spec, mesh, config, get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                                    normalization="RMSNorm"), padded)


@pytest.mark.quick
def test_megatron_own_local_moe_spec_loads_the_checkpoints(tp1, tiny_models):
    """megatron's dist_checkpointing.load into a GPTModel of megatron's own local spec (SequentialMLP experts,
    per-head q/k norms; OLMoE's full-width norm has no megatron module) takes them as they are."""
    from megatron.core import dist_checkpointing

    import mlora
    from mlora.models.loader import load_shard

    mesh = mlora.init_parallel(tp=1, pp=1)
    for name in ("qwen3", "qwen3_moe", "mixtral"):
        spec = _spec(tiny_models / name)
        model = _megatron_spec_model(spec, mesh, spec.vocab_size)
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(tp1 / name / RELEASE_DIR))
        model.load_state_dict(state["model"], strict=True)
        ours, ref = dict(model.named_parameters()), dict(load_shard(tiny_models / name, mesh).gpt.named_parameters())
        assert sorted(ours) == sorted(ref), name
        assert all(torch.equal(ours[n], ref[n]) for n in ref), name


@pytest.mark.quick
def test_stacked_te_named_moe_checkpoint_from_elsewhere_converts(tp1, tiny_models, tmp_path):
    """Megatron-LM with an integer --moe-layer-freq stacks the layers (``decoder.layers.mlp.experts.experts.
    linear_fc1.weight`` [L, E, 2·ffn, h]); its TE spec stores MoE layers' pre-MLP norm as ``pre_mlp_layernorm
    .weight``. Such a checkpoint, without mlora's side files, converts back given --hf-config."""
    from megatron.core import dist_checkpointing

    import mlora

    mesh = mlora.init_parallel(tp=1, pp=1)
    spec = _spec(tiny_models / "mixtral")
    model = _megatron_spec_model(spec, mesh, spec.vocab_size)
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(tp1 / "mixtral" / RELEASE_DIR))
    model.load_state_dict(state["model"], strict=True)
    model.config.moe_layer_freq = 1  # every layer sparse, said as Megatron-LM's default says it: layers stacked
    sharded = model.sharded_state_dict()
    for item in sharded.values():
        if getattr(item, "key", None) == "decoder.layers.mlp.linear_fc1.layer_norm_weight":
            item.key = "decoder.layers.pre_mlp_layernorm.weight"
    assert sharded["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"].key == \
        "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    dist_checkpointing.save({"model": sharded}, str(foreign))
    with pytest.raises(CheckpointError, match="--hf-config"):
        mcore_to_hf(foreign, tmp_path / "o", progress=False)
    out = mcore_to_hf(foreign, tmp_path / "hf", hf_config=tiny_models / "mixtral", progress=False)
    a, b = load_checkpoint_tensors(tiny_models / "mixtral"), load_checkpoint_tensors(out)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ two ranks
@pytest.mark.slow
def test_ep2_pp2_tp2_checkpoints_load_at_other_layouts_and_convert_back(launched, tiny_models, tmp_path):
    out, records = launched
    writes = {(r["model"], r["tp"], r["pp"], r["ep"]): r["exit"] for r in records if "exit" in r}
    assert writes == {("qwen3_moe", 1, 1, 2): 0, ("mixtral", 1, 2, 1): 0, ("olmoe", 2, 1, 2): 0, ("qwen3", 2, 1, 1): 0,
                      ("gpt_oss", 2, 1, 2): 0}
    loads = [r for r in records if "load" in r]
    assert {(r["load"], r["tp"], r["ep"], r["rank"]) for r in loads} == {
        (n, tp, ep, rank) for n, tp, ep in (("qwen3_moe", 1, 2), ("mixtral", 1, 2), ("olmoe", 2, 1), ("qwen3", 2, 1),
                                            ("gpt_oss", 2, 1)) for rank in (0, 1)}
    for r in loads:  # megatron's load into mlora's model == mlora's HF loader, on every rank
        assert r["same_names"] and r["params"] > 0 and not r["differ"], r
        if r["load"] != "qwen3":
            assert r["expert_params"] > 0, r
    for name in {name for name, *_ in writes}:  # written by several ranks, read back by one: the HF files again
        _assert_same_hf_files(tiny_models / name, mcore_to_hf(out / name, tmp_path / name, progress=False))
    # the experts written by two EP ranks, loaded at EP 1
    ours, ref = _load_into_mlora_model(out / "qwen3_moe" / RELEASE_DIR, tiny_models / "qwen3_moe")
    assert sorted(ours) == sorted(ref) and all(torch.equal(ours[n], ref[n]) for n in ref)


# ------------------------------------------------------------------ bad input
@pytest.mark.quick
def test_expert_layouts_that_do_not_fit_are_refused(tiny_models, tmp_path, capsys):
    from mlora.models.mcore_checkpoint import hf_to_mcore, ranks_needed

    tool = _tool()
    for model, flags, message in (
            ("qwen3", ["--ep", "2"], "ep=2 (expert parallelism) on Qwen3ForCausalLM, which has no experts"),
            ("mixtral", ["--ep", "3"], "ep=3 does not divide the 8 experts of MixtralForCausalLM"),
            ("mixtral", ["--ep", "0"], "--ep=0 is invalid")):
        code = tool.main(["hf-to-mcore", "--hf", str(tiny_models / model), "--out", str(tmp_path / "o"), *flags])
        assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert (ranks_needed(1, 1, 2), ranks_needed(2, 2, 2), ranks_needed(2, 1, 4)) == (2, 4, 4)
    with pytest.raises(ValueError, match=r"tp=1 × pp=1 with ep=2 needs 2 ranks, this run has 1.*"
                                         r"torchrun --nproc_per_node=2"):
        hf_to_mcore(tiny_models / "qwen3_moe", tmp_path / "o", ep=2)


@pytest.mark.quick
def test_moe_families_not_built_and_mismatched_checkpoints_are_refused(tp1, tiny_models, tmp_path, capsys):
    # a family mlora does not build (GLM-4.7-Flash's multi-latent attention): named with what it needs, before any
    # rank starts
    lite = shutil.copytree(tiny_models / "qwen3_moe", tmp_path / "glm_lite")
    cfg = json.loads((lite / "config.json").read_text())
    (lite / "config.json").write_text(json.dumps({**cfg, "architectures": ["Glm4MoeLiteForCausalLM"]}))
    assert _tool().main(["hf-to-mcore", "--hf", str(lite), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "'Glm4MoeLiteForCausalLM'" in err and "needs multi-head latent attention" in err

    # an OLMoE checkpoint from elsewhere read with Qwen3-MoE's config: the tensors give it away
    foreign = shutil.copytree(tp1 / "olmoe" / RELEASE_DIR, tmp_path / "foreign")
    shutil.rmtree(foreign / HF_SIDE_DIR)
    (foreign / CONVERT_INFO).unlink()
    with pytest.raises(CheckpointError) as exc:
        mcore_to_hf(foreign, tmp_path / "o2", hf_config=tiny_models / "qwen3_moe", progress=False)
    msg = str(exc.value)
    assert "lacks tensors Qwen3MoeForCausalLM needs: decoder.layers.1.mlp.linear_fc1.weight" in msg
    assert "decoder.layers.0.self_attention.q_layernorm.weight is (128,) in the checkpoint, the config implies (32,)" \
        in msg
    assert not (tmp_path / "o").exists() and not (tmp_path / "o2").exists()
