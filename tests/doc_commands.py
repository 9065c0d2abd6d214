"""The commands the docs show, each written once: README.md's two commands and docs/getting-started.md's.

Every command line of a fenced ``bash`` block in those pages is one of :data:`COMMANDS`, character for character
(``tests/test_docs_commands.py`` checks it), and each is run from here by the test named in :data:`RUNNERS`, which
imports it (or, for ``.ci/run``, holds it verbatim). Commands that need GPUs, a model hub or a Slurm cluster with GPUs
cannot run on the CPU build machines: their Hydra overrides are composed and validated at the command's world size
(``test_docs_commands.py::test_gpu_commands_compose``), which is what a CPU machine can check of them.

A test adds only what a test must (a temporary run directory, fewer steps, no network); the configuration, launcher
and process count are the command's.
"""

from __future__ import annotations

import shlex

SETUP = "bash scripts/setup.sh"
# README's first command: SmolLM2-135M-Instruct learns addition with GRPO on CPU, then is served by vLLM
FIRST = f"{SETUP} && bash examples/arithmetic/run.sh"
# README's second command: the whole suite on two pytest-xdist workers (what .ci/run runs)
SECOND = f"{SETUP} && .venv/bin/python -m pytest -q -n 2 tests"
# PPO with actor and critic LoRA on one frozen base at TP2xPP2, a tiny random model, 4 CPU ranks
CPU_DEMO = f"{SETUP} && .venv/bin/torchrun --nproc_per_node 4 -m mlora.train --config-name cpu_demo"
# GSM8K as prompt parquet files (downloads openai/gsm8k; the test reads the bundled sample with --from-file)
GSM8K_DATA = "python examples/gsm8k/gsm8k_dataset.py --output_dir data/gsm8k"
_QWEN = ("trainer.policy.model.path=Qwen/Qwen2.5-1.5B-Instruct \\\n"
         '  data.train_data="[data/gsm8k/train.parquet]" data.val_data="[data/gsm8k/validation.parquet]" \\\n'
         "  trainer.policy.megatron_config.tensor_model_parallel_size=2")
# one GPU node: 8 ranks, TP2 x DP4, two engines as Ray actors
GPU_NODE = (f"torchrun --nproc_per_node 8 -m mlora.train {_QWEN} trainer.policy.optimizer_config.lr=3e-6 \\\n"
            "  generator.inference_engine.num_engines=2 generator.inference_engine.run_engines_locally=false")
# Slurm (slurm/train.sbatch): one node of 8 GPUs, two nodes of 8, CPU nodes, and trainer nodes + a Ray engine node
SLURM_GPU_NODE = f"sbatch --nodes 1 --gpus-per-node 8 slurm/train.sbatch {_QWEN}"
SLURM_GPU_NODES = f"sbatch --nodes 2 --gpus-per-node 8 slurm/train.sbatch {_QWEN}"
SLURM_CPU_DEMO = "MLORA_NPROC_PER_NODE=2 sbatch --nodes 2 slurm/train.sbatch --config-name cpu_demo"
SLURM_ENGINE_NODE = (f"MLORA_ENGINE_NODES=1 sbatch --nodes 3 --gpus-per-node 8 slurm/train.sbatch {_QWEN} \\\n"
                     "  generator.inference_engine.num_engines=8 generator.weight_sync=memory")

COMMANDS = {name: value for name, value in globals().items()
            if name.isupper() and isinstance(value, str) and not name.startswith("_") and name != "SETUP"}

COMPOSED = "tests/test_docs_commands.py::test_gpu_commands_compose"
RUNNERS = {
    "FIRST": "tests/test_docs_commands.py::test_first_command (opt-in: MLORA_FIRST_COMMAND=1, about 15 minutes)",
    "SECOND": ".ci/run",
    "CPU_DEMO": "tests/test_rl_loop.py",
    "GSM8K_DATA": "tests/test_rollout_data.py",
    "GPU_NODE": COMPOSED,
    "SLURM_GPU_NODE": COMPOSED,
    "SLURM_GPU_NODES": COMPOSED,
    "SLURM_CPU_DEMO": "tests/test_slurm.py",
    "SLURM_ENGINE_NODE": COMPOSED,
}


def split(command: str) -> tuple[dict[str, str], list[str]]:
    """``VAR=v ... prog args`` as (environment, argv); backslash-newlines join the lines, as bash does."""
    argv = shlex.split(command.replace("\\\n", " "))
    env = {}
    while argv and "=" in argv[0] and argv[0].split("=", 1)[0].isidentifier():
        key, value = argv.pop(0).split("=", 1)
        env[key] = value
    return env, argv


def torchrun_parts(command: str) -> tuple[int, str, list[str]]:
    """``[SETUP &&] torchrun --nproc_per_node N -m MODULE ARGS`` as (N, MODULE, ARGS)."""
    _, argv = split(command.split(" && ")[-1])
    assert argv[0].endswith("torchrun") and argv[1] == "--nproc_per_node" and argv[3] == "-m", argv
    return int(argv[2]), argv[4], argv[5:]


def sbatch_parts(command: str) -> tuple[dict[str, str], int, int, list[str]]:
    """An ``sbatch ... slurm/train.sbatch ARGS`` command as (environment, nodes, GPUs per node, mlora-train ARGS)."""
    env, argv = split(command)
    script = argv.index("slurm/train.sbatch")
    options = argv[1:script]
    nodes = int(options[options.index("--nodes") + 1])
    gpus = int(options[options.index("--gpus-per-node") + 1]) if "--gpus-per-node" in options else 0
    return env, nodes, gpus, argv[script + 1:]
