"""torchrun worker: LoRA on parallel linears vs HF+PEFT (logits, gradients, stacking, rank 3,
collectives), and mesh independence of add_adapter's init and of LoRA dropout (tensors written
next to OUT_JSON, compared across launches by the test).
Usage: torchrun ... lora_equivalence.py MODELS_DIR REFS_DIR OUT_JSON LAYOUTS
REFS_DIR/<model>/ holds the adapters and refs.pt from tests/peft_refs.py."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from common import masked_sum_loss, merged_from_all_ranks, parse_layouts, write_records_and_exit

import mlora
from mlora.parallel import reset_parallel
from mlora.parallel.accounting import count_collectives, summarize

MODELS = ("llama", "qwen2")
DROPOUT = 0.3
# activation recompute at TP x PP (tiny Llama: 4 layers, 2 per stage at PP2), with dropout on
RECOMPUTE_CASES = {
    "selective": dict(recompute="selective", recompute_modules=["core_attn", "mlp"]),
    "full_uniform": dict(recompute="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block": dict(recompute="full", recompute_method="block", recompute_num_layers=1),
}


def layout_file(out: Path, check: str, name: str, tp: int, pp: int, sp: bool) -> Path:
    return out.parent / f"{check}_{name}_tp{tp}_pp{pp}{'_sp' if sp else ''}.pt"


def fresh_init(model, out: Path, name: str, tag: dict) -> dict:
    """add_adapter with a non-default init, gathered in PEFT layout: must not depend on the mesh."""
    model.add_adapter("fresh", mlora.LoraConfig(rank=3, alpha=6, seed=7, init_method="gaussian"))
    tensors = merged_from_all_ranks(model.adapter_tensors("fresh"))
    model.delete_adapter("fresh")
    path = layout_file(out, "fresh_init", name, **tag)
    if model.mesh.rank == 0:
        torch.save(tensors, path)
    return dict(check="fresh_init", model=name, **tag, file=str(path))


def dropout_adapter(refs_dir: Path, out: Path, name: str) -> Path:
    """The PEFT ``policy`` adapter with lora_dropout = DROPOUT (written once by rank 0)."""
    path = out.parent / f"policy_dropout_{name}"
    if dist.get_rank() == 0 and not path.exists():
        shutil.copytree(refs_dir / name / "policy", path)
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg["lora_dropout"] = DROPOUT
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    dist.barrier()
    return path


def dropout_grads(model, mb: dict, mask) -> tuple[float, dict]:
    """Train-mode forward+backward of two micro-batches (two forward calls: two mask draws) with the
    ``drop`` adapter: the summed loss and the PEFT-layout gradients, on every rank (collective)."""
    losses = []
    summed = masked_sum_loss(model, mask)

    def loss_fn(logits, micro_batch):
        loss, _ = summed(logits, micro_batch)
        losses.append(loss.detach())
        return loss, {}

    model.train()
    with model.use_adapters("drop"):
        model.forward_backward([mb, mb], loss_fn)
    model.eval()
    model.reduce_tp_replicated_grads()
    grads = merged_from_all_ranks(model.adapter_tensors("drop", grads=True))
    mesh = model.mesh
    loss = None
    if mesh.is_last_stage:
        total = torch.stack(losses).sum()
        dist.all_reduce(total, group=mesh.tp_group)  # each TP rank summed its vocab shard
        loss = total.item()
    loss = merged_from_all_ranks({"loss": loss} if loss is not None and mesh.tp_rank == 0 else {})["loss"]
    for p in model.trainable_parameters():
        p.grad = None
    return loss, grads


def dropout_step(model, mb: dict, mask, out: Path, name: str, tag: dict) -> dict:
    """:func:`dropout_grads`, written for the test: the loss and gradients must not depend on TP/PP."""
    loss, grads = dropout_grads(model, mb, mask)
    path = layout_file(out, "dropout", name, **tag)
    if model.mesh.rank == 0:
        torch.save({"loss": loss, "grads": grads}, path)
    return dict(check="dropout", model=name, **tag, file=str(path), calls=sorted(
        {m.lora["drop"].dropout_calls for m in model._lora_linears() if "drop" in m.lora}))


def recompute_checks(models_dir: Path, drop_dir: Path, mesh, mb: dict, mask, want: dict | None,
                     tag: dict) -> list[dict]:
    """Activation recompute at this layout: the dropout step's loss and gradients with each setting equal
    recompute none's (``want``: what :func:`dropout_step` wrote, on rank 0), and the recomputed modules
    really ran twice per micro-batch."""
    records = []
    for label, kwargs in RECOMPUTE_CASES.items():
        model = mlora.from_pretrained(models_dir / "llama", mesh, **kwargs)
        model.load_adapter("drop", drop_dir, trainable=True)
        calls: dict[str, int] = {}
        for layer in model.gpt.decoder.layers:
            for key, module in (("layer", layer), ("core_attn", layer.self_attention.core_attention)):
                module.register_forward_hook(lambda *_, key=key: calls.__setitem__(key, calls.get(key, 0) + 1))
        loss, grads = dropout_grads(model, mb, mask)
        if mesh.rank == 0:
            ref_loss, ref = want["loss"], want["grads"]
            records.append(dict(check="recompute", setting=label, model="llama", **tag, missing=sorted(set(ref) ^ set(grads)),
                                loss_diff=abs(loss - ref_loss),
                                max_abs=max((grads[k] - g).abs().max().item() for k, g in ref.items() if k in grads),
                                max_rel=max(((grads[k] - g).norm() / g.norm()).item() for k, g in ref.items()
                                            if k in grads)))
        layers = len(model.gpt.decoder.layers)
        records.append(dict(check="recompute_calls", setting=label, **tag, rank=mesh.rank,
                            per_layer={k: v / layers for k, v in calls.items()}))
        del model
    return records


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

            records.append(fresh_init(model, args.out, name, tag))
            model.load_adapter("drop", dropout_adapter(args.refs_dir, args.out, name), trainable=True)
            records.append(dropout_step(model, mb, mask, args.out, name, tag))
            if name == "llama" and tp > 1 and pp > 1:
                records += recompute_checks(args.models_dir, dropout_adapter(args.refs_dir, args.out, name), mesh, mb,
                                            mask, torch.load(layout_file(args.out, "dropout", name, **tag))
                                            if mesh.rank == 0 else None, tag)

            # collectives of one forward+backward: base alone vs adapters active
            if tp > 1 or pp > 1:
                norms = [p for n, p in model.named_parameters() if n.endswith("layernorm.weight")]
                for p in norms:  # give the base alone a backward pass through every layer
                    p.requires_grad_(True)
                summaries = {}
                for label, active in (("base", ()), ("lora", ("sft", "policy")), ("dropout", ("drop",))):
                    model.train(label == "dropout")  # dropout on: per-projection masks, still no collective
                    with model.use_adapters(*active), count_collectives() as calls:
                        model.forward_backward([mb], masked_sum_loss(model, mask))
                    summaries[label] = {k: list(v) for k, v in summarize(calls).items()}
                model.eval()
                for p in norms:
                    p.requires_grad_(False)
                    p.grad = None
                records.append(dict(check="collectives", model=name, **tag, rank=mesh.rank, **summaries))
            del model
        reset_parallel()
    write_records_and_exit(records, args.out)


if __name__ == "__main__":
    main()
