"""The end of run_all.sh: one line per script and a total over every check line, into ``$OUT/run_all.json``.

    python tests/gpu/run_summary.py OUT_DIR MODE

Reads ``OUT_DIR/run_all.tsv`` (one row per step run_all.sh took: name, exit status, seconds, time limit) and
``OUT_DIR/logs/<script>.log`` (each script's output), and records with :class:`report.Report`:

- ``wheelhouse_install``: how the carried wheels were installed and in how long (device mode), or the offline
  resolution for CPython 3.12 that proved the wheelhouse complete (dry mode);
- one record per check script (named by its file stem): passed when it exited 0 having measured something,
  skipped when it only skipped (no CUDA, no Transformer Engine: exit 3 included) or is missing, failed when it
  exited otherwise or ran out of its time limit;
- ``vllm`` and ``transformer_engine``: skipped, because neither can be carried to the device (their CUDA wheels
  are hundreds of MB; the limit is 64 MiB), so nothing here checks the vLLM engines or fp8="te" there.

Then a last line with the counts of PASS / FAIL / SKIP over all check lines of the run, and exits 1 when any
step failed, else 0.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import Report  # noqa: E402

LINE = re.compile(r"^check (?P<name>\S+): (?P<rest>.*)$")
TIMEOUT_CODES = (124, 137)
SKIP_CODE = 3  # check_fp8_te.py's "Transformer Engine cannot be imported here"
NOT_CARRIED = {
    "vllm": "vLLM is not on the device and cannot be carried: vllm 0.32.0's CUDA wheel is 311 MiB (the carry limit "
            "is 64 MiB), so the engine, sleep/wake and tensor hand-off paths are not checked here; they need a GPU "
            "machine set up with scripts/setup_gpu.sh",
    "transformer_engine": "Transformer Engine is not on the device and cannot be carried (its CUDA wheels are "
                          "hundreds of MB): fp8='te' is not checked here; check_fp8_te.py runs where "
                          "scripts/setup_gpu.sh installed it",
}


def check_lines(log: Path) -> dict[str, str]:
    """``{check: verdict text}`` of the ``check <name>: ...`` lines a script printed."""
    if not log.exists():
        return {}
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if m:
            out[m["name"]] = m["rest"]
    return out


def said_skipped(log: Path) -> list[str]:
    """Why a script that does not print ``check`` lines skipped (check_fp8_te.py: ``[...] skipped: "why"``)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [m.group(1) for m in re.finditer(r'skipped"?:\s*"?([^"\n]+)"?', text)][-1:]


def recorded(out: Path) -> dict[str, dict]:
    """Every check entry of the run's JSON files (``Report`` writes ``{check: {figure, pass, ...}}``)."""
    entries: dict[str, dict] = {}
    for path in sorted(out.glob("*.json")):
        if path.name == "run_all.json":
            continue
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict):
            entries.update({k: v for k, v in data.items() if isinstance(v, dict) and "pass" in v})
    return entries


def verdict(entry: dict | None, rest: str) -> str:
    """PASS, FAIL, SKIP or FIGURE (measured, no goal) from the JSON entry, else from the printed line."""
    if entry is None:
        return "SKIP" if rest.startswith("SKIP") else "FAIL" if rest.startswith("FAIL") else "FIGURE"
    if "skipped" in entry:
        return "SKIP"
    return {True: "PASS", False: "FAIL"}.get(entry.get("pass"), "FIGURE")


def main() -> None:
    skipped: list[str] = []

    def skip(name: str, why: str) -> None:  # a whole script or package not run here
        skipped.append(name)
        report.skip(name, why)

    out, mode = Path(sys.argv[1]), sys.argv[2]
    report = Report("run_all", out)
    failed = False
    rows = [line.split("\t") for line in (out / "run_all.tsv").read_text().splitlines() if line.strip()]
    all_lines: dict[str, str] = {}
    entries = recorded(out)
    for name, status, seconds, limit in rows:
        if name == "wheelhouse_install":
            ok = status in ("pip", "unzip", "verified")
            what = {"pip": "pip install --no-index from the carried wheels",
                    "unzip": "pip unusable here: the carried wheels unzipped onto PYTHONPATH",
                    "verified": "dry mode: the wheelhouse resolves offline for CPython 3.12 manylinux with the "
                                "device's torch 2.11 (tests/gpu/wheelhouse.py verify)"}.get(status, status)
            report.record(name, f"{float(seconds):.0f} s", ok, what)
            failed |= not ok
            continue
        stem = Path(name).stem
        lines = check_lines(out / "logs" / f"{stem}.log")
        all_lines.update(lines)
        counts = {v: sum(verdict(entries.get(c), r) == v for c, r in lines.items())
                  for v in ("PASS", "FAIL", "SKIP", "FIGURE")}
        took = f"{float(seconds):.0f} s of its {limit} s"
        if status == "missing":
            skip(stem, "script missing")
        elif status == "out-of-time":
            report.record(stem, "not run", False, f"run_all.sh's time budget was spent before it ({limit} s left)")
            failed = True
        elif int(status) in TIMEOUT_CODES:
            report.record(stem, f"timed out ({took})", False,
                          f"{counts['PASS']} PASS, {counts['FAIL']} FAIL before the limit; see logs/{stem}.log")
            failed = True
        elif int(status) == SKIP_CODE or (int(status) == 0 and lines and counts["SKIP"] == len(lines)):
            reasons = sorted({r[len("SKIP "):] for r in lines.values() if r.startswith("SKIP")}) or said_skipped(
                out / "logs" / f"{stem}.log")
            skip(stem, f"exit {status}, {took}: " + ("; ".join(reasons) if reasons else "nothing to run here"))
        elif int(status) == 0:
            report.record(stem, f"exit 0 in {took}", True,
                          f"{counts['PASS']} PASS, {counts['FIGURE']} figures, {counts['SKIP']} SKIP")
        else:
            report.record(stem, f"exit {status} in {took}", False,
                          f"{counts['PASS']} PASS, {counts['FAIL']} FAIL; see logs/{stem}.log")
            failed = True
    for module, why in NOT_CARRIED.items():
        if mode == "device" and importlib.util.find_spec(module) is not None:
            skip(module, f"{module} is importable on this machine, but run_all.sh has no check of it")
        else:
            skip(module, why)
    counts = {v: sum(verdict(entries.get(c), r) == v for c, r in all_lines.items())
              for v in ("PASS", "FAIL", "SKIP", "FIGURE")}
    print(f"run_all: {len(all_lines)} check lines: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP, "
          f"{counts['FIGURE']} figures without a goal; {len(skipped)} scripts or packages skipped whole "
          f"({', '.join(skipped) or 'none'}); JSON in {out}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
