"""The commands the docs show are the ones the tests run (one source: tests/doc_commands.py).

Every command of a fenced ``bash`` block in README.md and docs/getting-started.md is one of
:data:`doc_commands.COMMANDS`, character for character, and every one of those is shown; the test that runs each
(:data:`doc_commands.RUNNERS`) imports it (``.ci/run``, a shell script, holds it verbatim). Commands that need GPUs
or a model hub are composed and validated by Hydra and mlora's checks at their world size. The README's first command
(13 minutes on 2 cores) runs here only when ``MLORA_FIRST_COMMAND=1``."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import doc_commands as dc
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/getting-started.md")
FENCE = re.compile(r"^```bash\n(.*?)^```", re.S | re.M)


def shown_commands(text: str) -> list[str]:
    """The commands of a page's ``bash`` blocks: comment and blank lines dropped, a line ending in a backslash
    kept with the next (as ``bash`` joins them)."""
    out = []
    for block in FENCE.findall(text):
        lines = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        command = ""
        for line in lines:
            command += line
            if line.endswith("\\"):
                command += "\n"
            else:
                out.append(command)
                command = ""
        assert not command, f"a bash block ends in a continuation line: {command!r}"
    return out


@pytest.mark.quick
def test_every_shown_command_is_the_tested_one():
    known = set(dc.COMMANDS.values())
    shown = {page: shown_commands((ROOT / page).read_text()) for page in PAGES}
    for page, commands in shown.items():
        assert commands, f"{page} shows no bash block"
        strays = [c for c in commands if c not in known]
        assert strays == [], f"{page} shows commands that are not in tests/doc_commands.py: {strays}"
    everywhere = {c for commands in shown.values() for c in commands}
    unshown = [name for name, c in dc.COMMANDS.items() if c not in everywhere]
    assert unshown == [], f"tests/doc_commands.py holds commands no page shows: {unshown}"
    readme = shown["README.md"]
    assert readme[:2] == [dc.FIRST, dc.SECOND], "the README's two commands come first, in that order"


@pytest.mark.quick
def test_every_command_has_a_runner_that_uses_it():
    assert sorted(dc.RUNNERS) == sorted(dc.COMMANDS), "each command names the test that runs it"
    for name, runner in dc.RUNNERS.items():
        path = ROOT / runner.split("::")[0].split(" ")[0]
        assert path.is_file(), (name, runner)
        text = path.read_text()
        if path.name == "run":  # .ci/run: the shell script holds the command itself
            assert dc.COMMANDS[name] in text, f".ci/run does not run {name}: {dc.COMMANDS[name]!r}"
        elif runner != dc.COMPOSED:  # test_gpu_commands_compose takes every command whose runner it is
            assert re.search(rf"\b{name}\b", text), f"{runner} does not use doc_commands.{name}"
        if "::" in runner:
            test = runner.split("::")[1].split(" ")[0]
            assert f"def {test}(" in text, (name, runner)


@pytest.mark.quick
def test_gpu_commands_compose():
    """GPUs and a model hub are not here: compose each such command's overrides with Hydra and run mlora's checks
    (``finalize``) at the command's world size, as mlora-train does before anything loads."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlora.config.schema import register_schema
    from mlora.config.validate import finalize
    from mlora.train.__main__ import CONFIG_DIR

    register_schema()
    composed = [name for name, runner in dc.RUNNERS.items() if runner == dc.COMPOSED]
    assert composed
    for name in composed:
        env, argv = dc.split(dc.COMMANDS[name])
        if argv[0] == "sbatch":
            env, nodes, gpus, args = dc.sbatch_parts(dc.COMMANDS[name])
            world = (nodes - int(env.get("MLORA_ENGINE_NODES", 0))) * gpus
        else:
            world, module, args = dc.torchrun_parts(dc.COMMANDS[name])
            assert module == "mlora.train", argv
        assert world > 0 and all("=" in a and not a.startswith("--") for a in args), (name, args)
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = OmegaConf.to_object(compose(config_name="ppo", overrides=args))
        finalize(cfg, world, explicit=[a.split("=", 1)[0] for a in args])


@pytest.mark.skipif(os.environ.get("MLORA_FIRST_COMMAND") != "1",
                    reason="the README's first command takes about 15 minutes on 2 cores: MLORA_FIRST_COMMAND=1")
def test_first_command():
    """The README's first command as it is: SmolLM2 learns addition, and the served adapter answers as well as the
    trainer's own last evaluation said it would."""
    proc = subprocess.run(["bash", "-c", dc.FIRST], cwd=ROOT, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    served = re.search(r"served by vLLM's OpenAI server: held-out accuracy ([0-9.]+) over 64 questions", proc.stdout)
    trained = re.search(r"the run's own last evaluation \(step 20\): ([0-9.]+); difference", proc.stdout)
    assert served and trained, proc.stdout[-4000:]
    assert float(served.group(1)) >= 0.75 and abs(float(served.group(1)) - float(trained.group(1))) <= 0.05
