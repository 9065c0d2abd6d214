"""SkyRL's ``trainer.algorithm`` keys (and the generator / async keys issue 48 names) on mlora: every one of SkyRL's
``AlgorithmConfig`` fields (read from the ``skyrl`` wheel) is a key here and in the table of docs/skyrl.md; those
mlora implements reach the trainer's objects; those it does not are refused by a ConfigError naming the key and why
(never Hydra's generic message, never dropped); the signal filters and DAPO's dynamic sampling on batches."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from skyrl_oracle import skyrl_module

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]


def _finalize(*overrides: str, world: int = 1):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.config.validate import finalize
    from mlora.train.__main__ import CONFIG_DIR

    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="ppo", overrides=["trainer.policy.model.path=/m", *overrides]))
    return cfg, finalize(cfg, world, explicit=[o.split("=", 1)[0] for o in overrides])


def _leaves(obj, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out += _leaves(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]
    return out


def test_every_skyrl_algorithm_key_is_a_key_and_in_the_docs_table():
    from mlora.config.schema import TrainConfig

    skyrl = _leaves(skyrl_module("train.config").AlgorithmConfig())
    mine = set(_leaves(TrainConfig().trainer.algorithm))
    assert [k for k in skyrl if k not in mine] == []
    page = (ROOT / "docs" / "skyrl.md").read_text()
    table = page[page.index("## SkyRL's algorithm keys"):]
    end = table.find("\n## ", 1)  # the next section, or the page's end
    table = table if end < 0 else table[:end]
    missing = [k for k in skyrl if f"`{k}`" not in table and f"`{k.split('.')[0]}.*`" not in table]
    assert missing == [], f"SkyRL algorithm keys missing from the table in docs/skyrl.md: {missing}"


def test_implemented_keys_reach_the_trainer():
    from mlora.train.from_config import ppo_config

    cfg, notes = _finalize("trainer.algorithm.advantage_estimator=grpo", "trainer.algorithm.policy_loss_type=sapo",
                           "trainer.algorithm.sapo.tau_pos=1.5", "trainer.algorithm.cispo.cispo_eps_clip_high=4.0",
                           "trainer.algorithm.dppo.dppo_type=binary_kl", "trainer.algorithm.clip_cov.clip_ratio=0.01",
                           "trainer.algorithm.kl_cov.ppo_kl_coef=2.0", "trainer.algorithm.loss_reduction=prompt_mean",
                           "trainer.algorithm.advantage_batch_normalize=true", "trainer.algorithm.temperature=0.7",
                           "trainer.algorithm.value_clip=null", "generator.n_samples_per_prompt=2")
    ppo = ppo_config(cfg, 4)
    p = ppo.loss_params
    assert (ppo.policy_loss_type, p.tau_pos, p.cispo_eps_clip_high, p.dppo_type, p.clip_cov_ratio, p.ppo_kl_coef) == (
        "sapo", 1.5, 4.0, "binary_kl", 0.01, 2.0)
    assert ppo.loss_agg_mode == "prompt-mean" and ppo.advantage_batch_normalize and ppo.value_clip is None
    assert ppo.temperature == 0.7 and any("trainer.algorithm.temperature=0.7 differs" in n for n in notes)
    for estimator in ("reinforce++", "maxrl"):
        cfg, _ = _finalize(f"trainer.algorithm.advantage_estimator={estimator}", "generator.n_samples_per_prompt=2")
        assert ppo_config(cfg, 1).advantage_estimator == estimator and not ppo_config(cfg, 1).uses_critic


@pytest.mark.parametrize("overrides,message", [
    (["trainer.algorithm.use_kl_in_reward=true"], "use_kl_in_reward=true and trainer.algorithm.use_kl_loss=true: the "
                                                  "KL penalty goes in the reward or in the loss"),
    (["trainer.algorithm.policy_loss_type=gpo"], "policy_loss_type='gpo' is not valid; valid: regular, dual_clip, gspo"),
    (["trainer.algorithm.dppo.dppo_type=binary_js"], "dppo.dppo_type='binary_js'; valid: binary_tv, binary_kl"),
    (["trainer.algorithm.sapo.tau_neg=0"], "sapo.tau_neg=0.0 must be > 0"),
    (["trainer.algorithm.policy_loss_type=kl_cov", "trainer.algorithm.off_policy_correction.tis_ratio_type=token"],
     "policy_loss_type='kl_cov' takes no off-policy correction"),
    (["trainer.algorithm.dynamic_sampling.type=drop"], "dynamic_sampling.type='drop' is not valid; valid: filter, "
                                                        "replace"),
    (["trainer.algorithm.dynamic_sampling.type=filter", "trainer.algorithm.dynamic_sampling.max_sample_batches=0"],
     "max_sample_batches=0 must be >= 1"),
    (["generator.step_wise_trajectories=true"], "generator.step_wise_trajectories=True: each turn of a trajectory"),
    (["generator.merge_stepwise_output=true"], "generator.merge_stepwise_output=True"),
    (["trainer.update_ref_every_epoch=true"], "trainer.update_ref_every_epoch=True: the reference is the shared base"),
    (["trainer.fully_async.sample_full_batch=true"], "trainer.fully_async.sample_full_batch=True"),
    (["generator.chat_template.name_or_path=chatml"], "name_or_path='chatml': not a SkyRL template; valid: "
                                                       "qwen3_with_thinking, qwen3_without_thinking"),
    (["generator.chat_template.source=file", "generator.chat_template.name_or_path=/nope.jinja"],
     "no such template file"),
    (["generator.chat_template.source=hub"], "chat_template.source='hub'; valid: name, file"),
    (["trainer.algorithm.gae_skip_observations=true", "trainer.algorithm.advantage_estimator=grpo"],
     "gae_skip_observations=true applies to advantage_estimator=gae"),
    (["trainer.algorithm.advantage_estimator=prompt_mean"], "advantage_estimator='prompt_mean' is not valid"),
])
def test_refusals_name_the_key(overrides, message):
    from mlora.config.validate import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        _finalize(*overrides)


def test_zero_variance_filter_and_dapo_shaping_on_a_batch():
    from mlora.config.schema import TrainConfig
    from mlora.train.batch import RolloutBatch, concat_batches
    from mlora.train.rl_stage import zero_variance_filter

    b, s = 6, 6
    ids = torch.ones(b, s, dtype=torch.long)
    attn = torch.ones(b, s, dtype=torch.long)
    resp = torch.zeros(b, s, dtype=torch.long)
    resp[:, 3:] = 1
    batch = RolloutBatch(ids, attn, resp, torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5 + 1e-7]))
    cfg = TrainConfig()
    cfg.generator.n_samples_per_prompt = 2
    assert zero_variance_filter(cfg, batch) == {} and batch.loss_mask is None
    cfg.trainer.algorithm.zero_variance_filter = True
    assert zero_variance_filter(cfg, batch) == {"reward/num_zero_variance_filtered": 2.0}
    assert batch.loss_mask.tolist() == [0, 0, 1, 1, 0, 0]
    # batches of different widths as one (dynamic sampling's filter)
    other = RolloutBatch(torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long),
                         torch.tensor([[0, 0, 1, 1]] * 2), torch.tensor([3.0, 4.0]))
    joined = concat_batches([batch, other], pad_id=0)
    assert joined.input_ids.shape == (8, 6) and joined.rewards.tolist()[-2:] == [3.0, 4.0]
    assert joined.loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 1, 1] and joined.attention_mask[6:, 4:].sum() == 0


def test_replacement_rows_put_informative_groups_in_place_of_flat_ones():
    from mlora.rl.sampling_filters import group_has_signal, replacement_rows

    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])  # groups of 2: signal, flat, signal, flat
    signal = group_has_signal(rewards, 2)
    assert signal.tolist() == [True, False, True, False]
    rows = replacement_rows(signal, 2, torch.Generator().manual_seed(0))
    groups = rows.view(4, 2)[:, 0] // 2
    assert groups[0] == 0 and groups[2] == 2 and set(groups[[1, 3]].tolist()) == {0, 2}  # distinct while enough
    assert torch.equal(rows.view(4, 2)[:, 1], rows.view(4, 2)[:, 0] + 1)  # whole groups move
    assert group_has_signal(rewards[rows], 2).all()
    one_good = replacement_rows(torch.tensor([False, True, False]), 1)
    assert one_good.tolist() == [1, 1, 1]


class _Engines:
    """Stands in for the engines in :meth:`RLStage._dynamic_sampling`: each further batch's rewards are the next
    of ``plans`` (one per row, groups of 2 adjacent rows); records the calls."""

    def __init__(self, plans):
        self.plans, self.jobs, self.woken = list(plans), [], 0

    def wake(self):
        self.woken += 1
        return {}

    def collect_jobs(self, jobs, pad_id):
        self.jobs.append(jobs[0])
        return [_collected(self.plans.pop(0), base=100 * len(self.jobs))]


def _collected(rewards, base=0):
    from mlora.train.batch import RolloutBatch
    from mlora.train.rollouts import Collected

    b = len(rewards)
    ids = torch.arange(base, base + b)[:, None].repeat(1, 4)  # row i's tokens say where it came from
    resp = torch.tensor([[0, 0, 1, 1]] * b)
    batch = RolloutBatch(ids, torch.ones(b, 4, dtype=torch.long), resp, torch.tensor(rewards, dtype=torch.float32))
    return Collected(batch, {"first": 1.0}, [("env", "stop")] * b, 0)


def _stage(kind, plans, max_batches=30):
    from types import SimpleNamespace

    from mlora.config.schema import TrainConfig
    from mlora.train.rl_stage import RLStage

    cfg = TrainConfig()
    cfg.generator.n_samples_per_prompt, cfg.trainer.train_batch_size = 2, 3
    cfg.trainer.algorithm.dynamic_sampling.type = kind
    cfg.trainer.algorithm.dynamic_sampling.max_sample_batches = max_batches
    stage = RLStage.__new__(RLStage)  # only what _dynamic_sampling reads
    stage.pad_id, stage.rollouts = 0, _Engines(plans)
    e = SimpleNamespace(cfg=cfg, train=[SimpleNamespace(token_ids=[i]) for i in range(10)], served="policy",
                        learned=None, step_of=lambda s: s)
    return stage, e


def test_dynamic_sampling_filter_generates_until_the_batch_is_full():
    first = _collected([1.0, 0.0, 1.0, 1.0, 0.0, 0.5])  # groups: signal, flat, signal
    stage, e = _stage("filter", [[0.0, 0.0, 1.0, 0.0, 2.0, 2.0]])  # one more group with a signal
    got = stage._dynamic_sampling(e, 5, first)
    assert got.batch.size == 6 and got.batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.5, 1.0, 0.0]
    assert got.batch.input_ids[:, 0].tolist() == [0, 1, 4, 5, 102, 103]  # rows of both batches, in order
    assert got.metrics["dynamic_sampling/batches"] == 2.0 and got.metrics["first"] == 1.0
    job = stage.rollouts.jobs[0]
    assert len(job.prompts) == 3 and stage.rollouts.woken == 1  # a batch of prompts drawn for the extra call
    again, e2 = _stage("filter", [[0.0, 0.0, 1.0, 0.0, 2.0, 2.0]])
    # the same step draws the same extra prompts and seed (reproducible), another step others
    again._dynamic_sampling(e2, 5, _collected([1.0, 0.0, 1.0, 1.0, 0.0, 0.5]))
    assert [p.token_ids for p in again.rollouts.jobs[0].prompts] == [p.token_ids for p in job.prompts]
    assert again.rollouts.jobs[0].sampling.seed == job.sampling.seed
    stuck, e3 = _stage("filter", [[1.0] * 6, [1.0] * 6], max_batches=3)
    with pytest.raises(RuntimeError, match="generated 3 batches .* kept 2 of the 3 prompt groups"):
        stuck._dynamic_sampling(e3, 1, _collected([1.0, 0.0, 1.0, 1.0, 0.0, 0.5]))


def test_dynamic_sampling_replace_needs_enough_signal():
    stage, e = _stage("replace", [[1.0, 0.0, 2.0, 2.0, 0.0, 0.0]])
    # one group of three has a signal, more than min_replace_ratio 0.3 x 3: the two flat ones take its rows
    got = stage._dynamic_sampling(e, 1, _collected([1.0, 0.0, 1.0, 1.0, 3.0, 3.0]))
    assert got.batch.rewards.tolist() == [1.0, 0.0] * 3 and got.metrics["dynamic_sampling/replaced_groups"] == 2.0
    assert stage.rollouts.jobs == []
    # no group with a signal: another batch, then its flat groups replaced
    stage, e = _stage("replace", [[1.0, 0.0, 2.0, 2.0, 0.0, 0.0]])
    got = stage._dynamic_sampling(e, 1, _collected([1.0] * 6))
    assert got.batch.rewards.tolist() == [1.0, 0.0] * 3 and got.metrics["dynamic_sampling/batches"] == 2.0
