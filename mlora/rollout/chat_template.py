"""The chat template a run renders prompts and multi-turn conversations with: SkyRL's ``generator.chat_template``
(a template by name or from a file; none: the tokenizer's own) and ``generator.chat_template_kwargs`` (passed to
every ``apply_chat_template`` call, e.g. Qwen3's ``enable_thinking``)."""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Any, Mapping

SOURCES = ("name", "file")
SKYRL_TEMPLATES_FILE = "train/generators/utils.py"  # inside the skyrl wheel: CUSTOM_CHAT_TEMPLATES


def skyrl_named_templates() -> dict[str, str]:
    """SkyRL's named templates (``CUSTOM_CHAT_TEMPLATES``: ``qwen3_with_thinking``, ``qwen3_without_thinking``),
    read from the installed ``skyrl`` wheel's source, not retyped. ``{}`` when the wheel is not installed."""
    spec = importlib.util.find_spec("skyrl")
    if spec is None or spec.origin is None:
        return {}
    path = Path(spec.origin).parent / SKYRL_TEMPLATES_FILE
    for node in ast.parse(path.read_text()).body:
        names = [getattr(t, "id", None) for t in getattr(node, "targets", ())]
        if isinstance(node, ast.Assign) and "CUSTOM_CHAT_TEMPLATES" in names:
            return ast.literal_eval(node.value)
    return {}


def resolve_chat_template(source: str, name_or_path: str | None) -> str | None:
    """The template text of ``generator.chat_template`` (None: the tokenizer's own). ValueError naming the key
    and what is valid for an unknown source or name or a missing file."""
    if source not in SOURCES:
        raise ValueError(f"generator.chat_template.source={source!r}; valid: {', '.join(SOURCES)}")
    if not name_or_path:
        return None
    if source == "file":
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ValueError(f"generator.chat_template.name_or_path={name_or_path!r}: no such template file")
        return path.read_text(encoding="utf-8")
    named = skyrl_named_templates()
    if not named:
        raise ValueError(f"generator.chat_template.name_or_path={name_or_path!r} names one of SkyRL's templates, read "
                         "from the skyrl package: install it (pip install --no-deps skyrl==0.3.0) or give the template "
                         "as a file (generator.chat_template.source=file)")
    if name_or_path not in named:
        raise ValueError(f"generator.chat_template.name_or_path={name_or_path!r}: not a SkyRL template; valid: "
                         f"{', '.join(named)} (or source=file with a Jinja file)")
    return named[name_or_path]


def apply_run_template(tokenizer, template: str | None, kwargs: Mapping[str, Any] | None) -> Any:
    """``tokenizer`` made to render as the run says: its ``chat_template`` replaced by ``template`` (when given) and
    ``kwargs`` passed to every ``apply_chat_template`` call (the prompts' and the multi-turn conversations'), so
    that every part of the run renders one way. Returns the tokenizer."""
    if template is not None:
        tokenizer.chat_template = template
    if kwargs:
        render = tokenizer.apply_chat_template
        tokenizer.apply_chat_template = functools.partial(render, **dict(kwargs))
    return tokenizer
