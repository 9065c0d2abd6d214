"""The performance figures as data: ``bench/records.jsonl``, one JSON object per figure, that the bench scripts
append to and the docs site's performance page is generated from (``docs/hooks.py``); no figure is typed by hand
in two places.

A record: ``id`` (unique), ``group`` (the page's section), ``title``, ``what`` (what was measured, and how),
``command``, ``result`` (Markdown text; the headline figures in **bold**) or ``output`` (what a bench printed,
verbatim), optional ``notes``, ``machine`` (``cpu``, ``cores``), ``date`` (UTC, YYYY-MM-DD; ``date_from``:
``commit`` when it is the commit's date, the figure itself being undated) and ``commit`` (the checkout measured;
``-dirty`` when it had uncommitted changes).

A bench script records its run with ``records.main(main, group=...)`` in place of ``main()``: what it prints is
kept as the record's ``output`` once it returns. ``MLORA_BENCH_RECORDS=0`` turns that off; another path there
writes the records to that file instead.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

ROOT = Path(__file__).resolve().parents[1]
RECORDS = Path(__file__).resolve().parent / "records.jsonl"
REQUIRED = ("id", "group", "title", "what", "command", "machine", "date", "commit")
# re-invocations of a bench by itself (one variant in a fresh process): their parent records the run
CHILD_FLAGS = ("--child", "--worker", "--variant")


def machine() -> dict[str, Any]:
    """This machine: the CPU's model name (family / model and AVX-512 / AMX where /proc/cpuinfo says) and cores."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
            if not line.strip():
                break
    except OSError:
        pass
    name = info.get("model name") or __import__("platform").processor() or "unknown CPU"
    extra = []
    if "cpu family" in info:
        extra.append(f"family {info['cpu family']} model {info.get('model', '?')}")
    flags = info.get("flags", "").split()
    extra += [isa for isa, flag in (("AVX-512", "avx512f"), ("AMX", "amx_tile")) if flag in flags]
    return {"cpu": name + (f" ({', '.join(extra)})" if extra else ""), "cores": os.cpu_count()}


def commit() -> str:
    """HEAD of the checkout, ``-dirty`` when mlora/ or bench/ has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "mlora", "bench"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load(path: Path = RECORDS) -> list[dict[str, Any]]:
    """The records of ``path`` (a missing file: none); each line one JSON object."""
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON object: {exc}") from None
    return out


def check(records: list[dict[str, Any]]) -> None:
    """Every record has the required fields, a result or an output, and an id of its own."""
    seen = set()
    for r in records:
        missing = [k for k in REQUIRED if not r.get(k)]
        if missing or not (r.get("result") or r.get("output")):
            raise ValueError(f"record {r.get('id')!r} lacks {', '.join(missing) or 'a result or output'}")
        if r["id"] in seen:
            raise ValueError(f"record id {r['id']!r} is used twice")
        seen.add(r["id"])


def append(record: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
    """Add ``record`` to the records file (``machine``, ``date``, ``commit`` and ``id`` filled in when absent);
    returns it as written."""
    path = path or Path(os.environ.get("MLORA_BENCH_RECORDS") or RECORDS)
    now = dt.datetime.now(dt.timezone.utc)
    record = {**record}
    record.setdefault("machine", machine())
    record.setdefault("date", now.strftime("%Y-%m-%d"))
    record.setdefault("commit", commit())
    record.setdefault("id", f"{record.get('bench', 'bench')}-{now.strftime('%Y-%m-%dT%H%M%S')}")
    check(load(path) + [record])
    with path.open("a") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return record


class _Tee:
    """sys.stdout that also keeps what is written."""

    def __init__(self, stream) -> None:
        self.stream, self.kept = stream, io.StringIO()

    def write(self, s: str) -> int:
        self.kept.write(s)
        return self.stream.write(s)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def main(fn: Callable[[], Any], group: str, title: str | None = None) -> Any:
    """Run a bench's ``main`` and record what it printed (``output``), with its docstring's first line as the
    title and its command line. No record for a bench's own child processes (:data:`CHILD_FLAGS`), when
    ``MLORA_BENCH_RECORDS=0``, or when ``fn`` fails."""
    script = Path(sys.argv[0])
    if any(flag in sys.argv[1:] for flag in CHILD_FLAGS) or os.environ.get("MLORA_BENCH_RECORDS") == "0":
        return fn()
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        result = fn()
    finally:
        sys.stdout = tee.stream
    doc = (sys.modules["__main__"].__doc__ or "").strip()
    what = " ".join(doc.split("\n\n")[0].split()) if doc else script.stem
    command = " ".join([".venv/bin/python", f"bench/{script.name}", *map(shlex.quote, sys.argv[1:])])
    record = append({"bench": script.stem, "group": group, "title": title or what.split(". ")[0], "what": what,
                     "command": command, "output": tee.kept.getvalue().strip()[-6000:]})
    print(f"recorded as {record['id']} in {os.environ.get('MLORA_BENCH_RECORDS') or RECORDS}")
    return result


def headline(record: dict[str, Any]) -> list[str]:
    """The record's figures in bold (``**0.89×**``), in order: what the page's summary shows."""
    return [b for b in re.findall(r"\*\*(.+?)\*\*", record.get("result", "")) if re.search(r"\d", b)]


def citation(record: dict[str, Any], performance_page: str = "performance.md") -> str:
    """One record cited in running text: its headline figures, date and machine, linked to its entry."""
    figures = ", ".join(f"**{f}**" for f in headline(record)[:3])
    cores = f", {record['machine']['cores']} cores" if record["machine"].get("cores") else ""
    return (f"{figures + ' — ' if figures else ''}[{record['title']}]({performance_page}#{_anchor(record['id'])}) "
            f"({record['date']}, {record['machine']['cpu']}{cores})")


def _anchor(record_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "-", record_id)


def render_markdown(records: Iterable[dict[str, Any]]) -> Iterator[str]:
    """The performance page's generated part: a summary table, then each group's records, newest first."""
    records = list(records)
    check(records)
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault(r["group"], []).append(r)
    for rs in groups.values():
        rs.sort(key=lambda r: r["date"], reverse=True)
    yield f"{len(records)} records in {len(groups)} groups (`bench/records.jsonl`)."
    yield ""
    yield "| group | figure | date | headline |"
    yield "| --- | --- | --- | --- |"
    for group, rs in groups.items():
        for r in rs:
            figures = ", ".join(headline(r)[:4])
            yield f"| {group} | [{r['title']}](#{_anchor(r['id'])}) | {r['date']} | {figures} |"
    yield ""
    for group, rs in groups.items():
        yield f"## {group}"
        yield ""
        for r in rs:
            m = r["machine"]
            cores = f", {m['cores']} cores" if m.get("cores") else ""
            date = r["date"] + (" (the commit's date)" if r.get("date_from") == "commit" else "")
            yield f"### {r['title']} {{#{_anchor(r['id'])}}}"
            yield ""
            yield f"*{date} · {m['cpu']}{cores} · commit `{r['commit']}` · record `{r['id']}`*"
            yield ""
            yield f"**Measured:** {r['what']}"
            yield ""
            if "`" in r["command"]:  # Markdown already (a command with its variants)
                yield f"**Command:** {r['command']}"
            else:
                yield "```bash"
                yield r["command"]
                yield "```"
            yield ""
            if r.get("result"):
                yield f"**Result:** {r['result']}"
                yield ""
            if r.get("output"):
                yield "```text"
                yield r["output"]
                yield "```"
                yield ""
            if r.get("notes"):
                yield f"**Note:** {r['notes']}"
                yield ""
