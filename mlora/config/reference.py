"""The configuration reference, read off the typed schema (:mod:`mlora.config.schema`): every ``mlora-train`` key by
its dotted path, with its type, default, SkyRL's name for it and what it does.

What a key does is the comment written beside it in ``schema.py`` (the comment lines right above the field and the
comment at the end of its line); a section's text is its class docstring. Pure: source and dataclasses in, rows
out (:func:`config_rows`), and the Markdown page of the docs site from them (:func:`render_markdown`, used by
``docs/hooks.py``). ``tests/test_docs_reference.py`` fails when a key has no description.

SkyRL's name: keys are SkyRL's unless their description starts with ``mlora`` (or their section's docstring
does), which marks mlora's own keys; :data:`SKYRL_OLD_NAMES` lists the keys that are an older SkyRL name of another
key (``validate`` merges each pair into one value).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import re
import tokenize
from dataclasses import dataclass
from typing import Any, Iterator

# older SkyRL (skyrl_train) name -> current SkyRL name; mlora accepts both and merges them
# (mlora.config.validate: _resolve_generator, _check_packing)
SKYRL_OLD_NAMES = {
    "generator.num_inference_engines": "generator.inference_engine.num_engines",
    "generator.inference_engine_tensor_parallel_size": "generator.inference_engine.tensor_parallel_size",
    "generator.backend": "generator.inference_engine.backend",
    "generator.run_engines_locally": "generator.inference_engine.run_engines_locally",
    "generator.weight_sync_backend": "generator.inference_engine.weight_sync_backend",
    "generator.gpu_memory_utilization": "generator.inference_engine.gpu_memory_utilization",
    "generator.engine_init_kwargs": "generator.inference_engine.engine_init_kwargs",
    "trainer.use_sample_packing": "trainer.remove_microbatch_padding",
}

_MLORA = re.compile(r"mlora\b")


@dataclass(frozen=True)
class ConfigRow:
    """One key of the configuration."""

    key: str  # full dotted path, e.g. trainer.policy.model.lora.rank
    type: str  # as written in the schema, Optional[X] as "X | null"
    default: str  # YAML-like: null, true, 32, "all-linear"; "(required)" for MISSING
    skyrl: str  # SkyRL's name for it (Markdown)
    description: str  # the schema's comments on the field ("" when none)
    section: str  # dotted path of the section holding it ("" at the top)
    mlora_only: bool  # a key SkyRL does not have


@dataclass(frozen=True)
class ConfigSection:
    path: str
    doc: str  # the section class's docstring ("" when none)


def _comments(source: str) -> dict[int, str]:
    """Line number -> the comment on that line (without ``#``)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def field_comments(source: str) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """``{class: {field: comment}}`` and ``{class: docstring}`` of the dataclasses in ``source``.

    A field's comment is the block of comment lines right above it (no blank line between) followed by the
    comment at the end of its statement's lines."""
    comments = _comments(source)
    lines = source.splitlines()
    fields: dict[str, dict[str, str]] = {}
    docs: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs[node.name] = ast.get_docstring(node) or ""
        own = fields.setdefault(node.name, {})
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above = []
            n = stmt.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            trailing = [comments[i] for i in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1)
                        if i in comments and not lines[i - 1].strip().startswith("#")]
            own[stmt.target.id] = " ".join(above + trailing).strip()
    return fields, docs


