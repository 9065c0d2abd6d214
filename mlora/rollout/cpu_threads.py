"""Threads per process of a CPU run: the trainer ranks and the local vLLM engines share the node's cores.

torchrun sets ``OMP_NUM_THREADS=1`` for every rank when it starts more than one, and a local engine
(a child of global rank 0) inherited it: on a many-core node every process ran on one thread. The RL
loop alternates: while the engines generate (and hot-swap an adapter) the trainer ranks wait for
them, and while the trainer updates the engines wait. So each phase may use every core this process
may run on (``os.sched_getaffinity``). The split, on CPU only (with CUDA nothing is chosen):

- each trainer rank: ``trainer.cpu_threads`` when set; else ``OMP_NUM_THREADS`` when it is provably
  the user's (torchrun sets it only to 1 and only when it starts several local ranks, so a value
  with one local rank, or a value other than 1, is the user's); else ``cores // local ranks``, at
  least 1;
- asynchronous training (``trainer.fully_async``): the engines generate while the trainer updates, so the
  phases overlap and the cores are split instead (:func:`overlap_split`): the local engines get the last
  ``cores · engines / (ranks + engines)`` cores (at least one each), the trainer ranks of that node the rest;
- each local engine: the cores divided among the local engines, with ``OMP_WAIT_POLICY=PASSIVE``
  (unless the user set a policy) when it gets more than one; an engine with TP > 1 binds an equal
  share to each worker (``VLLM_CPU_OMP_THREADS_BIND``, which wins when the user sets it). A provably
  user-set ``OMP_NUM_THREADS`` is left to the engines too.

Measured (``bench/threads.py``, 2-core Intel Xeon (Sapphire Rapids, AVX-512) build machine shared
with other jobs, run queue ~3-25; random Llama hidden 512 x 8 layers; PPO step on 8 x 96 tokens,
generation of 8 x 64 tokens; medians of 3 launches; trainer threads / engine threads):

- 1 rank, 1 / 1 (``OMP_NUM_THREADS=1``, as before): step 3.3 s, generation 1.57 s;
- 1 rank, 2 / 2 with the engine waiting passively: step 21.6 s (the trainer's threads wait
  actively), generation 1.56 s; 1 / 2: step 5.4 s (load), generation 1.66 s;
- 4 ranks, 1 / 1 (torchrun): step 6.5 s, generation 2.01 s; 1 / 2 passive: 6.1 s, 1.66 s;
- engine with 2 actively waiting threads (before ``PASSIVE``): generation 14 s (1 rank), 12.5 s
  (4 ranks); 4 ranks with 2 / 2 (oversubscribed): step 33.4 s, generation 21.2 s.

So where other jobs want the cores, threads that wait actively (libgomp's default: spin, then
sleep) are ruinous (a 2-thread trainer rank ~7x slower, a 2-thread engine ~8x), while an engine
waiting passively costs what one thread does there. The gain on idle cores could not be measured on
this machine (it was never idle); the split assumes a node that the run has to itself. The wait
policy is read when a process starts, so mlora sets it only for the engines it starts; trainer ranks
keep their launcher's: on shared machines export ``OMP_WAIT_POLICY=PASSIVE`` before torchrun, or set
``trainer.cpu_threads=1`` / ``OMP_NUM_THREADS=1`` (the start-up log says so when it applies).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence


def available_cores() -> list[int]:
    """The CPU ids this process may run on, sorted."""
    return sorted(os.sched_getaffinity(0))


def local_ranks(env: Mapping[str, str] = os.environ) -> int:
    """Trainer ranks on this node: torchrun's ``LOCAL_WORLD_SIZE`` (1 without torchrun)."""
    return int(env.get("LOCAL_WORLD_SIZE", "1"))


def user_omp_threads(env: Mapping[str, str], ranks: int) -> int | None:
    """``OMP_NUM_THREADS`` when it is provably the user's, else None (unset, or torchrun's 1).

    torchrun sets it to 1, and only when it was unset and starts more than one local rank: a value
    seen with one local rank, or a value other than 1, was set by the user."""
    value = env.get("OMP_NUM_THREADS")
    if value is None or (ranks > 1 and value.strip() == "1"):
        return None
    try:
        threads = int(value)
    except ValueError:
        raise ValueError(f"OMP_NUM_THREADS={value!r} must be a positive integer") from None
    if threads < 1:
        raise ValueError(f"OMP_NUM_THREADS={value!r} must be a positive integer")
    return threads


