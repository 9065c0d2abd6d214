"""torchrun worker: mixture-of-experts bases (and Qwen3's q/k norm) against transformers at several
TP x PP x EP layouts: logits, the router's token-to-expert assignment and weights, and the gradients of an
all-linear LoRA (an adapter per expert and projection, and the attention's) plus the router, whose backward runs
through the router and the experts and their all-to-all dispatch, one step after initialisation (every factor non-zero); that adapter
saved in PEFT layout and run by transformers + PEFT; save_merged at EP > 1 against transformers + PEFT's merge;
a mixed-adapter micro-batch (two adapters on alternate rows, routed through the experts) against each alone.

Usage: torchrun --nproc_per_node N tests/dist/moe_equivalence.py MODELS_DIR OUT_JSON LAYOUTS
LAYOUTS is "tp,pp,ep[,sp];..." (DP = world // (tp*pp)). Rank 0 writes one JSON record per check.
MLORA_MOE_MODELS=gpt_oss,... runs those MoE models only (no dense one): a family's checks alone, by hand.
Each DP rank takes its share of the gradient batch's rows: gradients are summed over DP, so every layout's
equal the whole batch's on one rank.
"""

from __future__ import annotations

import argparse
import os
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from common import adapter_grads, masked_sum_loss, write_records_and_exit

import mlora
from mlora.lora.grads import finalize_grads
from mlora.parallel import reset_parallel
from mlora.testing import right_padded_batch

MOE_MODELS = tuple(os.environ.get("MLORA_MOE_MODELS", "mixtral,qwen3_moe,qwen2_moe,olmoe,glm4_moe,deepseek_v3,gpt_oss"
                                  ).split(","))
