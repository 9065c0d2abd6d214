"""torchrun worker: mlora logits vs transformers and vs the unfused attention path at several
layouts, for right-padded, unpadded and left-padded batches; round trip; bytes read.

Usage: torchrun --nproc_per_node N tests/dist/hf_equivalence.py MODELS_DIR OUT_JSON LAYOUTS [--roundtrip DIR]
LAYOUTS is "tp,pp[,sp];..." (DP = world // (tp*pp); a third field "sp" turns on sequence parallel). Rank 0 writes one JSON record per check.
"""

from __future__ import annotations

import argparse
import glob
from pathlib import Path

import torch
from common import parse_layouts, write_records_and_exit

import mlora
from mlora.parallel import reset_parallel
from mlora.testing import right_padded_batch

MODELS = ("llama", "qwen2", "mistral")


def batches(dp_rank: int, vocab: int) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Batches of 19-token rows (odd, so SP must pad; longer than Mistral's window of 8), different
    on each DP rank: right-padded (lengths 19, 13, 5; SDPA runs causal without a mask), unpadded
    (``attention_mask=None``), left-padded (the same rows flipped; SDPA needs the full mask)."""
    ids, mask = right_padded_batch(vocab, (19, 13, 5), seed=100 + dp_rank)
    full, _ = right_padded_batch(vocab, (19, 19, 19), seed=200 + dp_rank)
    return {"right_pad": (ids, mask), "no_pad": (full, None), "left_pad": (ids.flip(1), mask.flip(1))}


_hf_models: dict[Path, torch.nn.Module] = {}


def hf_logits(model_dir: Path, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    if model_dir not in _hf_models:
        _hf_models[model_dir] = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                                     attn_implementation="eager")
    with torch.no_grad():
        return _hf_models[model_dir](input_ids=ids, attention_mask=mask).logits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("layouts")
    ap.add_argument("--roundtrip", type=Path, default=None)
    args = ap.parse_args()
    records = []
    for tp, pp, sp in parse_layouts(args.layouts):
        mesh = mlora.init_parallel(tp=tp, pp=pp, sp=sp)
        for name in MODELS:
            model_dir = args.models_dir / name
            model = mlora.from_pretrained(model_dir, mesh, dtype=torch.float32)  # attention="sdpa"
            unfused = mlora.from_pretrained(model_dir, mesh, dtype=torch.float32, attention="unfused")
            for kind, (ids, mask) in batches(mesh.dp_rank, model.spec.vocab_size).items():
                mask_shape = model._prepare(ids, mask)[2]
                out, old = model.logits(ids, attention_mask=mask), unfused.logits(ids, attention_mask=mask)
                if out is not None:
                    ref = hf_logits(model_dir, ids, mask)
                    valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
                    records.append(dict(check="logits", model=name, batch=kind, tp=tp, pp=pp, dp=mesh.dp, sp=sp,
                                        rank=mesh.rank, shape=list(out.shape), ref_shape=list(ref.shape),
                                        seq=ids.shape[1], sliding_window=model.spec.sliding_window,
                                        sdpa_mask_shape=None if mask_shape is None else list(mask_shape.shape),
                                        max_abs_diff=(out - ref)[valid].abs().max().item(),
                                        unfused_max_abs_diff=(old - ref)[valid].abs().max().item(),
                                        sdpa_vs_unfused=(out - old)[valid].abs().max().item()))
            del unfused
            if args.roundtrip is not None and (tp, pp, sp) == (2, 2, False):
                own = sum(p.numel() * p.element_size() for n, p in model.gpt.named_parameters())
                # vocabulary padding rows are never read from the checkpoint
                pad_rows = model.spec.padded_vocab_size(tp) // tp - max(
                    0, min(model.spec.vocab_size - mesh.tp_rank * (model.spec.padded_vocab_size(tp) // tp),
                           model.spec.padded_vocab_size(tp) // tp))
                n_vocab_params = sum(1 for n, _ in model.gpt.named_parameters()
                                     if n in ("embedding.word_embeddings.weight", "output_layer.weight"))
                own -= pad_rows * model.spec.hidden_size * 4 * n_vocab_params
                records.append(dict(check="bytes_read", model=name, rank=mesh.rank, bytes_read=model.bytes_read,
                                    own_param_bytes=own,
                                    checkpoint_bytes=sum(Path(f).stat().st_size
                                                         for f in glob.glob(str(model_dir / "*.safetensors")))))
                out_dir = args.roundtrip / name
                model.save_merged(out_dir)
                if mesh.rank == 0:
                    from mlora.testing import load_checkpoint_tensors

                    src, dst = load_checkpoint_tensors(model_dir), load_checkpoint_tensors(out_dir)
                    records.append(dict(check="roundtrip", model=name, same_names=sorted(src) == sorted(dst),
                                        bit_identical=sorted(src) == sorted(dst) and all(
                                            torch.equal(src[k], dst[k]) and src[k].dtype == dst[k].dtype
                                            for k in src),
                                        files=sorted(p.name for p in out_dir.iterdir())))
            del model
        reset_parallel()
    write_records_and_exit(records, args.out)


if __name__ == "__main__":
    main()
