"""torchrun worker: LoRA on parallel linears vs HF+PEFT (logits, gradients, stacking, rank 3,
collectives). Usage: torchrun ... lora_equivalence.py MODELS_DIR REFS_DIR OUT_JSON LAYOUTS
REFS_DIR/<model>/ holds the adapters and refs.pt from tests/peft_refs.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import masked_sum_loss, merged_from_all_ranks, parse_layouts, write_records_and_exit

import mlora
from mlora.parallel import reset_parallel
from mlora.parallel.accounting import count_collectives, summarize

MODELS = ("llama", "qwen2")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models_dir", type=Path)
    ap.add_argument("refs_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("layouts")
    args = ap.parse_args()
    records = []
    for tp, pp, sp in parse_layouts(args.layouts):
        mesh = mlora.init_parallel(tp=tp, pp=pp, sp=sp)
        tag = dict(tp=tp, pp=pp, sp=sp)
        for name in MODELS:
            refs_dir = args.refs_dir / name
            refs = torch.load(refs_dir / "refs.pt")
            ids, mask = refs["ids"], refs["mask"]
            valid = mask.bool()
            model = mlora.from_pretrained(args.models_dir / name, mesh)
            model.load_adapter("policy", refs_dir / "policy", trainable=True)

            def compare(kind, logits, ref):
                if logits is not None and mesh.tp_rank == 0:
                    records.append(dict(check=kind, model=name, **tag,
                                        max_abs_diff=(logits - ref)[valid].abs().max().item()))

            compare("policy_logits", model.logits(ids, mask), refs["policy_logits"])

            # gradients of a summed-logits loss, in PEFT layout
            mb = {"input_ids": ids, "attention_mask": mask}
            model.forward_backward([mb], masked_sum_loss(model, mask))
            model.reduce_tp_replicated_grads()
            base_grads = [n for n, p in model.named_parameters() if "lora_" not in n and (p.grad is not None or p.requires_grad)]
            grads = merged_from_all_ranks(model.adapter_tensors("policy", grads=True))
            if mesh.rank == 0:
                ref = refs["policy_grads"]
                rel = {k: ((grads[k] - ref[k]).norm() / ref[k].norm()).item() for k in ref if k in grads}
                records.append(dict(check="grads", model=name, **tag, missing=sorted(set(ref) - set(grads)),
                                    extra=sorted(set(grads) - set(ref)), max_rel=max(rel.values()),
                                    worst=max(rel, key=rel.get)))
            records.append(dict(check="base_frozen", model=name, **tag, rank=mesh.rank, offenders=base_grads))
            for p in model.trainable_parameters():
                p.grad = None

            # stacking: frozen sft under trainable policy
            model.load_adapter("sft", refs_dir / "sft", trainable=False)
            with model.use_adapters("sft", "policy"):
                compare("stack_logits", model.logits(ids, mask), refs["stack_logits"])
            # rank 3, with no relation to TP
            model.load_adapter("r3", refs_dir / "r3")
            with model.use_adapters("r3"):
                compare("r3_logits", model.logits(ids, mask), refs["r3_logits"])

            # collectives of one forward+backward: base alone vs adapters active
            if tp > 1 or pp > 1:
                norms = [p for n, p in model.named_parameters() if n.endswith("layernorm.weight")]
                for p in norms:  # give the base alone a backward pass through every layer
                    p.requires_grad_(True)
                summaries = {}
                for label, active in (("base", ()), ("lora", ("sft", "policy"))):
                    with model.use_adapters(*active), count_collectives() as calls:
                        model.forward_backward([mb], masked_sum_loss(model, mask))
                    summaries[label] = {k: list(v) for k, v in summarize(calls).items()}
                for p in norms:
                    p.requires_grad_(False)
                    p.grad = None
                records.append(dict(check="collectives", model=name, **tag, rank=mesh.rank, **summaries))
            del model
        reset_parallel()
    write_records_and_exit(records, args.out)


if __name__ == "__main__":
    main()
