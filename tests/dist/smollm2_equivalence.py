"""torchrun worker: mlora logits of the real SmolLM2-135M-Instruct (converted from its GGUF) vs the
transformers logits that the test computed once and saved.

Usage: torchrun --nproc_per_node N tests/dist/smollm2_equivalence.py MODEL_DIR REFERENCE_PT OUT_JSON LAYOUTS
LAYOUTS is "tp,pp;..." (world = tp*pp). Every rank that holds logits (the last PP stage) records the largest
absolute difference at the real (unpadded) positions and the scale of the reference; each rank also records
how many heads it holds and a checksum of the vocabulary matrix it holds (the embedding on the first stage,
the output layer on the last: with tied embeddings the two must be the same tensor's copy).
Then the same with the test's random PEFT adapter (q_proj, v_proj, lm_head) loaded: its logits vs transformers +
PEFT's, and the gradients of its factors for the summed-logits loss vs PEFT's (:func:`lora_records`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import masked_sum_loss, merged_from_all_ranks, parse_layouts, write_records_and_exit

import mlora
from mlora.parallel import reset_parallel

VOCAB_MATRICES = ("embedding.word_embeddings.weight", "output_layer.weight")


def lora_records(model, ref: dict, base: dict) -> list[dict]:
    """With the reference's PEFT adapter loaded: the logits' largest difference from PEFT's, and on rank 0 the
    largest relative gradient difference over the factors (collective)."""
    mesh = model.mesh
    ids, mask = ref["input_ids"], ref["attention_mask"]
    valid = mask.bool()
    model.load_adapter("peft", ref["adapter"], trainable=True)
    records = []
    out = model.logits(ids, attention_mask=mask)
    if out is not None:
        records.append(dict(base, check="lora_logits", max_abs_diff=(out - ref["lora_logits"])[valid].abs().max().item(),
                            ref_max_abs=ref["lora_logits"][valid].abs().max().item()))
    model.forward_backward([{"input_ids": ids, "attention_mask": mask}],
                           masked_sum_loss(model, mask, ref["grad_scale"]))
    model.reduce_tp_replicated_grads()
    grads = merged_from_all_ranks(model.adapter_tensors("peft", grads=True))
    if mesh.rank == 0:
        want = ref["lora_grads"]
        rel = {k: ((grads[k] - want[k]).norm() / want[k].norm()).item() for k in want if k in grads}
        records.append(dict(base, check="lora_grads", missing=sorted(set(want) - set(grads)),
                            extra=sorted(set(grads) - set(want)), max_rel=max(rel.values()), worst=max(rel, key=rel.get),
                            names=sorted(grads)))
    model.delete_adapter("peft")
    return records


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("reference", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("layouts")
    args = ap.parse_args()
    ref = torch.load(args.reference)
    ids, mask, ref_logits = ref["input_ids"], ref["attention_mask"], ref["logits"]
    valid = mask.bool()
    records = []
    for tp, pp, sp in parse_layouts(args.layouts):
        mesh = mlora.init_parallel(tp=tp, pp=pp, sp=sp)
        model = mlora.from_pretrained(args.model_dir, mesh, dtype=torch.float32)
        base = dict(tp=tp, pp=pp, rank=mesh.rank, tp_rank=mesh.tp_rank, pp_rank=mesh.pp_rank)
        attn = model.gpt.decoder.layers[0].self_attention
        records.append(dict(base, check="heads", heads=attn.num_attention_heads_per_partition,
                            kv_heads=attn.num_query_groups_per_partition, layers=len(model.gpt.decoder.layers)))
        for name, p in model.gpt.named_parameters():
            if name in VOCAB_MATRICES:  # rows of this TP rank's vocabulary shard, first 8 (never padding)
                records.append(dict(base, check="vocab_matrix", name=name, rows=p.detach()[:8].tolist()))
        out = model.logits(ids, attention_mask=mask)
        if out is not None:
            records.append(dict(base, check="logits", shape=list(out.shape), ref_shape=list(ref_logits.shape),
                                max_abs_diff=(out - ref_logits)[valid].abs().max().item(),
                                ref_max_abs=ref_logits[valid].abs().max().item()))
        records += lora_records(model, ref, base)
        del model
        reset_parallel()
    write_records_and_exit(records, args.out)


if __name__ == "__main__":
    main()
