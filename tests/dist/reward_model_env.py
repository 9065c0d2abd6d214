"""torchrun worker: the learned reward (env_class=reward_model) at TP2xPP2.

Loads a reward adapter through mlora.train.learned_reward onto the tiny base, scores a rollout batch
with ActorCriticEngine.reward_scores, saves the adapter again (collective: head on the last stage).
Writes ``scores.pt`` (rank 0 holds every rank's identical copy) and the re-saved adapter.

argv: model_dir adapter_dir batch.pt out_dir
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    import mlora
    from mlora.config.schema import TrainConfig
    from mlora.export.reward_adapter import save_reward_adapter
    from mlora.train.batch import RolloutBatch
    from mlora.train.config import PPOConfig
    from mlora.train.engine import ActorCriticEngine
    from mlora.train.learned_reward import REWARD, LearnedReward

    model_dir, adapter_dir, batch_file, out = map(Path, sys.argv[1:5])
    mesh = mlora.init_parallel(tp=2, pp=2)
    model = mlora.from_pretrained(model_dir, mesh)
    engine = ActorCriticEngine(model, PPOConfig(advantage_estimator="grpo", mini_batch_size=4,
                                                micro_forward_batch_size=2, micro_train_batch_size=2))
    cfg = TrainConfig()
    cfg.environment.env_class = "reward_model"
    cfg.reward_model.adapter_path = str(adapter_dir)
    LearnedReward(cfg, model, engine)
    ids, attn, resp = torch.load(batch_file)
    batch = RolloutBatch(ids, attn, resp, torch.zeros(ids.shape[0]))
    scores = engine.reward_scores(batch, (REWARD,), REWARD)
    gathered = [torch.empty_like(scores) for _ in range(mesh.world_size)]
    dist.all_gather(gathered, scores)
    save_reward_adapter(model, REWARD, REWARD, out / "resaved")
    if mesh.rank == 0:
        torch.save(torch.stack(gathered), out / "scores.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
