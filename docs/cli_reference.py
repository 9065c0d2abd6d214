"""The command-line reference, read off the parsers: ``mlora`` (:mod:`mlora.cli`), ``mlora-train`` (Hydra: its
usage and config names), ``python -m mlora.service`` and the scripts in ``tools/``.

Each argparse parser is built by its module's ``build_parser()``, which runs nothing. :func:`commands` returns
them with their arguments, :func:`render_markdown` the docs site's page (``docs/hooks.py``);
``tests/test_docs_reference.py`` fails when a command or an argument has no help text.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Argument:
    flags: str  # "--tp" / "--in BRIDGE_CKPT" / "checkpoint"
    default: str  # "" when none
    choices: str  # "a, b" or ""
    help: str
    group: str  # the argument group's title ("" for the parser's own)
    required: bool


@dataclass
class Command:
    name: str  # what one types: "mlora plan", "python tools/convert_checkpoint.py hf-to-mcore"
    summary: str  # one line (the subcommand's help, or the description's first line)
    description: str  # the parser's description ("" when none)
    usage: str
    arguments: list[Argument] = field(default_factory=list)
    source: str = ""  # where the parser is built
    same_as: str = ""  # a tools/ wrapper: the command it runs


def _load_tool(path: Path):
    spec = importlib.util.spec_from_file_location(f"_mlora_tool_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _arguments(parser: argparse.ArgumentParser) -> list[Argument]:
    formatter = parser._get_formatter()
    out = []
    for group in parser._action_groups:
        title = "" if group.title in ("positional arguments", "options", "optional arguments") else group.title
        for action in group._group_actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if action.option_strings:
                flags = ", ".join(action.option_strings)
                if action.nargs != 0:
                    metavar = formatter._format_args(action, action.dest.upper())
                    flags += f" {metavar}"
            else:
                flags = action.metavar or action.dest
            default = "" if action.default in (None, argparse.SUPPRESS) or action.nargs == 0 else action.default
            if isinstance(default, (list, tuple)):
                default = " ".join(map(str, default))
            choices = ", ".join(map(str, action.choices)) if action.choices else ""
            text = formatter._expand_help(action) if action.help else ""
            out.append(Argument(flags, str(default), choices, text, title, bool(action.required)))
    return out


def _parser_commands(parser: argparse.ArgumentParser, name: str, source: str) -> list[Command]:
    description = parser.description or ""
    first = description.strip().splitlines()[0] if description.strip() else ""
    cmds = [Command(name, first, description, parser.format_usage().strip(), _arguments(parser), source)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for sub_name, sub in action.choices.items():
                cmds.append(Command(f"{name} {sub_name}", helps.get(sub_name, ""), sub.description or "",
                                    sub.format_usage().strip(), _arguments(sub), source))
    return cmds


def config_names(config_dir: Path | None = None) -> dict[str, str]:
    """``mlora-train --config-name`` choices: file stem -> the YAML file's leading comment."""
    config_dir = config_dir or ROOT / "mlora" / "configs"
    out = {}
    for path in sorted(config_dir.glob("*.yaml")):
        lines = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            lines.append(line.lstrip("#").strip())
        out[path.stem] = " ".join(lines).strip()
    return out


def commands(root: Path = ROOT) -> list[Command]:
    """Every command line, in the order of the page."""
    from mlora.cli import build_parser as mlora_parser
    from mlora.service.__main__ import build_parser as service_parser

    out = _parser_commands(mlora_parser(), "mlora", "mlora/cli.py")
    out += _parser_commands(service_parser(), "python -m mlora.service", "mlora/service/__main__.py")
    for path in sorted((root / "tools").glob("*.py")):
        module = _load_tool(path)
        name = f"python tools/{path.name}"
        if hasattr(module, "build_parser"):
            out += _parser_commands(module.build_parser(), name, f"tools/{path.name}")
        else:  # a wrapper of an mlora subcommand: `sys.exit(main(["merge", *sys.argv[1:]]))`
            match = re.search(r'main\(\["([a-z-]+)"', path.read_text())
            doc = (module.__doc__ or "").strip()
            out.append(Command(name, doc.splitlines()[0] if doc else "", doc, "", [], f"tools/{path.name}",
                               same_as=f"mlora {match.group(1)}" if match else ""))
    return out


def _cell(text: str) -> str:
    text = " ".join(text.split())
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")
    return re.sub(r"([*_\[\]])", r"\\\1", text)


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("python -m ", "").replace("python ", "")).strip("-")


def render_markdown(cmds: list[Command], configs: dict[str, str]) -> Iterator[str]:
    yield "## `mlora-train` {#mlora-train}"
    yield ""
    yield ("The training entry point (`mlora/train/__main__.py`): Hydra composes a config from `mlora/configs/` "
           "and the overrides, checked against the typed schema (every key: [Configuration](configuration.md)).")
    yield ""
    yield "```"
    yield "mlora-train [--config-name NAME] [KEY=VALUE ...]            # one process (CPU demo, one GPU)"
    yield "mlora-train --nproc_per_node N [torchrun options] [--config-name NAME] [KEY=VALUE ...]"
    yield "                                                          # N ranks under torchrun, one report on failure"
    yield "mlora-train --help | --cfg job [--config-name NAME] [KEY=VALUE ...]   # Hydra's help; the composed config"
    yield "```"
    yield ""
    yield ("`KEY=VALUE` overrides a key (`trainer.policy.model.lora.rank=16`), `+KEY=VALUE` adds one under a dict "
           "key, `--config-name NAME` picks the YAML file (default `ppo`). SkyRL's command lines run unchanged: "
           "its keys are mlora's (see [Running a SkyRL command](../skyrl.md)).")
    yield ""
    yield "| `--config-name` | what it runs |"
    yield "| --- | --- |"
    for name, text in configs.items():
        yield f"| `{name}` | {_cell(text)} |"
    yield ""
    for cmd in cmds:
        level = "###" if " " in cmd.name.replace("python -m ", "").replace("python ", "") else "##"
        yield f"{level} `{cmd.name}` {{#{_anchor(cmd.name)}}}"
        yield ""
        if cmd.same_as:
            yield (f"The same command as [`{cmd.same_as}`](#{_anchor(cmd.same_as)}) (same flags, output and exit "
                   f"codes), for a checkout without mlora installed. Source: `{cmd.source}`.")
            yield ""
            continue
        if cmd.summary:
            yield _cell(cmd.summary)
            yield ""
        if cmd.usage:
            yield "```"
            yield cmd.usage
            yield "```"
            yield ""
        rest = cmd.description.strip().split("\n", 1)[1].strip() if "\n" in cmd.description.strip() else ""
        if rest:
            yield '??? note "More"'
            yield ""
            yield "    ```text"
            for line in rest.splitlines():
                yield f"    {line}" if line.strip() else ""
            yield "    ```"
            yield ""
        groups: dict[str, list[Argument]] = {}
        for arg in cmd.arguments:
            groups.setdefault(arg.group, []).append(arg)
        for title, args in groups.items():
            if title:
                yield f"*{_cell(title)}*"
                yield ""
            yield "| argument | default | what it does |"
            yield "| --- | --- | --- |"
            for arg in args:
                default = "(required)" if arg.required else f"`{arg.default}`" if arg.default else ""
                choices = f" One of: `{arg.choices}`." if arg.choices else ""
                yield f"| `{arg.flags}` | {default} | {_cell(arg.help)}{choices} |"
            yield ""
        yield f"Source: `{cmd.source}`."
        yield ""
