"""Tinker's losses (``mlora/service/losses.py``) against their owners' definitions, in float64.

- ``gspo``: SkyRL 0.3.0's own ``gspo_policy_loss`` (GSPO-token, the formula Tinker's GSPO page gives) on the
  positions ``sequence_ratio_mask`` marks: loss and gradient.
- ``dro``: the behaviour issue #907 of tinker-cookbook measured on Tinker's live service: with all advantages 0 and
  sampling log-probs 0, ``loss:sum`` is ``½·β·Σ logp²``; and its page's objective with advantages.
- What Tinker refuses is refused naming it: ``stable_reinforce`` (objective not published), ``dro`` without
  ``beta`` or with ``weights`` (#907: "unexpected keyword argument 'weights'"), ``(N, K)`` targets with ``gspo``,
  an input whose shape does not match the targets'.
"""

from __future__ import annotations

import pytest
import torch
from skyrl_oracle import algorithm_config, ppo_utils

from mlora.service.losses import check_loss, check_shapes, datum_loss

TOL = 1e-10


def _datum(seed: int, n: int = 12, prompt: int = 4):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(n, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    q = logp.detach() + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)  # some ratios clip, some do not
    mask = torch.zeros(n, dtype=torch.float64)
    mask[prompt:] = 1
    adv = torch.randn(n, generator=g, dtype=torch.float64) * mask  # the cookbook: advantages on sampled tokens only
    q = q * mask  # the cookbook pads the prompt's sampling log-probs with 0
    return logp, q, adv, mask


@pytest.mark.parametrize("seed", range(4))
def test_gspo_equals_skyrls_gspo_policy_loss(seed):
    logp, q, adv, mask = _datum(seed)
    config = check_loss("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05},
                        {"target_tokens", "logprobs", "advantages", "sequence_ratio_mask"})
    mine = datum_loss("gspo", logp, {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask}, config)
    (grad,) = torch.autograd.grad(mine, logp)
    cfg = algorithm_config(policy_loss_type="gspo", loss_reduction="sequence_mean", eps_clip_low=0.1,
                           eps_clip_high=0.05)
    ref, _ = ppo_utils().PolicyLossRegistry.get("gspo")(logp[None], q[None], adv[None], cfg, mask[None], None)
    (ref_grad,) = torch.autograd.grad(ref, logp)
    assert abs(float(mine) - float(ref)) <= TOL * max(1.0, abs(float(ref)))
    assert (grad - ref_grad).abs().max() <= TOL


def test_dro_as_tinker_computes_it():
    logp, q, adv, _ = _datum(7)
    config = check_loss("dro", {"beta": 0.05}, {"target_tokens", "logprobs", "advantages"})
    # issue #907's measurement: advantages 0 and sampling log-probs 0 leave the penalty alone, at every position
    zeros = torch.zeros_like(q)
    penalty = datum_loss("dro", logp, {"logprobs": zeros, "advantages": zeros}, config)
    assert abs(float(penalty) - 0.5 * 0.05 * float((logp.detach() ** 2).sum())) <= TOL
    loss = datum_loss("dro", logp, {"logprobs": q, "advantages": adv}, config)
    want = -(logp * adv - 0.5 * 0.05 * (logp - q) ** 2).sum()  # the DRO page's objective, negated
    assert abs(float(loss) - float(want)) <= TOL
    (grad,) = torch.autograd.grad(loss, logp)
    assert (grad - (-adv + 0.05 * (logp.detach() - q))).abs().max() <= TOL  # d/dlogp


def test_topk_targets_take_each_targets_weight():
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(5, 3, generator=g, dtype=torch.float64)
    weights = torch.rand(5, 3, generator=g, dtype=torch.float64)
    assert float(datum_loss("cross_entropy", logp, {"weights": weights}, {})) == pytest.approx(
        -float((logp * weights).sum()), abs=TOL)
    targets = torch.zeros(5, 3, dtype=torch.long)
    assert check_shapes("cross_entropy", 5, {"target_tokens": targets, "weights": weights}) == 3
    assert check_shapes("ppo", 5, {"target_tokens": targets, "logprobs": weights, "advantages": weights}) == 3


@pytest.mark.parametrize("name, config, inputs, says", [
    ("stable_reinforce", {}, {"target_tokens", "logprobs", "advantages"},
     r"'stable_reinforce' is not supported: Tinker's StableReinforce is in alpha and its page does not publish"),
    ("dro", {}, {"target_tokens", "logprobs", "advantages"}, r"needs loss_fn_config\['beta'\]"),
    ("dro", {"beta": 0.1}, {"target_tokens", "logprobs", "advantages", "weights"},
     r"\['weights'\] do not apply to it"),
    ("gspo", {}, {"target_tokens", "logprobs", "advantages"}, r"needs loss_fn_inputs \['sequence_ratio_mask'\]"),
    ("ppo", {"beta": 0.1}, {"target_tokens", "logprobs", "advantages"}, r"keys \['beta'\] do not apply"),
    ("dro", {"beta": -1.0}, {"target_tokens", "logprobs", "advantages"}, r"\['beta'\]=-1.0 must be >= 0"),
])
def test_refusals_name_what_is_wrong(name, config, inputs, says):
    with pytest.raises(ValueError, match=says):
        check_loss(name, config, inputs)


def test_shape_refusals():
    t2 = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match=r"'gspo' takes one target per position \(\[4\]\)"):
        check_shapes("gspo", 4, {"target_tokens": t2, "logprobs": torch.zeros(4, 2), "advantages": torch.zeros(4, 2),
                                 "sequence_ratio_mask": torch.ones(4)})
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['weights'\] has shape \[4\]; with target_tokens of shape "
                                         r"\[4, 2\] it must be \[4, 2\]"):
        check_shapes("cross_entropy", 4, {"target_tokens": t2, "weights": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"this datum of 5 tokens takes \[5\] or \[5, K\]"):
        check_shapes("cross_entropy", 5, {"target_tokens": t2, "weights": torch.zeros(4, 2)})
    with pytest.raises(ValueError, match="sequence_ratio_mask marks no position"):
        check_shapes("gspo", 4, {"target_tokens": torch.zeros(4, dtype=torch.long), "logprobs": torch.zeros(4),
                                 "advantages": torch.zeros(4), "sequence_ratio_mask": torch.zeros(4)})