def _type_text(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    text = re.sub(r"^Optional\[(.*)\]$", r"\1 | null", text)
    return text.replace("Any", "any")


def _default_text(value: Any) -> str:
    if isinstance(value, str) and value == "???":  # omegaconf.MISSING
        return "(required)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    return json.dumps(value, default=str)


def _doc_text(doc: str) -> str:
    """A docstring's reST as Markdown: ``x`` and :role:`~x` become `x`, paragraphs joined."""
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", doc)
    doc = doc.replace("``", "`")
    return " ".join(line.strip() for line in doc.splitlines() if line.strip())


def config_rows(root: type | None = None, source: str | None = None) -> tuple[list[ConfigRow], list[ConfigSection]]:
    """Every leaf key of ``root`` (default :class:`~mlora.config.schema.TrainConfig`) in declaration order, depth
    first, a section's own keys before its subsections; and the sections in that order."""
    if root is None:
        from mlora.config.schema import TrainConfig as root  # noqa: N813
    if source is None:
        source = inspect.getsource(inspect.getmodule(root))
    comments, docs = field_comments(source)
    instance = root()
    rows: list[ConfigRow] = []
    sections: list[ConfigSection] = []
    canonical_of = SKYRL_OLD_NAMES
    old_of = {new: old for old, new in SKYRL_OLD_NAMES.items()}

    def comment(cls: type, name: str) -> str:
        for klass in cls.__mro__:
            if name in comments.get(klass.__name__, {}):
                return comments[klass.__name__][name]
        return ""

    def walk(obj: Any, prefix: str, section_mlora: bool) -> None:
        cls = type(obj)
        doc = docs.get(cls.__name__, "")
        mlora_section = section_mlora or bool(_MLORA.match(doc))
        sections.append(ConfigSection(prefix, _doc_text(doc)))
        nested = []
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            key = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(value):
                nested.append((value, key))
                continue
            desc = comment(cls, f.name)
            mlora_only = mlora_section or bool(_MLORA.match(desc))
            if key in canonical_of:
                new = canonical_of[key]
                skyrl = f"older SkyRL (skyrl_train) name of [`{new}`](#{new}); either may be set, not both differently"
            elif mlora_only:
                skyrl = "none: mlora's own key"
            elif key in old_of:
                skyrl = f"same key; older SkyRL (skyrl_train) name: [`{old_of[key]}`](#{old_of[key]})"
            else:
                skyrl = "same key"
            rows.append(ConfigRow(key, _type_text(f.type), _default_text(value), skyrl, desc, prefix, mlora_only))
        for value, key in nested:
            walk(value, key, mlora_section)

    walk(instance, "", False)
    return rows, sections


def _escape(text: str) -> str:
    """Comment text as Markdown text: no HTML tags, emphasis or reference links by accident; `code` spans kept."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code spans
        parts = [text.replace("`", "'")]
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(f"`{part}`")
            continue
        part = part.replace("\\", "\\\\").replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        out.append(re.sub(r"([*_\[\]])", r"\\\1", part))
    return "".join(out)


def render_markdown(rows: list[ConfigRow], sections: list[ConfigSection],
                    absent: dict[str, str] | None = None) -> Iterator[str]:
    """The reference page's lines: one heading per section (its docstring below it), one per key (anchor: the
    key itself, so ``reference/configuration.md#trainer.policy.model.lora.rank`` links to it), then SkyRL's keys
    that mlora does not have (``absent``: prefix -> why)."""
    by_section: dict[str, list[ConfigRow]] = {}
    for row in rows:
        by_section.setdefault(row.section, []).append(row)
    yield (f"{len(rows)} keys, {sum(not r.mlora_only for r in rows)} of them SkyRL's. Set one on the command line "
           "as `KEY=VALUE` (Hydra's override syntax, e.g. `trainer.policy.model.lora.rank=16`) or in a YAML file "
           "of `mlora/configs/` (`--config-name NAME`); Hydra refuses a key that is not listed here and a value "
           "of the wrong type.")
    yield ""
    for section in [s for s in sections if s.path] + [s for s in sections if not s.path]:  # the top's keys last
        own = by_section.get(section.path, [])
        if not own and not section.doc:
            continue
        yield f"## `{section.path}` {{#section-{section.path}}}" if section.path else "## Top-level keys {#section-top}"
        yield ""
        if section.doc:
            yield _escape(section.doc)
            yield ""
        for row in own:
            yield f"### {row.key} {{#{row.key}}}"
            yield ""
            yield (f"**type** `{row.type}` · **default** `{row.default}` · **SkyRL** {row.skyrl}")
            yield ""
            yield _escape(row.description) if row.description else "*(no description)*"
            yield ""
    if absent:
        yield "## SkyRL keys mlora does not have {#skyrl-absent}"
        yield ""
        yield ("A SkyRL key below (or under a prefix below) stops `mlora-train` before anything loads, with the "
               "reason given here (`mlora.config.skyrl_absent`).")
        yield ""
        yield "| SkyRL key or prefix | why mlora does not have it |"
        yield "| --- | --- |"
        for key, why in sorted(absent.items()):
            yield f"| `{key}` | {_escape(why).replace('|', '&#124;')} |"
        yield ""
