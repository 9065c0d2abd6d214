"""torchrun worker (4 ranks, TP2xPP2) for generator.weight_sync=tensors: every rank copies its own LoRA
shards into one shared-memory segment; the segment must hold exactly what ``save_adapter`` writes,
B multiplied by the LoRA scaling (as vLLM folds it in) under a config with alpha = r.

Usage: torchrun --nproc_per_node 4 tensor_handoff.py MODELS_DIR REFS_DIR WORK_DIR

For a PEFT adapter (all linears) and a q/v-only one: the segment's tensors (read as the safetensors
image it is) equal ``save_adapter``'s file bit for bit (B scaled) and its header carries the same
``adapter_config.json`` (alpha = r); the same with ranks 1-3 treated as on another node (their shards go to
rank 0 by point-to-point sends); after an update, the same segment, refilled, holds the new weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist

import mlora
from mlora.rollout.tensor_sync import CONFIG_KEY, TensorHandoff, image_size, prescaled_config


def check_segment(handoff: TensorHandoff, saved: Path, what: str) -> None:
    """Rank 0: the segment's image, parsed by safetensors itself, equals the saved PEFT adapter."""
    if dist.get_rank() != 0:
        return
    from safetensors import safe_open
    from safetensors.torch import load, load_file

    buf = handoff.seg.shm.buf
    image = bytes(buf[:image_size(buf)])
    got, ref = load(image), load_file(str(saved / "adapter_model.safetensors"))
    saved_config = json.loads((saved / "adapter_config.json").read_text())
    expected_config, scaling = prescaled_config(saved_config)
    assert scaling == saved_config["lora_alpha"] / saved_config["r"] and scaling != 1, scaling
    for k, v in ref.items():  # B carries the scaling, as vLLM would fold it in (lora_b *= scaling)
        if k.endswith("lora_B.weight"):
            v *= scaling
    assert sorted(got) == sorted(ref), (what, sorted(set(got) ^ set(ref))[:5])
    bad = [k for k in ref if got[k].dtype != ref[k].dtype or not torch.equal(got[k], ref[k])]
    assert not bad, (what, bad[:5])
    tmp = saved.parent / f"{saved.name}_image.safetensors"
    tmp.write_bytes(image)
    with safe_open(str(tmp), framework="pt") as f:
        config = json.loads(f.metadata()[CONFIG_KEY])
    assert config == expected_config and config["lora_alpha"] == config["r"], what
    print(f"ok: {what}: {len(ref)} tensors, {len(image)} bytes", flush=True)


@contextlib.contextmanager
def _no_segments_on(hidden: bool):
    """This process sees no shared-memory segment of another (``hidden``), as in a container of its own."""
    from mlora.rollout import tensor_sync

    real = tensor_sync._attach

    def attach(name):
        raise FileNotFoundError(f"shared-memory segment {name!r} does not exist here")

    tensor_sync._attach = attach if hidden else real
    try:
        yield
    finally:
        tensor_sync._attach = real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models_dir", type=Path)
    ap.add_argument("refs_dir", type=Path)
    ap.add_argument("work", type=Path)
    args = ap.parse_args()
    mesh = mlora.init_parallel(tp=2, pp=2)
    model = mlora.from_pretrained(args.models_dir / "llama", mesh)
    model.load_adapter("policy", args.refs_dir / "llama" / "policy", trainable=True)
    model.add_adapter("qv", mlora.LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # B starts at 0: make it count; replicated factors stay equal over TP
        for p in model.adapter_parameters("qv"):
            p.add_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) * 1e-3)
    for name in ("policy", "qv"):
        saved = args.work / f"{name}_saved"
        model.save_adapter(name, saved)
        for remote in (None, [1, 2, 3], "own /dev/shm"):
            if remote == "own /dev/shm":  # ranks 2, 3 in a container of their own: rank 0's segment is not there
                with _no_segments_on(mesh.rank in (2, 3)):
                    handoff = TensorHandoff(model, name)
                assert handoff.remote == [2, 3], handoff.remote
            else:
                handoff = TensorHandoff(model, name, remote_ranks=remote)
                assert handoff.remote == (remote or []), handoff.remote
            path = handoff.write()
            assert (path.endswith("#1") and handoff.segment in path) if mesh.rank == 0 else path == ""
            check_segment(handoff, saved, f"{name}, remote ranks {remote}")
            if name == "policy" and remote is None:  # an update: the same segment, refilled
                with torch.no_grad():
                    for p in model.adapter_parameters(name):
                        p.mul_(-2.0)
                model.save_adapter(name, args.work / "policy_updated")
                assert handoff.write().endswith("#2") or mesh.rank != 0
                check_segment(handoff, args.work / "policy_updated", "policy after an update")
                with torch.no_grad():
                    for p in model.adapter_parameters(name):
                        p.div_(-2.0)
            handoff.close()
    dist.barrier()


if __name__ == "__main__":
    main()
