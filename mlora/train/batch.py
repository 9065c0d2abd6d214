"""The rollout batch the trainer consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RolloutBatch:
    """Prompts and sampled responses, right-padded to one length ``S``.

    ``response_mask`` is 1 on response tokens. Per-token quantities (log-probs, values,
    advantages) live on the ``S - 1`` *action* positions: position ``t`` holds the prediction
    of token ``t + 1``. ``rewards`` are outcome rewards, one per sequence. Multi-turn rollouts hold the
    model's tokens only in ``response_mask`` (environment tokens are 0 there) and may place their turns'
    rewards per token in ``token_rewards`` (``rewards`` is then their sum).
    """

    input_ids: torch.Tensor  # [B, S] int64
    attention_mask: torch.Tensor  # [B, S]
    response_mask: torch.Tensor  # [B, S]
    rewards: torch.Tensor  # [B]
    rollout_logprobs: torch.Tensor | None = None  # [B, S - 1], from the inference engine
    # [B] 0/1: a 0 row's tokens stay out of the loss (DAPO's overlong filtering) but keep their reward,
    # so group statistics (GRPO, RLOO) still see it, as in SkyRL
    loss_mask: torch.Tensor | None = None
    # [B, S - 1]: rewards on action positions (multi-turn: each turn's on its last model token); None: each
    # row's outcome reward on its last response position
    token_rewards: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b, s = self.input_ids.shape
        for name in ("attention_mask", "response_mask"):
            if tuple(getattr(self, name).shape) != (b, s):
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, input_ids {(b, s)}")
        if tuple(self.rewards.shape) != (b,):
            raise ValueError(f"rewards must have shape ({b},), got {tuple(self.rewards.shape)}")
        if self.loss_mask is not None and tuple(self.loss_mask.shape) != (b,):
            raise ValueError(f"loss_mask must have shape ({b},), got {tuple(self.loss_mask.shape)}")
        if self.token_rewards is not None and tuple(self.token_rewards.shape) != (b, s - 1):
            raise ValueError(f"token_rewards must have shape {(b, s - 1)}, got {tuple(self.token_rewards.shape)}")
        empty = (self.response_positions.sum(-1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"responses of length zero in rows {empty[:8]}; every sequence needs at least one "
                             "response token (drop empty generations before training)")

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_positions(self) -> torch.Tensor:
        """``[B, S - 1]`` float: 1 where position ``t`` predicts a response token."""
        return (self.response_mask[:, 1:] * self.attention_mask[:, 1:]).float()

    @property
    def response_span(self) -> torch.Tensor:
        """``[B, S - 1]`` float: 1 from each row's first to its last response position (SkyRL's ``response_mask``:
        a multi-turn row's environment tokens between the model's turns included)."""
        mask = self.response_positions
        pos = torch.arange(mask.shape[1])
        has = mask > 0
        first = torch.where(has, pos, mask.shape[1]).min(dim=1, keepdim=True).values
        last = torch.where(has, pos, -1).max(dim=1, keepdim=True).values
        return ((pos >= first) & (pos <= last)).to(mask.dtype)

    @property
    def last_response_position(self) -> torch.Tensor:
        """``[B]`` long: each row's last response position (where an outcome reward sits)."""
        mask = self.response_positions
        return mask.shape[1] - 1 - torch.flip(mask, dims=[1]).argmax(dim=1)

    @property
    def action_mask(self) -> torch.Tensor:
        """``[B, S - 1]`` float: the positions that enter the loss, :attr:`response_positions` of the rows
        ``loss_mask`` keeps."""
        mask = self.response_positions
        return mask if self.loss_mask is None else mask * self.loss_mask[:, None].to(mask.dtype)

    def rows(self, index: slice) -> "RolloutBatch":
        return RolloutBatch(self.input_ids[index], self.attention_mask[index], self.response_mask[index],
                            self.rewards[index],
                            None if self.rollout_logprobs is None else self.rollout_logprobs[index],
                            None if self.loss_mask is None else self.loss_mask[index],
                            None if self.token_rewards is None else self.token_rewards[index])


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Rows of several batches as one, right-padded to the widest (``pad_id`` tokens, zero masks, log-probs and
    rewards); optional fields kept when every batch has them."""
    width = max(b.input_ids.shape[1] for b in batches)

    def padded(t: torch.Tensor, value: float, w: int) -> torch.Tensor:
        pad = t.new_full((t.shape[0], w - t.shape[1]), value)
        return torch.cat([t, pad], dim=1)

    def joined(name: str, value: float, w: int) -> torch.Tensor | None:
        parts = [getattr(b, name) for b in batches]
        if any(p is None for p in parts):
            return None
        return torch.cat([padded(p, value, w) if p.dim() == 2 else p for p in parts])

    return RolloutBatch(joined("input_ids", pad_id, width), joined("attention_mask", 0, width),
                        joined("response_mask", 0, width), torch.cat([b.rewards for b in batches]),
                        joined("rollout_logprobs", 0.0, width - 1),
                        None if all(b.loss_mask is None for b in batches)
                        else torch.cat([torch.ones(b.size) if b.loss_mask is None else b.loss_mask for b in batches]),
                        joined("token_rewards", 0.0, width - 1))
