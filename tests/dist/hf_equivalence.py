"""torchrun worker: mlora logits vs transformers at several layouts; round trip; bytes read.

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


def batch(dp_rank: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A right-padded batch (lengths 19, 13, 5; odd, so SP must pad), different on each DP rank."""
    return right_padded_batch(vocab, (19, 13, 5), seed=100 + dp_rank)


_hf_cache: dict[str, torch.Tensor] = {}


def hf_logits(model_dir: Path, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits


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
            model = mlora.from_pretrained(model_dir, mesh, dtype=torch.float32)
            ids, mask = batch(mesh.dp_rank, model.spec.vocab_size)
            out = model.logits(ids, attention_mask=mask)
            if out is not None:
                ref = hf_logits(model_dir, ids, mask)
                valid = mask.bool()
                records.append(dict(check="logits", model=name, tp=tp, pp=pp, dp=mesh.dp, sp=sp, rank=mesh.rank,
                                    shape=list(out.shape), ref_shape=list(ref.shape),
                                    max_abs_diff=(out - ref)[valid].abs().max().item()))
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
