"""The placement plan over simulated topologies (issue 22): every GPU used by the processes it should be,
no engine on a GPU it should not touch, one starter per node, impossible layouts refused naming the keys."""

from __future__ import annotations

import pytest

from mlora.rollout.placement import PlacementError, cuda_visible_devices, plan_placement


def _gpu_users(plan) -> dict[tuple[int, int], list[str]]:
    return {(n, g): plan.users(n, g) for n in range(plan.nodes) for g in range(plan.gpus_per_node)}


def _check_invariants(plan) -> None:
    seen: dict[tuple[int, int], int] = {}
    for e in plan.engines:
        assert len(set(e.gpus)) == len(e.gpus)
        for g in e.gpus:
            assert 0 <= g < plan.gpus_per_node
            assert (e.node, g) not in seen, f"engines {seen[(e.node, g)]} and {e.index} share GPU {g}"
            seen[(e.node, g)] = e.index
            # colocated engines only on trainer GPUs; the others never on one
            assert (g < plan.ranks_per_node) == plan.colocated, (e, plan.colocated)
        assert e.starter == e.node * plan.ranks_per_node  # the node's local rank 0 starts it
    for rank in range(plan.nodes * plan.ranks_per_node):
        node, gpu = plan.trainer_gpu(rank)
        assert gpu < plan.ranks_per_node and f"rank {rank}" in plan.users(node, gpu)
    assert [e.index for e in plan.engines] == list(range(len(plan.engines)))


@pytest.mark.parametrize("engines,tp", [(8, 1), (4, 2), (1, 8)])
def test_one_node_colocated(engines, tp):
    plan = plan_placement(1, 8, 8, engines, tp, colocate=True)
    _check_invariants(plan)
    users = _gpu_users(plan)
    assert all(len(u) == 2 and u[0] == f"rank {g}" and u[1] == f"engine {g // tp}" for (_, g), u in users.items())
    assert plan.starters == (0,) and len(plan.started_by(0)) == engines and plan.started_by(1) == ()
    assert [e.gpus for e in plan.engines] == [tuple(range(i * tp, (i + 1) * tp)) for i in range(engines)]


def test_two_nodes_engines_on_free_gpus():
    """2 nodes x 8 GPUs, 4 trainer ranks per node, 2 engines of TP2 on each node's GPUs 4-7."""
    plan = plan_placement(2, 8, 4, 4, 2, colocate=False)
    _check_invariants(plan)
    assert plan.starters == (0, 4)  # one starter per node: each node's local rank 0
    assert [(e.node, e.gpus, e.starter) for e in plan.engines] == [
        (0, (4, 5), 0), (0, (6, 7), 0), (1, (4, 5), 4), (1, (6, 7), 4)]
    users = _gpu_users(plan)
    assert all(u for u in users.values())  # every GPU used
    assert users[(1, 0)] == ["rank 4"] and users[(1, 7)] == ["engine 3"]


def test_two_nodes_colocated_starters_per_node():
    plan = plan_placement(2, 8, 8, 16, 1, colocate=True)
    _check_invariants(plan)
    assert plan.starters == (0, 8) and len(plan.started_by(8)) == 8
    assert plan.engines[9].node == 1 and plan.engines[9].gpus == (1,)


def test_skyrl_four_gpu_script():
    """SkyRL's LoRA scripts: NUM_GPUS=4, num_inference_engines=$NUM_GPUS, TP1, colocate_all=true."""
    plan = plan_placement(1, 4, 4, 4, 1, colocate=True)
    _check_invariants(plan)
    assert [e.gpus for e in plan.engines] == [(0,), (1,), (2,), (3,)]
    table = plan.table()
    assert "node 0 GPU 3: rank 3, engine 3" in table and "engine 2: node 0, CUDA_VISIBLE_DEVICES=2" in table


@pytest.mark.parametrize("args,match", [
    ((1, 8, 8, 4, 1, True), r"colocate_all=true: the engines use exactly the trainer's 8 GPUs, but "
                            r"generator.inference_engine.num_engines x generator.inference_engine.tensor_parallel_size"
                            r" = 4 x 1 = 4; valid: generator.inference_engine.num_engines=8"),
    ((2, 8, 6, 3, 4, True), r"tensor_parallel_size=4 does not divide the 6 trainer GPUs of a node"),
    ((1, 8, 8, 1, 1, False), r"num_engines=1 engines of .*=1 GPUs do not fit beside the trainer: its nodes leave "
                             r"\[0\] GPUs free"),
    ((2, 8, 6, 2, 4, False), r"leave \[2, 2\] GPUs free"),
    ((1, 4, 8, 8, 1, True), r"nproc_per_node=8 but each node has 4 GPUs"),
    ((1, 8, 4, 1, 16, False), r"tensor_parallel_size=16 exceeds the 8 GPUs of a node"),
    ((1, 8, 4, 0, 1, False), r"num_engines=0 must be >= 1"),
])
def test_impossible_layouts_are_refused(args, match):
    with pytest.raises(PlacementError, match=match):
        plan_placement(*args)


def test_config_check_on_gpus_is_a_config_error():
    from mlora.config.schema import TrainConfig
    from mlora.config.validate import ConfigError, finalize

    cfg = TrainConfig()
    cfg.generator.num_inference_engines = 2
    with pytest.raises(ConfigError, match="the engines use exactly the trainer's 8 GPUs"):
        finalize(cfg, 8, cuda=True, gpus_per_node=8, ranks_per_node=8)
    cfg = TrainConfig()
    cfg.generator.num_inference_engines = 8
    finalize(cfg, 8, cuda=True, gpus_per_node=8, ranks_per_node=8)
    cfg = TrainConfig()  # CPU: no GPUs to place
    finalize(cfg, 8, cuda=False)


def test_visible_devices_follow_the_jobs_own():
    assert cuda_visible_devices((2, 3), {}) == "2,3"
    assert cuda_visible_devices((0, 1), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == "4,5"
    assert cuda_visible_devices((3,), {"CUDA_VISIBLE_DEVICES": "GPU-a, GPU-b, GPU-c, GPU-d"}) == "GPU-d"
    with pytest.raises(PlacementError, match="sees only CUDA_VISIBLE_DEVICES=4,5"):
        cuda_visible_devices((2,), {"CUDA_VISIBLE_DEVICES": "4,5"})


@pytest.mark.slow
def test_engines_started_by_two_ranks_match_one(tmp_path):
    """Two engines started by ranks 0 and 2 (one per node on a GPU job) give the rollouts, rewards and
    evaluation that the same engines started by rank 0 give, bit for bit (tests/dist/spread_engines.py)."""
    from conftest import torchrun

    out = torchrun(4, "spread_engines.py", tmp_path)
    assert "ok: 12 rollouts" in out.stdout
