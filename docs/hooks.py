"""MkDocs hooks of the docs site (``mkdocs.yml``: ``hooks``): the generated pages.

A committed page holding ``<!-- mlora:generated NAME -->`` gets that marker replaced at build time by:

- ``configuration``: every ``mlora-train`` key, from the typed schema (:mod:`mlora.config.reference`) and the
  SkyRL keys mlora refuses (:mod:`mlora.config.skyrl_absent`);
- ``cli``: every command line, from its parser (``docs/cli_reference.py``);
- ``performance``: the figures of ``bench/records.jsonl`` (``bench/records.py``).

and any page may cite one figure with ``<!-- mlora:record ID -->``: replaced by the record's headline figures, date
and machine, linked to it on the performance page (an unknown ID fails the build), so that the figure itself is
typed only in ``bench/records.jsonl``.

Nothing generated is committed; ``tests/test_docs_site.py`` builds the site in strict mode.
"""

from __future__ import annotations

import importlib.util
import posixpath
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# markers, not inside `code` (where a page shows one)
MARKER = re.compile(r"(?<!`)<!-- mlora:generated ([a-z]+) -->")
RECORD = re.compile(r"(?<!`)<!-- mlora:record ([A-Za-z0-9_.-]+) -->")


def load(relpath: str):
    """A module of this checkout by its path (``bench/records.py``, ``docs/cli_reference.py``): neither folder goes
    on ``sys.path``, where ``bench/tinker.py`` would shadow the tinker SDK."""
    name = "_mlora_docs_" + relpath.replace("/", "_").removesuffix(".py")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / relpath)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    return sys.modules[name]


def configuration() -> str:
    from mlora.config.reference import config_rows, render_markdown
    from mlora.config.skyrl_absent import ABSENT

    rows, sections = config_rows()
    return "\n".join(render_markdown(rows, sections, ABSENT))


def cli() -> str:
    reference = load("docs/cli_reference.py")
    return "\n".join(reference.render_markdown(reference.commands(ROOT), reference.config_names()))


def performance() -> str:
    records = load("bench/records.py")
    return "\n".join(records.render_markdown(records.load()))


GENERATORS = {"configuration": configuration, "cli": cli, "performance": performance}


def on_startup(command, dirty) -> None:  # noqa: ARG001 - MkDocs' signature
    if str(ROOT) not in sys.path:  # a checkout without mlora installed
        sys.path.insert(0, str(ROOT))
    # importing mlora imports torch and megatron-core, whose deprecation notes would fill the build's log
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(torch|megatron)(\.|$)")


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' signature
    def generate(match: re.Match) -> str:
        name = match.group(1)
        if name not in GENERATORS:
            raise ValueError(f"{page.file.src_path}: no generator {name!r}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name]()

    markdown = MARKER.sub(generate, markdown)
    if RECORD.search(markdown):
        records = load("bench/records.py")
        by_id = {r["id"]: r for r in records.load()}
        target = posixpath.relpath("performance.md", posixpath.dirname(page.file.src_uri) or ".")

        def cite(match: re.Match) -> str:
            if match.group(1) not in by_id:
                raise ValueError(f"{page.file.src_path}: no record {match.group(1)!r} in bench/records.jsonl")
            return records.citation(by_id[match.group(1)], target)

        markdown = RECORD.sub(cite, markdown)
    return markdown
