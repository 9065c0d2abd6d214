"""torchrun worker (and in-process helper): one SFT, reward-model and DPO (sigmoid, IPO) gradient pass on
TRL's own collated batches, for comparison with TRL / transformers+PEFT (tests/preference_refs.py).

Usage: torchrun ... preference_equivalence.py MODEL_DIR REFS_DIR OUT_DIR LAYOUTS
LAYOUTS "tp,pp;..."; writes OUT_DIR/tp{tp}pp{pp}dp{dp}.pt with, per stage, the loss, the metrics and
the gradients in PEFT names (the reward head's as ``base_model.model.score.weight``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from common import adapter_grads, clear_adapters, parse_layouts  # noqa: E402

import mlora  # noqa: E402
from mlora.export.reward_adapter import load_reward_adapter  # noqa: E402
from mlora.train.preference_data import SequenceBatch  # noqa: E402
from mlora.train.preference_engine import PreferenceConfig, PreferenceEngine  # noqa: E402

DPO_BETA = 0.5  # tests/preference_refs.py's


def run_stages(model, refs_dir: Path, refs: dict) -> dict:
    """Every stage's loss, metrics and gradients on this mesh (collective; the same dict on every rank)."""
    micro = max(1, 2 // model.mesh.dp)
    out = {}
    for key, loss_type in (("dpo_sigmoid", "sigmoid"), ("dpo_ipo", "ipo")):
        b = refs[key]["batch"]
        model.load_adapter("policy", refs_dir / "policy", trainable=True)
        engine = PreferenceEngine(model, PreferenceConfig(stage="dpo", beta=DPO_BETA, loss_type=loss_type,
                                                          micro_batch_size=micro))
        batch = SequenceBatch(b["input_ids"], b["attention_mask"], b["completion_mask"], pairs=True)
        metrics = engine.forward_backward(batch)
        out[key] = {"metrics": metrics, "grads": adapter_grads(model, "policy")}
        clear_adapters(model)
    b = refs["rm"]["batch"]
    load_reward_adapter(model, refs_dir / "reward_adapter", "reward", "reward")
    engine = PreferenceEngine(model, PreferenceConfig(stage="rm", micro_batch_size=micro))
    # the reward model reads whole sequences: every real token counts as "response"
    batch = SequenceBatch(b["input_ids"], b["attention_mask"], b["attention_mask"], pairs=True)
    out["rm"] = {"metrics": engine.forward_backward(batch),
                 "grads": adapter_grads(model, "reward", "reward", "base_model.model.score.weight")}
    clear_adapters(model)
    b = refs["sft"]["batch"]
    model.load_adapter("policy", refs_dir / "policy", trainable=True)
    engine = PreferenceEngine(model, PreferenceConfig(stage="sft", micro_batch_size=micro))
    batch = SequenceBatch(b["input_ids"], b["attention_mask"], b["response_mask"])
    out["sft"] = {"metrics": engine.forward_backward(batch), "grads": adapter_grads(model, "policy")}
    clear_adapters(model)
    return out


def main() -> None:
    from mlora.parallel import reset_parallel

    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("refs_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("layouts")
    args = ap.parse_args()
    refs = torch.load(args.refs_dir / "refs.pt")
    for tp, pp, _ in parse_layouts(args.layouts):
        mesh = mlora.init_parallel(tp=tp, pp=pp)
        model = mlora.from_pretrained(args.model_dir, mesh)
        result = run_stages(model, args.refs_dir, refs)
        if mesh.rank == 0:
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save(result, args.out / f"tp{tp}pp{pp}dp{mesh.dp}.pt")
        del model
        reset_parallel()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
