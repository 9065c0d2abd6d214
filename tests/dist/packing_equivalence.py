"""torchrun worker (and in-process helper): packed vs padded micro-batches on a batch whose lengths
spread 12x, for PPO (actor + critic), GRPO, SFT, RM and DPO; records what the comparison needs.

Usage: torchrun ... packing_equivalence.py MODEL_DIR ADAPTER OUT_DIR LAYOUTS
(ADAPTER: a random non-zero PEFT adapter, loaded as every trained adapter)
LAYOUTS "tp,pp[,sp][:recompute];..."; writes OUT_DIR/{padded,packed,budget}_tp{tp}pp{pp}[sp]_{recompute}.pt
(budget: packed under a budget of two rows' width), each a dict per stage with the
metrics, the forward-pass log-probs and values (PPO) and the reduced LoRA (and head) gradients.
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
import mlora.train.joint_passes as passes_module  # noqa: E402
from mlora.parallel import reset_parallel  # noqa: E402
from mlora.train.batch import RolloutBatch  # noqa: E402
from mlora.train.config import PPOConfig  # noqa: E402
from mlora.train.engine import ActorCriticEngine  # noqa: E402
from mlora.train.micro_batches import Packing  # noqa: E402
from mlora.train.preference_data import SequenceBatch  # noqa: E402
from mlora.train.preference_engine import PreferenceConfig, PreferenceEngine  # noqa: E402

PROMPT = 3
# prompt + response tokens per row: 4 .. 48, a 12x spread; rows 2k and 2k+1 share a prompt (GRPO groups)
LENGTHS = (4, 48, 6, 40, 5, 33, 4, 27)
WIDTH = max(LENGTHS)


def rows(vocab: int, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and response mask of :data:`LENGTHS`."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(LENGTHS), WIDTH), generator=g)
    attn = torch.zeros_like(ids)
    resp = torch.zeros_like(ids)
    for i, n in enumerate(LENGTHS):
        attn[i, :n] = 1
        resp[i, PROMPT:n] = 1
        ids[i, n:] = 0
    for i in range(1, len(LENGTHS), 2):
        ids[i, :PROMPT] = ids[i - 1, :PROMPT]
    return ids, attn, resp


def rollouts(vocab: int) -> RolloutBatch:
    ids, attn, resp = rows(vocab)
    g = torch.Generator().manual_seed(3)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25, 1.0, 0.0])
    return RolloutBatch(ids, attn, resp, rewards, -torch.rand(len(LENGTHS), WIDTH - 1, generator=g) * 4)


def run(model, adapter_dir: Path, packing: Packing) -> dict:
    """Every stage's results on this mesh with ``packing`` (collective; the same dict on every rank)."""
    mesh, out = model.mesh, {}
    vocab = model.spec.vocab_size
    for estimator in ("gae", "grpo"):
        model.load_adapter("policy", adapter_dir, trainable=True)
        if estimator == "gae":
            model.load_adapter("critic", adapter_dir, trainable=True)
            model.add_value_head("critic", seed=1, init_std=0.05)
        cfg = PPOConfig(advantage_estimator=estimator, n_samples_per_prompt=2, mini_batch_size=8,
                        micro_train_batch_size=2 // mesh.dp, micro_forward_batch_size=4 // mesh.dp, actor_lr=3e-3,
                        # no entropy term: SkyRL's is a token mean per micro-batch, which a token budget regroups
                        critic_lr=3e-3, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.0, total_steps=4,
                        temperature=0.9, top_k=20, lr_schedule="constant", critic_lr_schedule="constant",
                        loss_agg_mode="seq-mean-token-mean" if estimator == "grpo" else "token-mean",
                        packing=packing)
        engine = ActorCriticEngine(model, cfg)
        batch = rollouts(vocab)
        logprobs = engine._forward_pass(batch, ("policy",), values=False)
        values = engine._forward_pass(batch, ("critic",), values=True) if engine.critic else None
        grads: dict = {}
        real_clip = passes_module.clip_grads

        def clip_and_record(params, max_norm):  # the reduced gradients of each update, in PEFT names
            name = "policy" if params is engine.actor_params else "critic"
            grads[name] = adapter_grads(model, name, "critic" if name == "critic" else None)
            return real_clip(params, max_norm)

        passes_module.clip_grads = clip_and_record
        try:
            metrics = engine.step(batch)
        finally:
            passes_module.clip_grads = real_clip
        out[estimator] = {"metrics": metrics, "logprobs": logprobs, "values": values, "mask": batch.action_mask,
                          "grads": grads}
        clear_adapters(model)
    ids, attn, resp = rows(vocab)
    micro = max(1, 2 // mesh.dp)
    for stage in ("sft", "dpo", "rm"):
        adapter = "reward" if stage == "rm" else "policy"
        model.load_adapter(adapter, adapter_dir, trainable=True)
        engine = PreferenceEngine(model, PreferenceConfig(stage=stage, micro_batch_size=micro, packing=packing))
        if stage == "sft":
            batch = SequenceBatch(ids, attn, resp)
        else:  # pairs: chosen rows 0..3, rejected rows 4..7 (a short chosen against a long rejected and so on)
            batch = SequenceBatch(ids, attn, resp, pairs=True)
        metrics = engine.forward_backward(batch)
        out[stage] = {"metrics": metrics, "grads": adapter_grads(model, adapter, engine.head)}
        clear_adapters(model)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("adapter", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("layouts")
    args = ap.parse_args()
    for layout in args.layouts.split(";"):
        mesh_spec, _, recompute = layout.partition(":")
        (tp, pp, sp), recompute = parse_layouts(mesh_spec)[0], recompute or "none"
        mesh = mlora.init_parallel(tp=tp, pp=pp, sp=sp)
        model = mlora.from_pretrained(args.model_dir, mesh, recompute=recompute)
        for name, packing in (("padded", Packing()), ("packed", Packing(enabled=True)),
                              ("budget", Packing(enabled=True, max_tokens=2 * WIDTH))):
            record = run(model, args.adapter, packing)
            if mesh.rank == 0:
                args.out.mkdir(parents=True, exist_ok=True)
                torch.save(record, args.out / f"{name}_tp{tp}pp{pp}{'sp' if sp else ''}_{recompute}.pt")
        del model
        reset_parallel()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
