"""torchrun worker (4 ranks): fp8="torch" logits at TP2×PP2 and TP2+SP vs TP1 FP8 logits (KL),
LoRA gradients through the FP8 base vs TP1's, a row-parallel FP8 GEMM vs the whole one (per-token
input scales over the whole row), weight scales and FP8 weights vs TP1 (mesh independence),
save_merged of an FP8 base.

Usage: torchrun --nproc_per_node 4 tests/dist/fp8_equivalence.py MODELS_DIR OUT_JSON MERGED_DIR
Rank 0 writes the records of every rank.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from common import masked_sum_loss, merged_from_all_ranks, write_records_and_exit

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


def grad_adapter(model, path: Path) -> None:
    """Add adapter ``g`` to a TP1 model with non-zero A *and* B (so every factor has a gradient that
    flows back through the FP8 linears above it) and save it to ``path`` (collective)."""
    model.add_adapter("g", mlora.LoraConfig(rank=4, alpha=8, seed=5, init_method="gaussian"))
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for linear in model._lora_linears():  # noqa: SLF001 (the same walk on every rank)
            for b in linear.lora["g"].lora_B if "g" in linear.lora else ():
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)
    model.save_adapter("g", path)


def row_parallel_gemm(mesh) -> dict:
    """A row-parallel FP8 GEMM (x and W split on K over TP, partial outputs summed) vs the whole GEMM on
    one rank, same input. The input's per-token scales must be the whole row's, so the FP8 inputs are
    bit-equal to the slices of the whole one's and forward and input gradient differ only by float32
    summation order. The large features sit in one rank's slice, so per-slice scales would show."""
    from mlora.fp8.quant import fp8_linear, quantize_tokens, quantize_weight

    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 256, generator=g)
    x[:, 200:] *= 30.0
    w, grad = torch.randn(96, 256, generator=g) * 0.05, torch.randn(37, 96, generator=g)
    k = x.shape[1] // mesh.tp
    part = slice(mesh.tp_rank * k, (mesh.tp_rank + 1) * k)
    x_full, x_part = x.clone().requires_grad_(), x[:, part].clone().requires_grad_()
    wq, sw = quantize_weight(w)
    fp8_linear(x_full, wq, sw).backward(grad)
    wq_part, sw_part = quantize_weight(w[:, part], mesh.tp_group)
    y = fp8_linear(x_part, wq_part, sw_part, mesh.tp_group)
    y.backward(grad)
    y = y.detach().clone()
    dist.all_reduce(y, group=mesh.tp_group)
    want = fp8_linear(x, wq, sw)
    xq, sx = quantize_tokens(x)
    xq_part, sx_part = quantize_tokens(x[:, part], mesh.tp_group)
    return dict(inputs_equal=torch.equal(sx, sx_part) and torch.equal(xq[:, part].view(torch.uint8),
                                                                      xq_part.view(torch.uint8)),
                out_rel=((y - want).norm() / want.norm()).item(),
                grad_rel=((x_part.grad - x_full.grad[:, part]).norm() / x_full.grad[:, part].norm()).item())


def lora_grads(model, ids, mask) -> dict:
    """PEFT-layout gradients of adapter ``g`` for a summed-logits loss, on every rank (collective)."""
    model.forward_backward([{"input_ids": ids, "attention_mask": mask}], masked_sum_loss(model, mask))
    model.reduce_tp_replicated_grads()
    return merged_from_all_ranks(model.adapter_tensors("g", grads=True))


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
        grad_adapter(model, args.merged.parent / "grad_adapters" / name)
        ref[name] += (lora_grads(model, ids, mask),)
        del model
    reset_parallel()
    for tp, pp, sp in LAYOUTS:
        mesh = mlora.init_parallel(tp=tp, pp=pp, sp=sp)
        records.append(dict(check="row_parallel", tp=tp, pp=pp, sp=sp, rank=mesh.rank, **row_parallel_gemm(mesh)))
        for name in MODELS:
            ids, mask, ref_logits, ref_w, ref_grads = ref[name]
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
                                    kl_max=kl.max().item(), kl_mean=kl.mean().item(), kl_median=kl.median().item(),
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
            # straight-through backward: the per-token input scales are not differentiated, so with
            # TP1's scales the gradients are TP1's up to the float32 summation order
            model.load_adapter("g", args.merged.parent / "grad_adapters" / name, trainable=True)
            grads = lora_grads(model, ids, mask)
            if mesh.rank == 0:
                rel = {k: ((grads[k] - g).norm() / g.norm()).item() for k, g in ref_grads.items() if k in grads}
                records.append(dict(check="grads", model=name, tp=tp, pp=pp, sp=sp,
                                    missing=sorted(set(ref_grads) ^ set(grads)), max_rel=max(rel.values()),
                                    worst=max(rel, key=rel.get)))
            del model
        reset_parallel()
    write_records_and_exit(records, args.out)


if __name__ == "__main__":
    main()
