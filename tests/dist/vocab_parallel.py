"""torchrun worker (2 ranks, TP 2): vocab-parallel log-probs/entropy vs the full-vocabulary computation,
and the collectives they use; the same at a sampling temperature, and the log-probs of vLLM's
truncated (min-p / top-k / top-p) distribution vs :func:`vllm_rule_logprobs`, vLLM's rule applied to
the whole vocabulary. Usage: torchrun --nproc_per_node 2 vocab_parallel.py OUT_JSON"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import mlora
from mlora.parallel.accounting import count_collectives, summarize
from mlora.rl.losses import entropy_from_logits
from mlora.rl.vocab_parallel import vocab_parallel_logprobs, vocab_parallel_sampling_logprobs

V, PADDED = 1001, 1002  # vocabulary padded to a multiple of TP, as the model does
# (temperature, top_k, top_p, min_p): nucleus alone, top-k alone, all three, min-p alone, k = 1
SAMPLING = [(0.7, -1, 0.9, 0.0), (1.3, 20, 1.0, 0.0), (0.7, 50, 0.8, 0.01), (1.0, -1, 1.0, 0.05),
            (0.6, 1, 0.95, 0.0)]


def vllm_rule_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                       min_p: float) -> torch.Tensor:
    """Log-probs over the whole vocabulary as vLLM 0.32 samples (``logprobs_mode="processed_logprobs"``),
    written out as its native path does it: divide by T; min-p (``p < min_p · max p`` -> -inf);
    sort ascending; top-k (``< k-th largest`` -> -inf); softmax, cumsum, ``<= 1 - top_p`` -> -inf
    except the last (largest); scatter back; log_softmax."""
    u = logits.float() / temperature
    if min_p > 0:
        probs = u.softmax(-1)
        u = u.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p, float("-inf"))
    ascending, index = u.sort(dim=-1)
    if 0 < top_k < u.shape[-1]:
        kth = ascending.gather(-1, torch.full_like(index[..., :1], u.shape[-1] - top_k))
        ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    if top_p < 1:
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        ascending = ascending.masked_fill(drop, float("-inf"))
    return u.scatter(-1, index, ascending).log_softmax(-1)


def _correction_case(full, target, lo, per, valid, mesh, g) -> dict:
    """Rollout correction on vocab-parallel log-probs: token TIS + an outlier mask on PPO's loss, and SkyRL's
    rollout_is loss, with the gradients they send into each rank's vocabulary shard, vs the same on the full
    vocabulary (float64). The engine's log-probs μ are the trainer's plus noise (a bf16 engine)."""
    from mlora.rl.losses import policy_loss
    from mlora.rl.rollout_correction import OffPolicyCorrection, off_policy_correction, rollout_is_loss

    temperature = 0.8
    mask = torch.ones(3, 7, dtype=torch.float64)
    mask[2, 5:] = 0
    adv = torch.randn(3, 7, generator=g, dtype=torch.float64)
    noise = 0.3 * torch.randn(3, 7, generator=g, dtype=torch.float64)
    cfg = OffPolicyCorrection(tis_ratio_type="token", token_tis_ratio_clip_high=1.2,
                              outlier_token_is_threshold_high=2.0)
    out = {}
    for name in ("ppo_tis", "rollout_is"):
        results = []
        for shard in (True, False):
            logits = (full[..., lo:lo + per] if shard else full[..., :full.shape[-1] - 1]).double().requires_grad_(True)
            if shard:
                lp, _ = vocab_parallel_logprobs(logits, target, lo, valid, mesh.tp_group, False, temperature)
            else:
                lp = torch.log_softmax(logits / temperature, -1).gather(-1, target[..., None])[..., 0]
            old = lp.detach()
            mu = old + noise
            weights, metrics = off_policy_correction(old, mu, mask, cfg)
            if name == "ppo_tis":
                loss, _ = policy_loss(lp, old - 0.1, adv, mask, token_weights=weights)
            else:
                loss, _ = rollout_is_loss(lp, mu, adv, mask, 0.5, 0.5, token_weights=weights)
            loss.backward()
            grad = logits.grad if shard else torch.cat([logits.grad, torch.zeros(3, 7, full.shape[-1] - logits.shape[-1],
                                                                                  dtype=torch.float64)], -1)[..., lo:lo + per]
            results.append((loss.detach(), grad, metrics))
        (l_tp, g_tp, m_tp), (l_ref, g_ref, m_ref) = results
        out[name] = {"loss": (l_tp - l_ref).abs().item(), "grad": (g_tp - g_ref).abs().max().item(),
                     "grad_norm": g_ref.norm().item(), "metrics_equal": m_tp == m_ref,
                     "clipped": m_ref["tis_token_clip_high_ratio"], "masked": m_ref["outlier_seq_masked_ratio"]}
    return out


def main() -> None:
    mesh = mlora.init_parallel(tp=2, pp=1)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 7, PADDED, generator=g) * 3
    target = torch.randint(0, V, (3, 7), generator=g)
    target[0, 0], target[1, 1] = 0, V - 1  # first and last real ids, one in each shard
    w_lp, w_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    per = PADDED // 2
    lo = mesh.tp_rank * per
    local = full[..., lo:lo + per].clone().requires_grad_(True)
    valid = min(per, V - lo)
    with count_collectives() as calls:
        lp, ent = vocab_parallel_logprobs(local, target, lo, valid, mesh.tp_group, with_entropy=True)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    ref_logits = full[..., :V].clone().requires_grad_(True)
    ref_lp = torch.log_softmax(ref_logits, -1).gather(-1, target[..., None])[..., 0]
    ref_ent = entropy_from_logits(ref_logits)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    ref_grad = torch.cat([ref_logits.grad, torch.zeros(3, 7, PADDED - V)], -1)[..., lo:lo + per]
    record = {"rank": mesh.rank, "lp": (lp - ref_lp).abs().max().item(), "ent": (ent - ref_ent).abs().max().item(),
              "grad": (local.grad - ref_grad).abs().max().item(),
              "collectives": {k: list(v) for k, v in summarize(calls).items()},
              "vocab_bytes": full[..., :per].numel() * 4, "sampling": []}
    for temperature, top_k, top_p, min_p in SAMPLING:
        # tempered: in float64, so that 1e-5 measures the method and not float32 rounding of z / T
        local = full[..., lo:lo + per].double().requires_grad_(True)
        lp, ent = vocab_parallel_logprobs(local, target, lo, valid, mesh.tp_group, True, temperature)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        ref_logits = full[..., :V].double().requires_grad_(True)
        ref_lp = torch.log_softmax(ref_logits / temperature, -1).gather(-1, target[..., None])[..., 0]
        ref_ent = entropy_from_logits(ref_logits / temperature)
        ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
        ref_grad = torch.cat([ref_logits.grad, torch.zeros(3, 7, PADDED - V)], -1)[..., lo:lo + per]
        # truncated: float32 like vLLM; tokens drawn from vLLM's distribution (the same draw on both
        # ranks), as the engine would sample
        processed = vllm_rule_logprobs(full[..., :V], temperature, top_k, top_p, min_p)
        drawn = torch.multinomial(processed.exp().reshape(-1, V), 1, generator=g).reshape(3, 7)
        with count_collectives() as calls:
            sampled = vocab_parallel_sampling_logprobs(full[..., lo:lo + per], drawn, lo, valid, mesh.tp_group,
                                                       temperature, top_k, top_p, min_p)
        ref_sampled = processed.gather(-1, drawn[..., None])[..., 0]
        record["sampling"].append({
            "config": [temperature, top_k, top_p, min_p], "lp": (lp - ref_lp).abs().max().item(),
            "ent": (ent - ref_ent).abs().max().item(), "grad": (local.grad - ref_grad).abs().max().item(),
            "sampled": (sampled - ref_sampled).abs().max().item(),
            "untempered_gap": (torch.log_softmax(full[..., :V], -1).gather(-1, drawn[..., None])[..., 0]
                               - ref_sampled).abs().mean().item(),
            "kept_mass": (torch.log_softmax(full[..., :V] / temperature, -1).gather(-1, drawn[..., None])[..., 0]
                          - ref_sampled).exp().mean().item(),  # M = p_T(y) / p_processed(y): truncation happened
            "collectives": {k: list(v) for k, v in summarize(calls).items()}})
    record["correction"] = _correction_case(full, target, lo, per, valid, mesh, g)
    # K targets per position (a teacher's top-K, Tinker's (N, K) target_tokens), with the entropy: float64
    targets = torch.randint(0, V, (3, 7, 4), generator=g)
    targets[0, 0, 0], targets[1, 1, 3] = 0, V - 1
    w_k = torch.randn(3, 7, 4, generator=g, dtype=torch.float64)
    local = full[..., lo:lo + per].double().requires_grad_(True)
    with count_collectives() as calls:
        lp, ent = vocab_parallel_logprobs(local, targets, lo, valid, mesh.tp_group, True)
        ((lp * w_k).sum() + (ent * w_ent).sum()).backward()
    ref_logits = full[..., :V].double().requires_grad_(True)
    ref_lp = torch.log_softmax(ref_logits, -1).gather(-1, targets)
    ((ref_lp * w_k).sum() + (entropy_from_logits(ref_logits) * w_ent).sum()).backward()
    ref_grad = torch.cat([ref_logits.grad, torch.zeros(3, 7, PADDED - V, dtype=torch.float64)], -1)[..., lo:lo + per]
    record["multi"] = {"shape": list(lp.shape), "lp": (lp - ref_lp).abs().max().item(),
                       "grad": (local.grad - ref_grad).abs().max().item(),
                       "collectives": {k: list(v) for k, v in summarize(calls).items()}}
    parts: list = [None] * 2
    dist.all_gather_object(parts, record)
    if mesh.rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(parts, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