def trainer_threads(cores: int, ranks: int, explicit: int | None = None, user_omp: int | None = None) -> int:
    """Threads of each trainer rank: ``explicit`` (``trainer.cpu_threads``), else ``user_omp`` (see
    :func:`user_omp_threads`), else ``cores // ranks`` and at least 1 (the ranks of one node compute at
    the same time)."""
    if explicit is not None:
        if explicit < 1:
            raise ValueError(f"trainer.cpu_threads={explicit} must be >= 1 (or null: chosen for the machine)")
        return explicit
    if user_omp is not None:
        return user_omp
    if cores < 1 or ranks < 1:
        raise ValueError(f"cores={cores} and local ranks={ranks} must be >= 1")
    return max(1, cores // ranks)


def overlap_split(cores: int, ranks: int, engines: int) -> tuple[int, int]:
    """``(threads per trainer rank, cores for the engines)`` on a node where ``engines`` local engines generate
    while ``ranks`` trainer ranks update (asynchronous training): each process its own cores, in proportion
    to how many there are, at least one each."""
    if cores < 1 or ranks < 1 or engines < 1:
        raise ValueError(f"cores={cores}, local ranks={ranks} and engines={engines} must be >= 1")
    engine_cores = min(cores, max(engines, cores * engines // (ranks + engines)))
    return max(1, (cores - engine_cores) // ranks), engine_cores


def engine_core_sets(cores: Sequence[int], engines: int) -> list[list[int]]:
    """The cores of each of ``engines`` local engines (they generate at the same time): contiguous,
    equal slices of ``cores``; with fewer cores than engines, engine i gets core ``i mod len(cores)``."""
    if engines < 1:
        raise ValueError(f"generator.inference_engine.num_engines={engines} must be >= 1")
    cores = sorted(cores)
    if not cores:
        raise ValueError("no CPU cores to place engines on")
    if len(cores) < engines:
        return [[cores[i % len(cores)]] for i in range(engines)]
    per = len(cores) // engines
    return [cores[i * per:(i + 1) * per] for i in range(engines)]


def local_engine_cores(engines: int, env: Mapping[str, str] = os.environ, overlap: bool = False
                       ) -> list[list[int]] | None:
    """Each local engine's cores (:func:`engine_core_sets` of this process's cores; with ``overlap``, the
    engines generating while the trainer updates, of the last cores :func:`overlap_split` gives them), or
    None when a user-set ``OMP_NUM_THREADS`` (:func:`user_omp_threads`) decides the engines' threads."""
    ranks = local_ranks(env)
    if user_omp_threads(env, ranks) is not None:
        return None
    cores = available_cores()
    if overlap:
        cores = cores[len(cores) - overlap_split(len(cores), ranks, engines)[1]:]
    return engine_core_sets(cores, engines)


def engine_environment(threads: int, env: Mapping[str, str]) -> dict[str, str]:
    """Variables an engine process must start with to compute on ``threads`` threads: their count, and
    ``OMP_WAIT_POLICY=PASSIVE`` for more than one unless ``env`` (the user's) names a policy."""
    out = {"OMP_NUM_THREADS": str(threads)}
    if threads > 1 and "OMP_WAIT_POLICY" not in env:
        out["OMP_WAIT_POLICY"] = "PASSIVE"
    return out


def apply_trainer_threads(explicit: int | None, cuda: bool, overlapping_engines: int = 0) -> int | None:
    """Set this trainer rank's torch threads for the node; returns the count, or None when left alone
    (CUDA without ``trainer.cpu_threads``). ``overlapping_engines``: local engines on this node that generate
    while the trainer updates (asynchronous training): the trainer ranks leave them their cores
    (:func:`overlap_split`). ``OMP_NUM_THREADS`` stays as the launcher set it: it tells the engines'
    placement (:func:`local_engine_cores`) whether the user chose threads."""
    if cuda and explicit is None:
        return None
    import torch

    ranks, cores = local_ranks(), len(available_cores())
    user = user_omp_threads(os.environ, ranks)
    if overlapping_engines and explicit is None and user is None:
        threads = overlap_split(cores, ranks, overlapping_engines)[0]
    else:
        threads = trainer_threads(cores, ranks, explicit, user)
    torch.set_num_threads(threads)
    return threads
