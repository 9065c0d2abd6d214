"""SFT, reward-model and DPO stages on the shared frozen base, through megatron's schedules.

One engine, three losses; the machinery is the PPO engine's (:mod:`mlora.train.collectives`):
micro-batches through ``model.forward_backward`` at any TP×PP×DP, vocab-parallel log-probs, losses
normalised by global counts so that the plain sum of gradients over micro-batches and DP ranks is
the gradient of the batch loss, gradients reduced once per step (:mod:`mlora.lora.grads`).

- ``sft``: adapter ``policy``; masked token NLL on the response tokens (:func:`mlora.rl.sft_nll`).
- ``rm``: adapter ``reward`` + a bias-free scalar head (HF's sequence-classification ``score``) on
  the final hidden state of the last non-pad token; Bradley-Terry loss on (chosen, rejected).
- ``dpo``: adapter ``policy``; the reference is the same base with the trained adapter off (plus
  any frozen stacked adapters, e.g. an SFT adapter): no second model. Chosen and rejected go
  through one forward as one batch of 2B rows.

Each DP rank takes its slice of the batch's examples; a pair's chosen and rejected rows always
travel together in one micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from mlora.checkpoint.run_state import SCORE_HEAD, StageState, TrainedAdapter, head_parameters
from mlora.facade.model import MLoraModel
from mlora.lora.config import LoraConfig
from mlora.lora.grads import clip_grads, finalize_grads
from mlora.rl.lr_schedule import LR_SCHEDULES
from mlora.rl.preference import (
    DPO_LOSS_TYPES,
    PREFERENCE_STAGES,
    bradley_terry_loss,
    check_dpo_args,
    dpo_loss,
    sft_nll,
)
from mlora.rl.vocab_parallel import next_token_logits, vocab_parallel_logprobs
from mlora.train.collectives import dp_gather, from_last_stage, model_mode, reduce_metrics
from mlora.train.micro_batches import Packing, group_units, in_row_order, last_token_scores, micro_batch, unpack_tokens
from mlora.train.optim import build_optimizer
from mlora.train.preference_data import SequenceBatch

DEFAULT_ADAPTER = {"sft": "policy", "rm": "reward", "dpo": "policy"}


@dataclass
class PreferenceConfig:
    """Hyper-parameters of one SFT / reward-model / DPO run (TRL's names where TRL has them)."""

    stage: str = "dpo"  # sft | rm | dpo
    beta: float = 0.1  # DPO: β of the implicit reward β·log π/π_ref (IPO: τ)
    label_smoothing: float = 0.0  # DPO sigmoid: conservative DPO's ε in [0, 0.5)
    loss_type: str = "sigmoid"  # DPO: sigmoid | ipo
    margin: float | None = None  # RM: Bradley-Terry margin subtracted from r_c - r_r (None: 0)
    head_init_std: float = 0.02  # RM: score head ~ N(0, std²) (HF's initializer_range default)
    micro_batch_size: int = 2  # examples (pairs for rm/dpo) per micro-batch on one DP rank
    packing: Packing = field(default_factory=Packing)  # sequence packing (trainer.use_sample_packing)
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    lr_schedule: str = "constant"

    def __post_init__(self) -> None:
        if self.stage not in PREFERENCE_STAGES:
            raise ValueError(f"unknown stage {self.stage!r}; valid: {', '.join(PREFERENCE_STAGES)}")
        if self.stage == "dpo":
            check_dpo_args(self.beta, self.label_smoothing, self.loss_type)
        elif self.loss_type not in DPO_LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown lr_schedule {self.lr_schedule!r}; valid: {', '.join(LR_SCHEDULES)}")
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={self.micro_batch_size} must be >= 1")
        if self.head_init_std < 0:
            raise ValueError(f"head_init_std={self.head_init_std} must be >= 0")

    @property
    def pairs(self) -> bool:
        return self.stage in ("rm", "dpo")


class PreferenceEngine:
    """Trains one adapter (and, for ``rm``, its scalar head) with the SFT, reward-model or DPO loss."""

    def __init__(self, model: MLoraModel, cfg: PreferenceConfig, adapter: str | None = None,
                 reference_adapters: Sequence[str] = (), lora: LoraConfig | None = None) -> None:
        self.model, self.cfg, self.mesh = model, cfg, model.mesh
        self.adapter = adapter or DEFAULT_ADAPTER[cfg.stage]
        self.reference = tuple(reference_adapters)
        model._require(*self.reference)
        if self.adapter in self.reference:
            raise ValueError(f"adapter {self.adapter!r} is also in reference_adapters {list(self.reference)}")
        if self.adapter not in model.adapters:
            model.add_adapter(self.adapter, lora or LoraConfig())
        model.require_peft_loadable(self.adapter)  # exported in PEFT's format (the final adapter)
        model.set_trainable(self.adapter, True)
        self.head = self.adapter if cfg.stage == "rm" else None
        params = model.adapter_parameters(self.adapter)
        if self.head is not None:
            if self.head not in model.heads:  # on the last stage only (None elsewhere)
                model.add_value_head(self.head, seed=0, init_std=cfg.head_init_std, bias=False)
            if self.head in model.heads:  # a loaded reward adapter's head comes frozen
                model.heads[self.head].requires_grad_(True)
                params = params + list(model.heads[self.head].parameters())
        self.params = params
        self.opt, self.sched = build_optimizer(params, cfg.lr, weight_decay=cfg.weight_decay, betas=cfg.betas,
                                               warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps,
                                               min_lr_ratio=cfg.min_lr_ratio, schedule=cfg.lr_schedule)
        self.global_step = 0

    def stage_state(self) -> StageState:
        """What this engine trains, for :mod:`mlora.checkpoint.run_state`: the adapter and, for ``rm``,
        its bias-free score head."""
        head = head_parameters(self.model, self.head, SCORE_HEAD) if self.head is not None else {}
        return StageState(self.cfg.stage, [TrainedAdapter("actor", self.adapter, self.opt, self.sched, head)],
                          {"global_step": self.global_step})

    def restore_counters(self, counters: dict[str, float]) -> None:
        self.global_step = int(counters["global_step"])

    @property
    def active(self) -> tuple[str, ...]:
        """Adapters of the trained model: the frozen stacked ones, then the trained one."""
        return self.reference + (self.adapter,)

    # ------------------------------------------------------------------ layout
    def _check(self, batch: SequenceBatch) -> None:
        if batch.pairs != self.cfg.pairs:
            raise ValueError(f"stage {self.cfg.stage!r} trains on {'pairs' if self.cfg.pairs else 'single responses'}"
                             f", got a batch of {'pairs' if batch.pairs else 'single responses'}")
        per = self.cfg.micro_batch_size * self.mesh.dp
        if batch.size % per:
            raise ValueError(f"a batch of {batch.size} examples is not divisible by micro_batch_size x DP = "
                             f"{self.cfg.micro_batch_size} x {self.mesh.dp}; valid batch sizes are multiples of {per}")

    def _micro_batches(self, batch: SequenceBatch, extra: dict[str, torch.Tensor]) -> list[dict]:
        """This DP rank's examples in micro-batches (``micro_batch_size`` each, or packed under the token
        budget; a pair's rows always together); ``extra`` holds per-row tensors. Each micro-batch holds
        ``rows``, its examples' places in the slice."""
        per = batch.size // self.mesh.dp
        first = self.mesh.dp_rank * per
        examples = torch.arange(first, first + per)
        lengths = batch.attention_mask.sum(-1)
        tokens = (lengths[examples] + (lengths[examples + batch.size] if batch.pairs else 0)).tolist()
        unit_width = batch.input_ids.shape[1] * (2 if batch.pairs else 1)
        per_row = {"action_mask": batch.action_mask, **extra}
        out = []
        for group in group_units(tokens, self.cfg.micro_batch_size, self.cfg.packing, unit_width):
            local = torch.tensor(group)
            ex = local + first
            rows = torch.cat([ex, ex + batch.size]) if batch.pairs else ex  # chosen rows, then rejected
            mb = micro_batch(batch.input_ids, batch.attention_mask, rows, per_row, self.cfg.packing.enabled,
                             self.mesh.device)
            mb["rows"] = local
            out.append(mb)
        return out

    # ------------------------------------------------------------------ per micro-batch quantities
    def _token_logprobs(self, logits: torch.Tensor, mb: dict) -> torch.Tensor:
        """``[rows, S - 1]`` log-probs of the next tokens; vocab-parallel."""
        lo, hi = self.model.vocab_shard_range()
        logprob = vocab_parallel_logprobs(next_token_logits(logits), mb["input_ids"][:, 1:].to(logits.device), lo,
                                          hi - lo, self.mesh.tp_group if self.mesh.tp > 1 else None, False, 1.0)[0]
        return unpack_tokens(logprob, mb, 1)

    def _seq_logps(self, logits: torch.Tensor, mb: dict) -> torch.Tensor:
        mask = mb["action_mask"].to(logits.device)
        return (self._token_logprobs(logits, mb).float() * mask).sum(-1)

    def _scores(self, hidden: torch.Tensor, mb: dict) -> torch.Tensor:
        """The head on the final hidden state of each row's last non-pad token (HF's sequence classifier)."""
        return last_token_scores(self.model.heads[self.head], hidden, mb)

    # ------------------------------------------------------------------ losses
    def _loss_fn(self, batch: SequenceBatch):
        c = self.cfg
        n = float(batch.size)
        if c.stage == "sft":
            tokens = float(batch.action_mask.sum())

            def sft(logits, mb):
                mask = mb["action_mask"].to(logits.device)
                lp = self._token_logprobs(logits, mb)
                loss = sft_nll(lp, mask, normalizer=tokens)
                return loss, {"loss": loss.detach()}

            return sft
        if c.stage == "rm":
            def rm(hidden, mb):
                scores = self._scores(hidden, mb)
                chosen, rejected = scores.chunk(2)
                losses = bradley_terry_loss(chosen, rejected, c.margin)
                loss = losses.sum() / n
                d = (chosen - rejected).detach()
                return loss, {"loss": loss.detach(), "accuracy": (d > 0).float().sum() / n, "margin": d.sum() / n,
                              "rewards/chosen": chosen.detach().sum() / n,
                              "rewards/rejected": rejected.detach().sum() / n}

            return rm

        def dpo(logits, mb):
            logps = self._seq_logps(logits, mb)
            ref = mb["ref_logps"].to(logps.device)
            chosen, rejected = logps.chunk(2)
            ref_c, ref_r = ref.chunk(2)
            len_c, len_r = mb["action_mask"].sum(-1).to(logps.device).chunk(2)
            losses, rc, rr = dpo_loss(chosen, rejected, ref_c, ref_r, c.beta, c.label_smoothing, c.loss_type,
                                      len_c, len_r)
            loss = losses.sum() / n
            return loss, {"loss": loss.detach(), "rewards/chosen": rc.sum() / n, "rewards/rejected": rr.sum() / n,
                          "rewards/accuracies": (rc > rr).float().sum() / n, "rewards/margins": (rc - rr).sum() / n,
                          "logps/chosen": chosen.detach().sum() / n, "logps/rejected": rejected.detach().sum() / n}

        return dpo

    # ------------------------------------------------------------------ passes
    @torch.no_grad()
    def reference_logps(self, batch: SequenceBatch) -> torch.Tensor:
        """``[R]`` sequence log-probs of every row under the reference (the base with the trained
        adapter off, frozen stacked adapters on), in eval mode, on every rank."""
        mbs = self._micro_batches(batch, {})
        fn = lambda logits, mb: (torch.zeros(()), {"out": self._seq_logps(logits, mb).reshape(2, -1).T})  # noqa: E731
        with self.model.use_adapters(*self.reference), model_mode(self.model, training=False):
            outs = self.model.forward_backward(mbs, fn, forward_only=True)
        local = in_row_order(outs, mbs)  # [pairs here, 2] in example order
        local = from_last_stage(self.mesh, local, (batch.size // self.mesh.dp, 2))
        both = dp_gather(self.mesh, local).cpu()  # [pairs, 2] in example order
        return torch.cat([both[:, 0], both[:, 1]])

    def _extra(self, batch: SequenceBatch) -> dict[str, torch.Tensor]:
        return {"ref_logps": self.reference_logps(batch)} if self.cfg.stage == "dpo" else {}

    def forward_backward(self, batch: SequenceBatch) -> dict[str, float]:
        """The batch loss's gradients of the trained parameters, reduced over TP and DP (no optimizer
        step); returns the batch metrics (means over examples), identical on every rank."""
        self._check(batch)
        mbs = self._micro_batches(batch, self._extra(batch))
        self.opt.zero_grad(set_to_none=True)
        with self.model.use_adapters(*self.active), model_mode(self.model, training=True):
            outs = self.model.forward_backward(mbs, self._loss_fn(batch), hidden_states=self.head is not None)
        finalize_grads(self.params)
        return reduce_metrics(self.mesh, outs)

    def step(self, batch: SequenceBatch) -> dict[str, float]:
        """One optimizer step on ``batch`` (every rank passes the same global batch)."""
        metrics = self.forward_backward(batch)
        metrics["grad_norm"] = float(clip_grads(self.params, self.cfg.max_grad_norm))
        metrics["lr"] = self.sched.get_last_lr()[0]
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.global_step += 1
        return metrics

    @torch.no_grad()
    def evaluate(self, batch: SequenceBatch) -> dict[str, float]:
        """The batch metrics without training (eval mode, forward only), identical on every rank."""
        self._check(batch)
        mbs = self._micro_batches(batch, self._extra(batch))
        with self.model.use_adapters(*self.active), model_mode(self.model, training=False):
            outs = self.model.forward_backward(mbs, self._loss_fn(batch), forward_only=True,
                                               hidden_states=self.head is not None)
        return reduce_metrics(self.mesh, outs)

    def evaluate_all(self, batches: Sequence[SequenceBatch]) -> dict[str, float]:
        """Example-weighted means of :meth:`evaluate` over several batches (a held-out split)."""
        total, sums = 0, {}
        for b in batches:
            for k, v in self.evaluate(b).items():
                sums[k] = sums.get(k, 0.0) + v * b.size
            total += b.size
        return {k: v / max(total, 1) for k, v in sums.items()}
