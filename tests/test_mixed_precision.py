"""Mixed precision that trains: float32 master factors, heads and AdamW state under a bf16 base (issue 20).

100 AdamW steps at lr 1e-5 (a real LoRA learning rate) with a bf16 base must move every A and B like
float32 training does; the old layout (bf16 factors, bf16 AdamW state) is run as a control and must
fail the same bound, so the test can fail. A checkpoint of a bf16 run holds the float32 masters and
resumes exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mlora
from mlora.testing import right_padded_batch
from mlora.train.optim import build_optimizer

STEPS, LR = 100, 1e-5
COSINE_MIN, NORM_RATIO = 0.99, (0.9, 1.1)  # issue 20's bounds on the total update of every factor
LENS = [12, 9, 12, 7]


@pytest.fixture(scope="module")
def mesh1():
    return mlora.init_parallel(tp=1, pp=1)


def _batch(model):
    ids, mask = right_padded_batch(model.spec.vocab_size, LENS, seed=3)
    return ids, mask


def _nll_loss(ids, mask, vocab):
    def loss_fn(logits, mb):
        logp = torch.log_softmax(logits[:, :-1, :vocab].float(), -1)
        nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]
        return nll.sum() / mask[:, 1:].sum(), {}
    return loss_fn


def _factors(model, name="policy") -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.gpt.named_parameters() if f".lora.{name}." in n}


def _train(model, params, steps: int, opt=None, sched=None):
    ids, mask = _batch(model)
    if opt is None:
        opt, sched = build_optimizer(params, LR, 0.0, (0.9, 0.999), 0, steps, 0.0, "constant")
    loss_fn = _nll_loss(ids, mask, model.spec.vocab_size)
    model.train()
    for _ in range(steps):
        model.forward_backward([{"input_ids": ids, "attention_mask": mask}], loss_fn=loss_fn)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    return opt, sched


def _updates(model, old_layout: bool = False) -> dict[str, torch.Tensor]:
    model.add_adapter("policy", mlora.LoraConfig(rank=8, alpha=16, init_method="kaiming"))
    if old_layout:  # what the code did before issue 20: factors in the base dtype, computed in it
        for linear in model._lora_linears():
            if "policy" not in linear.lora:
                continue
            branch = linear.lora["policy"]
            branch.to(model.dtype)
            branch.compute_dtype = None
    before = _factors(model)
    _train(model, model.adapter_parameters("policy"), STEPS)
    after = _factors(model)
    return {n: after[n] - before[n] for n in before}


@pytest.fixture(scope="module")
def updates(tiny_models, mesh1):
    path = tiny_models / "llama"
    fp32 = _updates(mlora.from_pretrained(path, mesh1, dtype=torch.float32))
    bf16 = _updates(mlora.from_pretrained(path, mesh1, dtype=torch.bfloat16))
    bf16_branch = _updates(mlora.from_pretrained(path, mesh1, dtype=torch.bfloat16,
                                                 lora_compute_dtype=torch.bfloat16))
    old = _updates(mlora.from_pretrained(path, mesh1, dtype=torch.bfloat16), old_layout=True)
    return fp32, {"bf16 base, float32 branch": bf16, "bf16 base, bf16 branch": bf16_branch, "old bf16 factors": old}


def _agreement(ref: dict, got: dict) -> tuple[float, float, float]:
    """(min cosine, min norm ratio, max norm ratio) of ``got``'s updates against ``ref``'s, per factor."""
    cos = [F.cosine_similarity(got[n].flatten(), ref[n].flatten(), dim=0).item() for n in ref]
    ratio = [(got[n].norm() / ref[n].norm()).item() for n in ref]
    return min(cos), min(ratio), max(ratio)


def test_bf16_base_moves_adapters_like_float32(updates):
    fp32, runs = updates
    assert len(fp32) == 4 * (4 + 2 + 3 + 2) and all(u.abs().sum() > 0 for u in fp32.values())
    for label, got in runs.items():
        cos, lo, hi = _agreement(fp32, got)
        print(f"{label}: update cosine vs float32 min {cos:.4f}, norm ratio {lo:.3f}-{hi:.3f}")
        if label == "old bf16 factors":
            assert cos < COSINE_MIN or lo < NORM_RATIO[0], "the control should fail the bound"
        else:
            assert cos >= COSINE_MIN and NORM_RATIO[0] <= lo and hi <= NORM_RATIO[1], label


def test_masters_heads_and_optimizer_state_are_float32(tiny_models, mesh1, tmp_path):
    model = mlora.from_pretrained(tiny_models / "llama", mesh1, dtype=torch.bfloat16)
    model.add_adapter("policy", mlora.LoraConfig(rank=4))
    head = model.add_value_head("critic", init_std=0.02)
    params = model.adapter_parameters("policy") + list(head.parameters())
    assert {p.dtype for p in params} == {torch.float32}
    assert {p.dtype for n, p in model.gpt.named_parameters() if ".lora." not in n} == {torch.bfloat16}
    opt, _ = _train(model, model.adapter_parameters("policy"), 2)
    assert {t.dtype for s in opt.state.values() for k, t in s.items() if k != "step"} == {torch.float32}
    # the exported adapter holds the masters (as PEFT saves float32 adapters of a bf16 model)
    model.save_adapter("policy", tmp_path / "a")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a" / "adapter_model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


def test_bad_lora_compute_dtype(tiny_models, mesh1):
    with pytest.raises(ValueError, match=r"lora_compute_dtype=torch.float16 on a torch.bfloat16 base"):
        mlora.from_pretrained(tiny_models / "llama", mesh1, dtype=torch.bfloat16, lora_compute_dtype=torch.float16)


def test_resume_from_bf16_checkpoint_is_exact(tiny_models, mesh1, tmp_path):
    """Train 3 steps, checkpoint, train 3 more; a fresh model that loads the checkpoint and trains 3
    steps ends bit-identical (adapters, value head, AdamW state), through the checkpoint writer."""
    from mlora.checkpoint.run_state import load_run_state, write_run_state
    from mlora.train.config import PPOConfig
    from mlora.train.engine import ActorCriticEngine

    cfg = PPOConfig(actor_lr=LR, critic_lr=LR, lr_schedule="constant", critic_lr_schedule="constant")

    def engine_on_new_model():
        model = mlora.from_pretrained(tiny_models / "llama", mesh1, dtype=torch.bfloat16)
        engine = ActorCriticEngine(model, cfg, policy_lora=mlora.LoraConfig(rank=4, seed=5),
                                   critic_lora=mlora.LoraConfig(rank=4, seed=6))
        with torch.no_grad():  # a non-zero head, so its update is not trivially the same
            model.heads["critic"].weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(1))
        return model, engine

    def steps(model, engine, n):
        ids, mask = _batch(model)
        loss_fn = _nll_loss(ids, mask, model.spec.vocab_size)

        def value_loss(hidden, mb):
            return model.heads["critic"](hidden).float().pow(2).mean(), {}

        for _ in range(n):
            with model.use_adapters("policy"):
                model.forward_backward([{"input_ids": ids, "attention_mask": mask}], loss_fn=loss_fn)
            engine.actor_opt.step()
            engine.actor_sched.step()
            with model.use_adapters("critic"):
                model.forward_backward([{"input_ids": ids, "attention_mask": mask}], loss_fn=value_loss,
                                       hidden_states=True)
            engine.critic_opt.step()
            engine.critic_sched.step()
            engine.actor_opt.zero_grad(set_to_none=True)
            engine.critic_opt.zero_grad(set_to_none=True)

    def state(model, engine):
        out = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        for role, opt in (("actor", engine.actor_opt), ("critic", engine.critic_opt)):
            for i, p in enumerate(opt.param_groups[0]["params"]):
                out.update({f"{role}{i}/{k}": t.clone() for k, t in opt.state[p].items()})
        return out

    model, engine = engine_on_new_model()
    steps(model, engine, 3)
    ckpt = tmp_path / "global_step_3"
    write_run_state(ckpt, model, engine, {"step": 3}, "")
    steps(model, engine, 3)
    want = state(model, engine)

    model2, engine2 = engine_on_new_model()
    load_run_state(ckpt, model2, engine2)
    steps(model2, engine2, 3)
    got = state(model2, engine2)
    assert want.keys() == got.keys()
    assert all(t.dtype == torch.float32 for t in got.values())
    mismatched = [k for k in want if not torch.equal(want[k], got[k])]
    assert not mismatched, mismatched[:5]
