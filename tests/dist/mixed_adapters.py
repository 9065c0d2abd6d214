"""torchrun worker (4 ranks): mixed-adapter micro-batches against per-adapter references.

- TP2xPP2 + SP, recompute=full, three micro-batches (megatron's 1F1B interleaves them: a micro-batch's
  recompute runs after the next one's forward set other routes): logits of this TP rank's vocabulary shard
  and every rank's local factor gradients, mixed vs each adapter's rows alone.
- TP2xDP2: each DP rank its own micro-batch; adapter ``c`` has rows on DP rank 0 only (named with no rows
  on DP rank 1), ``d`` no row anywhere. After ``finalize_grads`` every gradient equals the full-batch
  reference (each rank ran every row per adapter, summed over TP only); ``d`` has none.
Usage: torchrun ... mixed_adapters.py MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import argparse
import os
import zlib
from pathlib import Path

import torch
from common import write_records_and_exit

import mlora
from mlora.formats.weight_map import shard
from mlora.lora.grads import finalize_grads
from mlora.parallel import reset_parallel
from mlora.testing import right_padded_batch

ADAPTERS = ("a", "b", "c", "d")
PP_ASSIGN = (("a", "b", "a", "c"), ("b", "b", "c", "a"), ("c", "a", "a", "b"))  # the adapter of each row
DP_ASSIGN = (("a", "c", "a", "b"), ("b", "a", "b", "a"))  # per DP rank: c only on DP rank 0
LENS = ((11, 8, 11, 6), (9, 11, 7, 10), (11, 5, 9, 11))


def add_adapters(model) -> None:
    """Frozen ``sft`` on every row and trainable ``a``..``d``, all with random factors (same on every mesh)."""
    model.add_adapter("sft", mlora.LoraConfig(rank=4, alpha=8, seed=11), trainable=False)
    for i, name in enumerate(ADAPTERS):
        model.add_adapter(name, mlora.LoraConfig(rank=3 + i, alpha=8, seed=i))
    mesh = model.mesh
    for name in ("sft", *ADAPTERS):
        layout = model.adapter_layout(name)
        for peft_name, kind, branch, k, is_a in model._factors(name):
            g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{peft_name}".encode()))
            full = torch.randn(layout[peft_name][1], generator=g) * 0.1
            with torch.no_grad():
                (branch.a_of(k) if is_a else branch.lora_B[k]).copy_(shard(full, kind, mesh.tp, mesh.tp_rank))


def batch(index: int, vocab: int):
    return right_padded_batch(vocab, LENS[index], seed=20 + index)


def sub_batch(ids, mask, rows) -> dict:
    rows = torch.tensor(rows)
    return {"input_ids": ids[rows], "attention_mask": mask[rows]}


def adapter_rows(assign) -> dict:
    return {name: [i for i, a in enumerate(assign) if a == name] for name in ADAPTERS}


def loss_fn_of(model):
    """Σ over rows and real positions of this TP rank's logits weighted per vocabulary entry (separable
    per row); the metrics carry the logits."""
    lo, hi = model.vocab_shard_range()
    w = torch.linspace(-1, 1, model.spec.padded_vocab_size(model.mesh.tp))[lo:hi]

    def loss_fn(logits, mb):
        m = mb["attention_mask"][..., None].to(logits.dtype)
        return (logits[..., :hi - lo] * w * m).sum() * 1e-2, {"logits": logits[..., :hi - lo].detach()}
    return loss_fn


def local_grads(model) -> dict:
    grads = {n: p.grad.clone() for n, p in model.gpt.named_parameters() if p.grad is not None}
    for p in model.trainable_parameters():
        p.grad = None
    return grads


def compare(check: str, got: dict, want: dict, tag: dict) -> dict:
    rel = {k: ((got[k] - w).norm() / w.norm()).item() for k, w in want.items() if k in got}
    return dict(check=check, **tag, count=len(rel), missing=sorted(set(want) ^ set(got)),
                max_rel=max(rel.values(), default=0.0), min_norm=min((w.norm().item() for w in want.values()),
                                                                     default=0.0))


def pipeline_case(model_dir: Path, rank: int) -> list[dict]:
    mesh = mlora.init_parallel(tp=2, pp=2, sp=True)
    model = mlora.from_pretrained(model_dir, mesh, recompute="full")
    add_adapters(model)
    loss_fn = loss_fn_of(model)
    data = [batch(i, model.spec.vocab_size) for i in range(len(PP_ASSIGN))]
    model.train()
    refs: dict[tuple[int, str], torch.Tensor] = {}
    for i, (ids, mask) in enumerate(data):
        for name, rows in adapter_rows(PP_ASSIGN[i]).items():
            if rows:
                with model.use_adapters("sft", name):
                    outs = model.forward_backward([sub_batch(ids, mask, rows)], loss_fn)
                if outs is not None:
                    for row, logits in zip(rows, outs[0]["logits"]):
                        refs[(i, row)] = logits
    want = local_grads(model)
    mbs = [{"input_ids": ids, "attention_mask": mask, "adapter_rows": adapter_rows(PP_ASSIGN[i])}
           for i, (ids, mask) in enumerate(data)]
    with model.use_adapters("sft", *ADAPTERS):
        outs = model.forward_backward(mbs, loss_fn)
    model.eval()
    got = local_grads(model)
    tag = dict(layout="tp2_pp2_sp_full", rank=rank)
    records = [compare("pp_grads", got, want, tag)]
    if outs is not None:
        mixed, ref = {}, {}
        for (i, row), logits in refs.items():
            valid = data[i][1][row].bool()
            mixed[f"{i}.{row}"], ref[f"{i}.{row}"] = outs[i]["logits"][row][valid], logits[valid]
        records.append(compare("pp_logits", mixed, ref, tag))
    del model
    reset_parallel()
    return records


def data_parallel_case(model_dir: Path, rank: int) -> list[dict]:
    mesh = mlora.init_parallel(tp=2, pp=1)
    model = mlora.from_pretrained(model_dir, mesh)
    add_adapters(model)
    loss_fn = loss_fn_of(model)
    data = [batch(i, model.spec.vocab_size) for i in range(len(DP_ASSIGN))]
    for i, (ids, mask) in enumerate(data):  # every rank: every DP rank's rows, per adapter
        for name, rows in adapter_rows(DP_ASSIGN[i]).items():
            if rows:
                with model.use_adapters("sft", name):
                    model.forward_backward([sub_batch(ids, mask, rows)], loss_fn)
    model.reduce_tp_replicated_grads()
    want = local_grads(model)
    ids, mask = data[mesh.dp_rank]
    with model.use_adapters("sft", *ADAPTERS):
        model.forward_backward([{"input_ids": ids, "attention_mask": mask,
                                 "adapter_rows": adapter_rows(DP_ASSIGN[mesh.dp_rank])}], loss_fn)
    had_c = any(p.grad is not None for p in model.adapter_parameters("c"))
    finalize_grads(model.trainable_parameters())
    got = {n: p.grad.clone() for n, p in model.gpt.named_parameters() if p.grad is not None}
    tag = dict(layout="tp2_dp2", rank=rank, dp_rank=mesh.dp_rank, had_c=had_c)
    records = [compare("dp_grads", got, want, tag),
               dict(check="dp_unrouted", **tag, with_grad=[n for n in got if ".lora.d." in n])]
    del model
    reset_parallel()
    return records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    records = pipeline_case(args.model_dir, rank) + data_parallel_case(args.model_dir, rank)
    write_records_and_exit(records, args.out)


if __name__ == "__main__":
    main()
