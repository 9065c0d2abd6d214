"""The preference / SFT losses against their formulas, and the clear errors of the stages' inputs:
pair data without chosen/rejected, a chosen identical to its rejected, responses of length zero,
beta <= 0, keys of another stage, batches the mesh cannot split."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mlora.rl import bradley_terry_loss, dpo_loss, sequence_logps, sft_nll

pytestmark = pytest.mark.quick

G = torch.Generator().manual_seed(3)


def _logps(n=6):
    return [-(torch.rand(n, generator=G, dtype=torch.float64) * 20) for _ in range(4)]


def test_dpo_sigmoid_matches_formula():
    pc, pr, rc, rr = _logps()
    beta = 0.3
    losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta)
    want = [-math.log(1 / (1 + math.exp(-beta * ((a - c) - (b - d))))) for a, b, c, d in
            zip(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist())]
    assert torch.allclose(losses, torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(chosen, beta * (pc - rc)) and torch.allclose(rejected, beta * (pr - rr))


def test_dpo_label_smoothing_is_conservative_dpo():
    pc, pr, rc, rr = _logps()
    beta, eps = 0.2, 0.1
    losses, _, _ = dpo_loss(pc, pr, rc, rr, beta, label_smoothing=eps)
    z = beta * ((pc - rc) - (pr - rr))
    assert torch.allclose(losses, -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z), atol=1e-12)
    # label smoothing pulls the loss's minimum away from infinitely large margins
    assert float(dpo_loss(torch.tensor([50.0]), torch.tensor([0.0]), torch.zeros(1), torch.zeros(1), 1.0, 0.1)[0]) > 1


def test_ipo_matches_formula_with_and_without_lengths():
    pc, pr, rc, rr = _logps()
    beta = 0.5
    lc, lr = torch.tensor([3, 5, 1, 2, 7, 4]), torch.tensor([2, 2, 6, 1, 3, 5])
    losses, chosen, _ = dpo_loss(pc, pr, rc, rr, beta, loss_type="ipo", chosen_lengths=lc, rejected_lengths=lr)
    want = ((pc - rc) / lc - (pr - rr) / lr - 1 / (2 * beta)) ** 2
    assert torch.allclose(losses, want, atol=1e-12)
    assert torch.allclose(chosen, beta * (pc - rc))  # rewards are the summed log-ratios, as TRL's
    summed, _, _ = dpo_loss(pc, pr, rc, rr, beta, loss_type="ipo")
    assert torch.allclose(summed, ((pc - rc) - (pr - rr) - 1 / (2 * beta)) ** 2, atol=1e-12)


def test_bradley_terry_with_and_without_margin():
    c, r = torch.randn(5, generator=G), torch.randn(5, generator=G)
    assert torch.allclose(bradley_terry_loss(c, r), -F.logsigmoid(c - r))
    m = torch.rand(5, generator=G)
    assert torch.allclose(bradley_terry_loss(c, r, m), -F.logsigmoid(c - r - m))
    assert torch.allclose(bradley_terry_loss(c, r, 0.5), -F.logsigmoid(c - r - 0.5))


def test_sft_nll_is_the_masked_cross_entropy():
    logits = torch.randn(3, 7, 11, generator=G)
    target = torch.randint(0, 11, (3, 7), generator=G)
    mask = torch.zeros(3, 7)
    mask[0, 2:] = 1
    mask[1, 5:] = 1
    mask[2, 1:4] = 1
    logprobs = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]
    labels = target.masked_fill(mask == 0, -100)
    want = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    assert torch.allclose(sft_nll(logprobs, mask), want, atol=1e-6)
    assert torch.allclose(sft_nll(logprobs, mask, normalizer=2 * mask.sum()), want / 2, atol=1e-6)
    assert torch.allclose(sequence_logps(logprobs, mask), (logprobs * mask).sum(-1))


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_beta_must_be_positive(beta):
    one = torch.zeros(1)
    with pytest.raises(ValueError, match=rf"beta={beta} must be > 0"):
        dpo_loss(one, one, one, one, beta)
    from mlora.train.preference_engine import PreferenceConfig

    with pytest.raises(ValueError, match="must be > 0"):
        PreferenceConfig(stage="dpo", beta=beta)


def test_bad_dpo_options():
    one = torch.zeros(1)
    with pytest.raises(ValueError, match="unknown DPO loss_type 'hinge'; valid: sigmoid, ipo"):
        dpo_loss(one, one, one, one, 0.1, loss_type="hinge")
    with pytest.raises(ValueError, match=r"label_smoothing=0.5 must be in \[0, 0.5\)"):
        dpo_loss(one, one, one, one, 0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="applies to loss_type='sigmoid' only"):
        dpo_loss(one, one, one, one, 0.1, label_smoothing=0.1, loss_type="ipo")


# ------------------------------------------------------------------ data


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_models / "llama"))


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_pair_data_without_chosen_or_rejected(tokenizer, tmp_path):
    from mlora.train.preference_data import load_examples

    path = _parquet(tmp_path / "p.parquet", [{"prompt": "Ann has", "response": " 3 pens"}])
    with pytest.raises(ValueError, match=r"lacks columns \['chosen', 'rejected'\]; preference pairs need columns "
                                         r"\['prompt', 'chosen', 'rejected'\]"):
        load_examples([path], tokenizer, True, 64, "data.train_data")
    path = _parquet(tmp_path / "s.parquet", [{"prompt": "Ann has", "chosen": " 3 pens", "rejected": " 4"}])
    with pytest.raises(ValueError, match=r"lacks columns \['response'\]; SFT examples need"):
        load_examples([path], tokenizer, False, 64, "data.train_data")


def test_chosen_identical_to_rejected(tokenizer, tmp_path):
    from mlora.train.preference_data import load_examples

    rows = [{"prompt": "Ann has", "chosen": " 3 pens", "rejected": " 4"},
            {"prompt": "Bob has", "chosen": " 5 eggs", "rejected": " 5 eggs"}]
    with pytest.raises(ValueError, match=r"row 1: chosen is identical to rejected \(' 5 eggs'\)"):
        load_examples([_parquet(tmp_path / "p.parquet", rows)], tokenizer, True, 64, "data.train_data")


def test_response_of_length_zero(tokenizer, tmp_path):
    from mlora.train.preference_data import SequenceBatch, load_examples

    rows = [{"prompt": "Ann has", "chosen": "", "rejected": " 4"}]
    with pytest.raises(ValueError, match="row 0: a response of length zero"):
        load_examples([_parquet(tmp_path / "p.parquet", rows)], tokenizer, True, 64, "data.train_data")
    ids = torch.ones(2, 5, dtype=torch.long)
    resp = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"responses of length zero in rows \[1\]"):
        SequenceBatch(ids, torch.ones_like(ids), resp, pairs=True)


def test_chat_messages_use_the_chat_template(tokenizer):
    from mlora.train.preference_data import tokenize_example

    prompt = [{"role": "user", "content": "Ann has"}]
    with pytest.raises(ValueError, match="chat-format messages need a tokenizer with a chat template"):
        tokenize_example(tokenizer, prompt, ([{"role": "assistant", "content": "3"}],), "row 0")
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                               "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    try:
        ex = tokenize_example(tokenizer, prompt, ([{"role": "assistant", "content": "3 pens"}],), "row 0")
        full = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": "3 pens"}], tokenize=False)
    finally:
        tokenizer.chat_template = None
    assert tokenizer.decode(ex.prompt + ex.responses[0]) == full
    assert "3 pens" in tokenizer.decode(ex.responses[0]) and "user" not in tokenizer.decode(ex.responses[0])


# ------------------------------------------------------------------ configuration and engine


def _cfg(name: str, *overrides: str):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.train.__main__ import CONFIG_DIR

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name=name, overrides=["trainer.policy.model.path=/m", *overrides]))


@pytest.mark.parametrize("name,overrides,message", [
    ("dpo", ["data.train_data=[a.parquet]", "preference.beta=0"], "preference.beta=0.0 must be > 0"),
    ("dpo", ["data.train_data=[a.parquet]", "preference.loss_type=kto"], "preference.loss_type='kto' is not valid"),
    ("dpo", [], "preference.stage=dpo needs data.train_data: parquet or jsonl files with columns prompt, chosen"),
    ("dpo", ["data.train_data=[a.parquet]", "preference.margin=1.0"], "preference.margin=1.0 applies to "
                                                                      "preference.stage=rm only"),
    ("rm", ["data.train_data=[a.parquet]", "preference.beta=0.5"], "preference.beta=0.5 applies to "
                                                                   "preference.stage=dpo only"),
    ("sft", ["data.train_data=[a.parquet]", "trainer.train_batch_size=6",
             "trainer.micro_train_batch_size_per_gpu=4"], "train_batch_size=6 is not divisible by"),
    ("ppo", ["preference.beta=0.5"], "preference.beta set, but preference.stage is null"),
    ("dpo", ["data.train_data=[a.parquet]", "generator.n_samples_per_prompt=4"],
     "generator.n_samples_per_prompt set, but preference.stage=dpo has no rollouts"),
    # trainer keys of the RL loop that these stages never read (once accepted and ignored)
    *[(stage, ["data.train_data=[a.parquet]", f"trainer.{key}={value}"], f"trainer.{key} set, but preference.stage="
       f"{stage} has no rollouts") for stage, key, value in (
        ("sft", "update_epochs_per_batch", 2), ("rm", "micro_forward_batch_size_per_gpu", 2),
        ("dpo", "max_prompt_length", 64), ("sft", "critic_mini_batch_size", 2), ("dpo", "eval_batch_size", 8),
        ("rm", "dump_eval_results", "false"))],
])
def test_config_errors(name, overrides, message):
    from mlora.config.validate import ConfigError, finalize

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        finalize(_cfg(name, *overrides), 1)


def test_config_maps_to_the_engine():
    from mlora.config.validate import finalize
    from mlora.train.preference_stage import preference_config

    cfg = _cfg("dpo", "data.train_data=[a.parquet]", "preference.beta=0.25", "preference.loss_type=ipo")
    finalize(cfg, 4)
    pc = preference_config(cfg, 10)
    assert (pc.stage, pc.beta, pc.loss_type, pc.micro_batch_size, pc.total_steps) == ("dpo", 0.25, "ipo", 4, 10)
    assert cfg.trainer.policy_mini_batch_size == cfg.trainer.train_batch_size


def test_engine_refuses_batches_it_cannot_split(model):
    from mlora.train.preference_data import SequenceBatch
    from mlora.train.preference_engine import PreferenceConfig, PreferenceEngine

    engine = PreferenceEngine(model, PreferenceConfig(stage="dpo", micro_batch_size=2))
    ids = torch.randint(3, 100, (6, 8), generator=G)
    resp = torch.zeros_like(ids)
    resp[:, 4:] = 1
    with pytest.raises(ValueError, match="a batch of 3 examples is not divisible by micro_batch_size x DP = 2 x 1"):
        engine.step(SequenceBatch(ids, torch.ones_like(ids), resp, pairs=True))
    with pytest.raises(ValueError, match="stage 'dpo' trains on pairs, got a batch of single responses"):
        engine.step(SequenceBatch(ids, torch.ones_like(ids), resp))
