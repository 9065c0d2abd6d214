"""Where every process of a GPU run computes: the trainer ranks and the local vLLM engines on the GPUs of
the job's nodes, as one explicit plan.

:func:`plan_placement` is pure: from the job's shape (nodes, GPUs per node, trainer ranks per node, as
torchrun and CUDA report them) and the engine keys it decides which GPU each trainer rank uses, which
GPUs each engine uses, on which node each engine runs and which trainer rank starts it (each node's
local rank 0 starts that node's engines: no node's engines depend on another node's process). The
runtime does what the plan says (an engine process gets ``CUDA_VISIBLE_DEVICES`` from it) and
start-up prints it (:meth:`Placement.table`). Impossible layouts are refused with the keys to change.

torchrun numbers ranks node by node (global rank = node x ranks per node + local rank) and a rank uses
GPU ``local rank`` of its node. Colocated (``trainer.placement.colocate_all=true``): the engines share
the trainer's GPUs, engine ``i`` on the ``i``-th group of ``tensor_parallel_size`` of them, in rank
order. Not colocated: the engines take the GPUs the trainer leaves free on its nodes. Ray engines
(``generator.run_engines_locally=false``) are not planned here: Ray places each in a placement group of
``tensor_parallel_size`` bundles on whatever node has them.
"""

from __future__ import annotations

from dataclasses import dataclass

_NUM_ENGINES = "generator.inference_engine.num_engines"
_ENGINE_TP = "generator.inference_engine.tensor_parallel_size"
_COLOCATE = "trainer.placement.colocate_all"


class PlacementError(ValueError):
    """A layout the job's GPUs cannot hold; the message names the keys."""


@dataclass(frozen=True)
class EngineSlot:
    """One engine: its node, its GPUs there (local device indices, its ``CUDA_VISIBLE_DEVICES``), and the
    global trainer rank that starts it."""

    index: int
    node: int
    gpus: tuple[int, ...]
    starter: int


@dataclass(frozen=True)
class Placement:
    nodes: int
    gpus_per_node: int
    ranks_per_node: int
    colocated: bool
    engines: tuple[EngineSlot, ...]

    def trainer_gpu(self, rank: int) -> tuple[int, int]:
        """``(node, local GPU)`` of global trainer rank ``rank``."""
        return rank // self.ranks_per_node, rank % self.ranks_per_node

    def started_by(self, rank: int) -> tuple[EngineSlot, ...]:
        """The engines global rank ``rank`` starts (none unless it is a node's local rank 0)."""
        return tuple(e for e in self.engines if e.starter == rank)

    @property
    def starters(self) -> tuple[int, ...]:
        return tuple(sorted({e.starter for e in self.engines}))

    def users(self, node: int, gpu: int) -> list[str]:
        """What computes on GPU ``gpu`` of node ``node`` (``rank 3``, ``engine 1``)."""
        out = [f"rank {node * self.ranks_per_node + gpu}"] if gpu < self.ranks_per_node else []
        return out + [f"engine {e.index}" for e in self.engines if e.node == node and gpu in e.gpus]

    def table(self) -> str:
        """One line per node and GPU: who uses it, and who starts each engine."""
        lines = [f"placement: {self.nodes} node(s) x {self.gpus_per_node} GPUs, {self.ranks_per_node} trainer "
                 f"rank(s) per node, {len(self.engines)} engine(s) "
                 + ("sharing the trainer's GPUs (colocated)" if self.colocated else "on GPUs of their own")]
        for node in range(self.nodes):
            for gpu in range(self.gpus_per_node):
                users = self.users(node, gpu)
                lines.append(f"  node {node} GPU {gpu}: {', '.join(users) if users else 'idle'}")
        for e in self.engines:
            lines.append(f"  engine {e.index}: node {e.node}, CUDA_VISIBLE_DEVICES={','.join(map(str, e.gpus))}, "
                         f"started by rank {e.starter}")
        return "\n".join(lines)