DENSE_MODELS = ("qwen3",)  # q/k norm per head, no experts: layouts without EP only
LORA = dict(rank=4, alpha=8, seed=3, target_modules="all-linear", init_method="gaussian")
# The router as a target too (named: all-linear leaves it out), where PEFT loads it; PEFT 0.21 refuses a Qwen2-MoE
# adapter with router LoRA outright (mlora warns when saving), so there its router is adapted in the mixed check only.
ROUTER_IN_PEFT = {"mixtral", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v3", "gpt_oss"}
# Mixtral's experts at a rank of their own: PEFT files with r = 2 and the attention's 4 in rank_pattern
EXPERT_RANK = {"mixtral": 2}
# PEFT 0.21 on transformers 5 maps every gate/up/down target of a Qwen3-MoE adapter onto the stacked experts, so
# an adapter on its dense layer's MLP does not load there: that layer's MLP stays out of the PEFT comparison.
# GLM-4.5 likewise (its dense layer 0), and PEFT maps its shared experts' LoRA onto the routed experts too (mlora
# refuses to save such an adapter): the shared experts' LoRA is checked by the mixed-adapter check only. DeepSeek-V3
# likewise.
_GLM_LIKE = ["layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj",
             "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]
EXCLUDE = {"qwen3_moe": ["layers.1.mlp.gate_proj", "layers.1.mlp.up_proj", "layers.1.mlp.down_proj"],
           "glm4_moe": _GLM_LIKE, "deepseek_v3": _GLM_LIKE}
# PEFT 0.21 on transformers 5 does not convert a Qwen2-MoE adapter onto the stacked experts: it loads the attention's,
# the shared expert's and the dense MLP's LoRA and drops the routed experts' (mlora warns when saving). Their B is
# zeroed after the gradient check, so that the PEFT and merge comparisons hold what PEFT loads.
NO_EXPERTS_IN_PEFT = {"qwen2_moe"}


def parse(spec: str) -> list[tuple[int, int, int, bool]]:
    out = []
    for layout in spec.split(";"):
        f = layout.split(",")
        out.append((int(f[0]), int(f[1]), int(f[2]), f[3:] == ["sp"]))
    return out


_hf: dict[Path, torch.nn.Module] = {}


def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if model_dir not in _hf:
        _hf[model_dir] = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    return _hf[model_dir]


def hf_routes(model_dir: Path, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per sparse layer, HF's top-k weights scattered over the experts, ``[tokens, experts]`` with tokens
    in megatron's order (sequence-major)."""
    hf, out = hf_model(model_dir), []
    hooks = [getattr(layer.mlp, "router", None) or layer.mlp.gate for layer in hf.model.layers
             if hasattr(layer.mlp, "experts")]  # gpt-oss calls its router router
    hooks = [router.register_forward_hook(lambda m, i, o: out.append(o)) for router in hooks]
    with torch.no_grad():
        hf(input_ids=ids)
    for h in hooks:
        h.remove()
    b, s = ids.shape
    routes = []
    for logits, weights, index in out:
        dense = torch.zeros_like(logits).scatter(1, index, weights)
        routes.append(dense.view(b, s, -1).transpose(0, 1).reshape(b * s, -1))
    return routes


def mlora_routes(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per sparse layer of this stage, megatron's router probabilities ``[tokens, experts]`` (zero off the
    chosen experts)."""
    out = []
    hooks = [layer.mlp.router.register_forward_hook(lambda m, i, o: out.append(o[0].detach().clone()))
             for layer in model.gpt.decoder.layers if hasattr(layer.mlp, "router")]
    model.logits(ids)
    for h in hooks:
        h.remove()
    return out


def mixed_adapters(model, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """Two all-linear adapters of different ranks, alternate rows each, in one micro-batch (their routes go through
    the dispatcher with the tokens) against each adapter alone on its rows: this rank's logits (last stage) and
    factor gradients, largest difference relative to the largest reference value."""
    names = ("m1", "m2")
    for i, adapter in enumerate(names):
        model.add_adapter(adapter, mlora.LoraConfig(rank=3 + 2 * i, alpha=8, seed=5 + i,
                                                    target_modules=["all-linear", "gate"]))
    for n, p in model.gpt.named_parameters():  # random B too, so that every factor has a gradient
        if any(f".lora.{a}." in n for a in names):
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(zlib.crc32(n.encode()))) * 0.1)
    lo, hi = model.vocab_shard_range()

    def loss_fn(logits, mb):
        m = mb["attention_mask"][..., None].to(logits.dtype)
        return (logits[..., :hi - lo] * m).sum() * 1e-3, {"logits": logits[..., :hi - lo].detach()}

    def grads() -> dict:
        out = {n: p.grad.clone() for n, p in model.gpt.named_parameters() if p.grad is not None}
        for p in model.trainable_parameters():
            p.grad = None
        return out

    rows = {a: list(range(i, ids.shape[0], 2)) for i, a in enumerate(names)}
    solo = {}
    grads()  # none left from earlier checks
    for adapter, picked in rows.items():
        with model.use_adapters(adapter):
            outs = model.forward_backward([{"input_ids": ids[picked], "attention_mask": mask[picked]}], loss_fn)
        for j, row in enumerate(picked):
            if outs is not None:
                solo[row] = outs[0]["logits"][j]
    want = grads()
    with model.use_adapters(*names):
        outs = model.forward_backward([{"input_ids": ids, "attention_mask": mask, "adapter_rows": rows}], loss_fn)
    got = grads()
    for adapter in names:
        model.delete_adapter(adapter)
    scale = max(v.abs().max().item() for v in want.values())
    # an expert none of an adapter's tokens reached: a zero gradient alone, none mixed (its branch is skipped)
    diff = max((got.get(k, torch.zeros_like(w)) - w).abs().max().item() for k, w in want.items())
    out = dict(count=len(want), experts=sum(".experts." in k and bool(want[k].abs().max() > 0) for k in want),
               extra=sorted(set(got) - set(want)), grad_rel=diff / scale)
    if outs is not None:
        valid = mask.bool()
        out["logits_rel"] = max(((outs[0]["logits"][r] - solo[r])[valid[r]].abs().max() / solo[r].abs().max()).item()
                                for r in solo)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("layouts")
    args = ap.parse_args()
    records = []
    for tp, pp, ep, sp in parse(args.layouts):
        mesh = mlora.init_parallel(tp=tp, pp=pp, sp=sp, ep=ep)
        layout = dict(tp=tp, pp=pp, ep=ep, dp=mesh.dp, sp=sp, rank=mesh.rank)
        for name in MOE_MODELS + (DENSE_MODELS if ep == 1 and os.environ.get("MLORA_MOE_MODELS") is None else ()):
            model_dir = args.models_dir / name
            model = mlora.from_pretrained(model_dir, mesh, dtype=torch.float32)
            ids, mask = right_padded_batch(model.spec.vocab_size, (17, 11, 6, 17), seed=7)
            out = model.logits(ids, attention_mask=mask)
            if out is not None:
                with torch.no_grad():
                    ref = hf_model(model_dir)(input_ids=ids, attention_mask=mask).logits
                valid = mask.bool()
                records.append(dict(check="logits", model=name, **layout, shape=list(out.shape),
                                    max_abs_diff=(out - ref)[valid].abs().max().item(),
                                    rel=((out - ref)[valid].norm() / ref[valid].norm()).item()))
            if model.spec.moe is not None and tp == 1:  # the router sees whole sequences (no SP split)
                full, _ = right_padded_batch(model.spec.vocab_size, (13, 13), seed=11)
                mine, ref = mlora_routes(model, full), hf_routes(model_dir, full)
                layers = [i for i in model.spec.moe.sparse_layers if i in
                          [layer.layer_number - 1 for layer in model.gpt.decoder.layers]]
                ref = [ref[model.spec.moe.sparse_layers.index(i)] for i in layers]
                records.append(dict(check="routes", model=name, **layout, layers=layers,
                                    same_experts=all(torch.equal(a != 0, b != 0) for a, b in zip(mine, ref)),
                                    max_weight_diff=max((a - b).abs().max().item() for a, b in zip(mine, ref))))
            # LoRA on every linear, experts included; B = 0 at first, so one step makes every factor's gradient
            # non-zero, and the attention's reach the lower layers only back through the experts above
            targets = [LORA["target_modules"], "gate"] if name in ROUTER_IN_PEFT else LORA["target_modules"]
            model.add_adapter("a", mlora.LoraConfig(**{**LORA, "target_modules": targets},
                                                    exclude_modules=EXCLUDE.get(name), expert_rank=EXPERT_RANK.get(name)))
            rows = slice(mesh.dp_rank, None, mesh.dp)
            batch = {"input_ids": ids[rows], "attention_mask": mask[rows]}
            for step in range(2):
                model.zero_grad(set_to_none=True)
                model.forward_backward([batch], masked_sum_loss(model, mask[rows], scale=1e-3))
                finalize_grads(model.trainable_parameters())
                if step == 0:  # the same step on every layout
                    with torch.no_grad():
                        for p in model.adapter_parameters("a"):
                            p -= 0.1 * p.grad
            grads = adapter_grads(model, "a")
            if mesh.rank == 0:
                records.append(dict(check="grads", model=name, **layout,
                                    grads={k: v.flatten().tolist() for k, v in sorted(grads.items())}))
            # the adapter saved in PEFT layout loads in transformers + PEFT on the MoE model and gives mlora's logits
            if name in NO_EXPERTS_IN_PEFT:
                with torch.no_grad():
                    for n, p in model.gpt.named_parameters():
                        if ".experts." in n and ".lora_B" in n:  # the routed experts' (not shared_experts')
                            p.zero_()
            out = model.logits(ids, attention_mask=mask)
            peft_dir = args.models_dir.parent / f"adapter_{tp}{pp}{ep}{int(sp)}" / name
            model.save_adapter("a", peft_dir)
            if out is not None and mesh.rank == mesh.world_size - 1:  # a last-stage rank
                from peft import PeftModel

                base = hf_model(model_dir)
                valid = mask.bool()
                with torch.no_grad():
                    plain = base(input_ids=ids, attention_mask=mask).logits
                    peft = PeftModel.from_pretrained(base, str(peft_dir)).eval()
                    ref = peft(input_ids=ids, attention_mask=mask).logits
                _hf[model_dir] = peft.unload()  # the base model back, without LoRA layers
                records.append(dict(check="peft", model=name, **layout,
                                    rel=((out - ref)[valid].norm() / ref[valid].norm()).item(),
                                    adapter_effect=(ref - plain)[valid].abs().max().item()))
            if ep > 1 and name in MOE_MODELS:  # every expert gathered over EP: the checkpoint back, bit for bit
                from mlora.testing import load_checkpoint_tensors

                out_dir = args.models_dir.parent / f"roundtrip_{tp}{pp}{ep}" / name
                model.save_merged(out_dir)
                merged_dir = out_dir.parent / f"{name}_merged"
                model.save_merged(merged_dir, ["a"])  # W + s·B·A of every expert and projection
                dist.barrier()
                if mesh.rank == 0:  # transformers' save_pretrained writes on rank 0 only
                    from peft import PeftModel
                    from transformers import AutoModelForCausalLM

                    # PEFT's merge of a fresh base, saved by transformers with per-expert names
                    fresh = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
                    PeftModel.from_pretrained(fresh, str(peft_dir)).merge_and_unload().save_pretrained(
                        out_dir.parent / f"{name}_peft_merged")
                    src, dst = load_checkpoint_tensors(model_dir), load_checkpoint_tensors(out_dir)
                    mine, peft = load_checkpoint_tensors(merged_dir), load_checkpoint_tensors(
                        out_dir.parent / f"{name}_peft_merged")
                    records.append(dict(check="roundtrip", model=name, **layout, same_names=sorted(src) == sorted(dst),
                                        bit_identical=sorted(src) == sorted(dst) and all(
                                            torch.equal(src[k], dst[k]) for k in src)))
                    records.append(dict(check="merged", model=name, **layout, same_names=sorted(mine) == sorted(peft),
                                        changed=sum(not torch.equal(mine[k], src[k]) for k in mine),
                                        max_rel=max(((mine[k] - peft[k]).abs().max() / peft[k].abs().max()).item()
                                                    for k in mine)))
            if name in MOE_MODELS:
                records.append(dict(check="mixed", model=name, **layout, **mixed_adapters(model, ids[rows], mask[rows])))
            del model
        reset_parallel()
    write_records_and_exit(records, args.out)


if __name__ == "__main__":
    main()
