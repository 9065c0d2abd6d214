"""Engines started by two ranks (0 and 2, as two nodes' local rank 0 are on a GPU job) give the same
rollouts, log-probs, rewards and evaluation, bit for bit, as the same two engines started by rank 0
(issue 22), with the adapter handed over as files (weight_sync=disk). 4 CPU ranks, TP2 x DP2.

    torchrun --nproc_per_node 4 tests/dist/spread_engines.py WORK
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import mlora
from mlora.config.schema import register_schema
from mlora.config.validate import finalize
from mlora.demos.rl_assets import build_demo_assets
from mlora.rollout.data import load_prompt_set
from mlora.train.__main__ import CONFIG_DIR
from mlora.train.from_config import sampling_config
from mlora.train.rollouts import Rollouts


def main() -> None:
    from transformers import AutoTokenizer

    work = Path(sys.argv[1])
    register_schema()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        dict_cfg = compose("cpu_demo", [f"demo.dir={work / 'assets'}", f"trainer.run_dir={work / 'run'}",
                                        "generator.num_inference_engines=2", "generator.weight_sync=disk",
                                        "generator.n_samples_per_prompt=2",
                                        "trainer.policy.megatron_config.tensor_model_parallel_size=2",
                                        "trainer.policy.megatron_config.pipeline_model_parallel_size=1"])
    cfg = OmegaConf.to_object(dict_cfg)
    finalize(cfg, 4)
    mesh = mlora.init_parallel(tp=2, pp=1)
    if mesh.rank == 0:
        build_demo_assets(cfg.demo.dir)
    dist.barrier()
    path = cfg.trainer.policy.model.path
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts, _ = load_prompt_set(list(cfg.data.train_data), tokenizer, 64, cfg.environment.env_class, "train")
    val, _ = load_prompt_set(list(cfg.data.val_data), tokenizer, 64, cfg.environment.env_class, "val")
    prompts, val = prompts[:6], val[:5]  # 6 and 5 prompts over 2 engines: uneven shares
    model = mlora.from_pretrained(path, mesh)
    model.add_adapter("policy", mlora.LoraConfig(rank=4, alpha=8, seed=3))
    with torch.no_grad():  # B starts at 0: a non-zero adapter, the same on every rank
        for p in model.adapter_parameters("policy"):
            p.add_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape).remainder(7).sub(3) * 2e-2)
    sampling = sampling_config(cfg.generator.sampling_params, 2, seed=11)
    results = {}
    for name, starts in (("rank 0", {0: [0, 1]}), ("ranks 0 and 2", {0: [0], 2: [1]})):
        rollouts = Rollouts(cfg, mesh, work / name.replace(" ", "_"), "policy", starts=starts.get(mesh.rank, []))
        try:
            assert rollouts.starters == sorted(starts), (rollouts.starters, starts)
            rollouts.sync(model, 0)
            batch, _ = rollouts.collect(prompts, sampling, tokenizer.pad_token_id or 0)
            evaluation = rollouts.evaluate(val, 1, work / name.replace(" ", "_"))
        finally:
            rollouts.close()
        results[name] = (batch, {k: v for k, v in evaluation.items() if not k.startswith("timing/")})
    (a, eval_a), (b, eval_b) = results["rank 0"], results["ranks 0 and 2"]
    assert a.input_ids.shape[0] == 12
    for field in ("input_ids", "attention_mask", "response_mask", "rewards", "rollout_logprobs"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert eval_a == eval_b and (bool(eval_a) == (mesh.rank == 0)), (eval_a, eval_b)
    if mesh.rank == 0:
        print(f"ok: 12 rollouts, rewards {a.rewards.tolist()}, eval {eval_a}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
