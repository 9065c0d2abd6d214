"""torchrun worker: one PPO (or GRPO) step on fixed synthetic rollouts; records losses, grad norms
and the updated adapters (PEFT layout) for comparison across layouts.

Usage: torchrun ... ppo_equivalence.py MODEL_DIR POLICY_ADAPTER OUT_DIR LAYOUTS ESTIMATORS
LAYOUTS "tp,pp;..." ; ESTIMATORS "gae,grpo". Writes OUT_DIR/<estimator>_tp{tp}pp{pp}dp{dp}.pt
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from common import merged_from_all_ranks, parse_layouts

import mlora
from mlora.parallel import reset_parallel
from mlora.train.batch import RolloutBatch
from mlora.train.config import PPOConfig
from mlora.train.engine import ActorCriticEngine


def synthetic_rollouts(vocab: int) -> RolloutBatch:
    """8 sequences: 5 prompt tokens, 3..7 response tokens, right-padded to 12; 4 prompts x 2 samples."""
    g = torch.Generator().manual_seed(7)
    b, s = 8, 12
    ids = torch.randint(0, vocab, (b, s), generator=g)
    attn = torch.zeros(b, s, dtype=torch.long)
    resp = torch.zeros(b, s, dtype=torch.long)
    for i, length in enumerate([7, 3, 5, 6, 4, 7, 3, 5]):
        attn[i, : 5 + length] = 1
        resp[i, 5: 5 + length] = 1
        ids[i, 5 + length:] = 0
    for i in range(1, b, 2):  # the two samples of a prompt share it
        ids[i, :5] = ids[i - 1, :5]
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25])
    rollout_logprobs = -torch.rand(b, s - 1, generator=g) * 5  # stands in for the engine's (gap metric only)
    return RolloutBatch(ids, attn, resp, rewards, rollout_logprobs)


def gather_adapter(model, name: str) -> dict:
    return merged_from_all_ranks(model.adapter_tensors(name) if model.mesh.dp_rank == 0 else {})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("policy", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("layouts")
    ap.add_argument("estimators")
    args = ap.parse_args()
    for tp, pp, _ in parse_layouts(args.layouts):
        mesh = mlora.init_parallel(tp=tp, pp=pp)
        for estimator in args.estimators.split(","):
            model = mlora.from_pretrained(args.model_dir, mesh)
            model.load_adapter("policy", args.policy, trainable=True)
            # one row per micro-batch at every DP (SkyRL's entropy term is a token mean per micro-batch); sampled at
            # temperature 0.8 with top-k 50, top-p 0.9: tempered log-probs everywhere, and the
            # truncated ones (vocab-parallel bisection) in the gap metric; GRPO with Dr. GRPO's aggregation
            cfg = PPOConfig(advantage_estimator=estimator, n_samples_per_prompt=2, mini_batch_size=4,
                            micro_train_batch_size=1, micro_forward_batch_size=4 // mesh.dp,
                            actor_lr=3e-4, critic_lr=3e-4, use_kl_loss=True, kl_loss_coef=0.1,
                            entropy_coeff=0.01, max_grad_norm=0.5, warmup_steps=1, critic_warmup_steps=2,
                            critic_weight_decay=0.1, total_steps=4, temperature=0.8, top_k=50, top_p=0.9,
                            loss_agg_mode="seq-mean-token-sum-norm" if estimator == "grpo" else "token-mean",
                            max_seq_len=12)
            engine = ActorCriticEngine(model, cfg, critic_lora=mlora.LoraConfig(rank=4, alpha=8, seed=5))
            metrics = engine.step(synthetic_rollouts(model.spec.vocab_size))
            record = {"metrics": metrics, "policy": gather_adapter(model, "policy")}
            if engine.critic is not None:
                record["critic"] = gather_adapter(model, "critic")
                head = model.heads["critic"] if "critic" in model.heads else None
                heads: list = [None] * dist.get_world_size()
                dist.all_gather_object(heads, {k: v.detach().clone() for k, v in head.state_dict().items()}
                                       if head is not None else None)
                record["head"] = next(h for h in heads if h is not None)
            if mesh.rank == 0:
                args.out.mkdir(parents=True, exist_ok=True)
                torch.save(record, args.out / f"{estimator}_tp{tp}pp{pp}dp{mesh.dp}.pt")
            del engine, model
        reset_parallel()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