def plan_placement(nodes: int, gpus_per_node: int, ranks_per_node: int, num_engines: int, engine_tp: int,
                   colocate: bool) -> Placement:
    """The placement of ``ranks_per_node`` trainer ranks on each of ``nodes`` nodes with ``gpus_per_node``
    GPUs, and of ``num_engines`` local engines of ``engine_tp`` GPUs each; :class:`PlacementError` when the
    GPUs cannot hold it."""
    for name, value in (("nodes", nodes), ("GPUs per node", gpus_per_node), ("trainer ranks per node",
                                                                                ranks_per_node),
                        (_NUM_ENGINES, num_engines), (_ENGINE_TP, engine_tp)):
        if value < 1:
            raise PlacementError(f"{name}={value} must be >= 1")
    if ranks_per_node > gpus_per_node:
        raise PlacementError(f"torchrun --nproc_per_node={ranks_per_node} but each node has {gpus_per_node} GPUs: "
                             "one trainer rank per GPU")
    if engine_tp > gpus_per_node:
        raise PlacementError(f"{_ENGINE_TP}={engine_tp} exceeds the {gpus_per_node} GPUs of a node: an engine's "
                             "GPUs are on one node")
    if colocate:
        slots = [[(node, gpu) for gpu in range(ranks_per_node)] for node in range(nodes)]
        need, have = num_engines * engine_tp, nodes * ranks_per_node
        if need != have:
            raise PlacementError(f"{_COLOCATE}=true: the engines use exactly the trainer's {have} GPUs, but "
                                 f"{_NUM_ENGINES} x {_ENGINE_TP} = {num_engines} x {engine_tp} = {need}; valid: "
                                 f"{_NUM_ENGINES}={have // engine_tp if have % engine_tp == 0 else '?'} for "
                                 f"{_ENGINE_TP}={engine_tp}, or {_COLOCATE}=false")
        if ranks_per_node % engine_tp:
            raise PlacementError(f"{_ENGINE_TP}={engine_tp} does not divide the {ranks_per_node} trainer GPUs of a "
                                 f"node ({_COLOCATE}=true): an engine's GPUs are on one node")
    else:
        slots = [[(node, gpu) for gpu in range(ranks_per_node, gpus_per_node)] for node in range(nodes)]
    engines: list[EngineSlot] = []
    for node_slots in slots:
        for start in range(0, len(node_slots) - engine_tp + 1, engine_tp):
            if len(engines) == num_engines:
                break
            node = node_slots[start][0]
            engines.append(EngineSlot(len(engines), node, tuple(g for _, g in node_slots[start:start + engine_tp]),
                                      starter=node * ranks_per_node))
    if len(engines) < num_engines:
        free = [len(s) for s in slots]
        raise PlacementError(f"{_NUM_ENGINES}={num_engines} engines of {_ENGINE_TP}={engine_tp} GPUs do not fit "
                             f"beside the trainer: its nodes leave {free} GPUs free ({gpus_per_node} per node - "
                             f"{ranks_per_node} trainer ranks), which hold {len(engines)}. Share the trainer's GPUs "
                             f"({_COLOCATE}=true), start fewer engines, or run them as Ray actors on nodes of their "
                             "own (generator.run_engines_locally=false)")
    return Placement(nodes, gpus_per_node, ranks_per_node, colocate, tuple(engines))


def cuda_visible_devices(gpus: tuple[int, ...], env: dict | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` for an engine on the node's GPUs ``gpus`` (indices as this process sees
    them): translated through this process's own ``CUDA_VISIBLE_DEVICES`` when it has one (a job that
    was given GPUs 4-7 sees them as 0-3; the engine must be given 4-7)."""
    import os

    env = os.environ if env is None else env
    mine = env.get("CUDA_VISIBLE_DEVICES")
    if not mine:
        return ",".join(str(g) for g in gpus)
    ids = [d.strip() for d in mine.split(",") if d.strip()]
    if max(gpus) >= len(ids):
        raise PlacementError(f"engine GPUs {list(gpus)}: this process sees only CUDA_VISIBLE_DEVICES={mine}")
    return ",".join(ids[g] for g in gpus)
