"""SkyRL's fully-async loop replayed on given durations, with SkyRL's own ``_AsyncStalenessManager`` (compiled from
the installed ``skyrl/train/fully_async_trainer.py``, unchanged): the reference of asynchronous training's
staleness. SkyRL's simulator (``fully_async_trainer_sim.FullyAsyncTrainerSim``) runs its whole trainer, whose module
needs torchdata, datasets and Ray actors; this replays the parts of ``FullyAsyncRayPPOTrainer.train`` and
``_run_generate_for_a_group_loop`` that decide staleness, as SkyRL's simulator does with a sleep for training:
``W`` workers each pull the next group in order, wait for a submission slot, generate (here: sleep the group's
duration) and put it in the buffer; each step takes the first ``B`` to finish, trains (sleeps), pauses, syncs,
resumes and notifies the manager."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from skyrl_oracle import owner_function

TRAINER = "train/fully_async_trainer.py"


def staleness_manager(workers: int, batch: int, max_staleness: int):
    """SkyRL's ``_AsyncStalenessManager(max_concurrent_generation_groups, mini_batch_size, max_staleness_steps)``."""
    stat = owner_function(TRAINER, "_RolloutStat", {"dataclass": dataclass})
    manager = owner_function(TRAINER, "_AsyncStalenessManager", {"asyncio": asyncio, "_RolloutStat": stat})
    return manager(workers, batch, max_staleness)


def skyrl_staleness(durations: list[float], train_seconds: list[float], batch: int, max_staleness: int,
                    workers: int) -> list[list[int]]:
    """Per step, the staleness of each group SkyRL trains (``global_step - global_step_when_scheduled``), group
    ``g`` generating for ``durations[g]`` seconds and step ``j`` training for ``train_seconds[j - 1]``."""

    async def run() -> list[list[int]]:
        manager = staleness_manager(workers, batch, max_staleness)
        buffer: asyncio.Queue = asyncio.Queue(maxsize=batch * (max_staleness + 1))
        order = iter(range(len(durations)))
        state = {"global_step": 1}

        async def worker() -> None:
            while (g := next(order, None)) is not None:
                await manager.acquire_submission_slot()
                at_start = state["global_step"]
                await asyncio.sleep(durations[g])
                buffer.put_nowait(at_start)
                await manager.on_rollout_accepted()

        tasks = [asyncio.create_task(worker()) for _ in range(workers)]
        steps = []
        for seconds in train_seconds:
            scheduled = [await buffer.get() for _ in range(batch)]
            steps.append([state["global_step"] - s for s in scheduled])
            await asyncio.sleep(seconds)
            state["global_step"] += 1
            await manager.notify_capacity_change(state["global_step"])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return steps

    return asyncio.run(run())
