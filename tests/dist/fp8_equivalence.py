"""torchrun worker (4 ranks): fp8="torch" logits at TP2×PP2 and TP2+SP vs TP1 FP8 logits (KL),
weight scales and FP8 weights vs TP1 (mesh independence), save_merged of an FP8 base.

Usage: torchrun --nproc_per_node 4 tests/dist/fp8_equivalence.py MODELS_DIR OUT_JSON MERGED_DIR
Rank 0 writes the records of every rank.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import write_records_and_exit

import mlora
from mlora.parallel import reset_parallel
from mlora.testing import right_padded_batch

MODELS = ("llama", "qwen2", "mistral")
LAYOUTS = ((2, 2, False), (2, 1, True))
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def linears(model) -> dict:
    """(global layer, linear) -> the LoRA linear module of this rank."""
    out = {}
    for layer in model.gpt.decoder.layers:
        for name in LINEARS:
            mod = layer
            for part in name.split("."):
                mod = getattr(mod, part)
            out[(layer.layer_number - 1, name)] = mod
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("merged", type=Path)
    args = ap.parse_args()
    records = []
    mesh = mlora.init_parallel(tp=1, pp=1)
    ref = {}
    for name in MODELS:
        model = mlora.from_pretrained(args.models_dir / name, mesh, dtype=torch.float32, fp8="torch")
        ids, mask = right_padded_batch(model.spec.vocab_size, (19, 13, 5), seed=11)  # same on every rank
        ref[name] = (ids, mask, model.logits(ids, attention_mask=mask),
                     {k: (m.weight.detach().clone(), m.weight_scale.clone()) for k, m in linears(model).items()})
        del model
    reset_parallel()
    for tp, pp, sp in LAYOUTS:
        mesh = mlora.init_parallel(tp=tp, pp=pp, sp=sp)
        for name in MODELS:
            ids, mask, ref_logits, ref_w = ref[name]
            model = mlora.from_pretrained(args.models_dir / name, mesh, dtype=torch.float32, fp8="torch")
            # scales are per whole row, so equal TP1's; the FP8 weights are TP1's slices
            scale_diff, weight_equal = 0.0, True
            for (layer, lin), mod in linears(model).items():
                w1, s1 = ref_w[(layer, lin)]
                if "linear_proj" in lin or "linear_fc2" in lin:  # row-parallel: input dim split
                    scale_diff = max(scale_diff, (mod.weight_scale - s1).abs().max().item())
                    w_slice = w1.chunk(tp, dim=1)[mesh.tp_rank]
                    weight_equal &= torch.equal(mod.weight.view(torch.uint8), w_slice.view(torch.uint8))
                else:  # column-parallel: whole rows
                    weight_equal &= mod.weight_scale.numel() == s1.numel() // tp
            records.append(dict(check="scales", model=name, tp=tp, pp=pp, sp=sp, rank=mesh.rank,
                                row_parallel_scale_max_diff=scale_diff, row_parallel_weights_equal=bool(weight_equal)))
            out = model.logits(ids, attention_mask=mask)
            if out is not None:
                valid = mask.bool()
                logp_ref = torch.log_softmax(ref_logits[valid].double(), -1)
                logp = torch.log_softmax(out[valid].double(), -1)
                kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1)
                records.append(dict(check="logits", model=name, tp=tp, pp=pp, sp=sp, rank=mesh.rank,
                                    kl_max=kl.max().item(), kl_mean=kl.mean().item(),
                                    rel_max_diff=((out - ref_logits)[valid].abs().max()
                                                  / ref_logits[valid].abs().max()).item(),
                                    top1_agree=(out[valid].argmax(-1) == ref_logits[valid].argmax(-1)).float()
                                    .mean().item()))
            if (tp, pp, sp) == (2, 2, False):
                model.save_merged(args.merged / name)
                if mesh.rank == 0:
                    from mlora.testing import load_checkpoint_tensors

                    src, dst = load_checkpoint_tensors(args.models_dir / name), load_checkpoint_tensors(args.merged / name)
                    bad = []
                    for key, t in src.items():
                        t = t.float()
                        if any(p in key for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                                                  "gate_proj.weight", "up_proj.weight", "down_proj.weight")):
                            scale = t.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
                            t = (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
                        if key not in dst or not torch.equal(dst[key].float(), t):
                            bad.append(key)
                    records.append(dict(check="merged", model=name, same_names=sorted(src) == sorted(dst),
                                        mismatched=bad[:5]))
            del model
        reset_parallel()
    write_records_and_exit(records, args.out)


if __name__ == "__main__":
    main()
