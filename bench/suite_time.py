"""Where the test suite's time goes, and what the rank pool saves, side by side in one run.

    .venv/bin/python bench/suite_time.py table BEFORE.txt[=LABEL] [AFTER.xml ...]   # --durations=0 or --junitxml
    .venv/bin/python bench/suite_time.py startups [--rounds 2] [TEST ...]

``table``: every duration line (setup, call and teardown of each test) is put in one cost kind by what the
test starts (:data:`KINDS`, first match wins; a module fixture's launch lands on the test that ran it) and
the kinds are summed: tests counted and minutes, per file given, side by side.

``startups``: the same test files (by default the multi-rank equivalence launches and a one-rank training
run) run by pytest with their ranks forked from the rank pool and, alternately, launched by torchrun
(``MLORA_TEST_TORCHRUN=1``, the suite before the pool); the median wall seconds of each and their ratio.
Both print the CPU they ran on.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

# (kind, pattern on "file::test"): what a test starts decides its kind
KINDS: tuple[tuple[str, str], ...] = (
    ("Slurm cluster + sbatch runs", r"test_slurm\.py"),
    ("training runs (mlora-train, vLLM engines)",
     r"test_rl_loop\.py|test_async_training\.py|test_resume\.py|test_multi_turn\.py::test_multi_turn_runs|"
     r"test_skyrl_keys\.py::test_(example_trains|configs_ship)|test_skyrl_lora_examples\.py::test_\w+_trains|"
     r"test_weight_sync_tensors\.py::test_rl_demo|test_reward_model_env\.py::test_loop|test_experiments\.py|"
     r"test_error_output\.py|test_preference_training\.py::test_reward_model_resumes|test_node_faults\.py"),
    ("multi-rank launches (torchrun / rank pool)",
     r"test_(hf|lora|ppo|preference)_equivalence\.py|test_export\.py::test_(peft|roundtrip|save)|"
     r"test_fp8\.py::test_fp8_layouts|test_fp8_te\.py::test_te_spec_with_stand_in_te_at_tp2|"
     r"test_memory_plan\.py::test_predicted_peak|test_mixed_adapters\.py::test_mixed_adapters_at|"
     r"test_packing\.py::test_packed_equals|test_placement\.py::test_engines_started|"
     r"test_reward_model_env\.py::test_reward_scores|test_smollm2\.py::test_logits_equal_transformers_(tp3|pp2)|"
     r"test_vocab_parallel\.py|test_weight_sync_tensors\.py::test_ranks_fill|test_convert_checkpoint\.py::"
     r"test_tp2pp2|test_rank_pool\.py"),
    ("vLLM engine start-ups (engines, vllm_check, server)",
     r"test_vllm_engine\.py|test_vllm_multi_lora\.py|test_export\.py::test_vllm|test_import_adapter\.py::test_vllm|"
     r"test_serve\.py|test_weight_sync_tensors\.py::test_engine"),
    ("model conversions and loads (SmolLM2, checkpoints, merges)",
     r"test_smollm2\.py|test_convert_checkpoint\.py|test_merge_cli\.py|test_import_adapter\.py|"
     r"test_mixed_precision\.py|test_multi_turn\.py"),
    ("plain unit tests", r".*"),
)
LINE = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(tests/\S+)")
DEFAULT_STARTUP_TESTS = ("tests/test_hf_equivalence.py", "tests/test_ppo_equivalence.py",
                         "tests/test_async_training.py::test_one_step_off_policy_learns")


def kind_of(test: str) -> str:
    return next(kind for kind, pattern in KINDS if re.search(pattern, test))


def _phases(path: Path) -> list[tuple[str, float]]:
    """(``file::test``, seconds) of every phase line of a ``--durations=0`` output, or of every test case of
    a JUnit XML report (``--junitxml``: setup, call and teardown together)."""
    if path.suffix == ".xml":
        import xml.etree.ElementTree as ET

        out = []
        for case in ET.parse(path).getroot().iter("testcase"):
            module = case.get("classname", "").split(".")
            file = "/".join(module[: next(i for i, m in enumerate(module) if m.startswith("test_")) + 1])
            out.append((f"{file}.py::{case.get('name')}", float(case.get("time", 0))))
        return out
    return [(m.group(3), float(m.group(1))) for m in map(LINE.match, path.read_text().splitlines()) if m]


def by_kind(path: Path) -> tuple[dict[str, list], float, str]:
    """kind -> [tests, seconds] of one ``--durations=0`` output or JUnit XML report; its total seconds and
    its closing line."""
    text = path.read_text()
    tests: dict[str, set] = defaultdict(set)
    seconds: dict[str, float] = defaultdict(float)
    for test, took in _phases(path):
        kind = kind_of(test)
        tests[kind].add(test)
        seconds[kind] += took
    if path.suffix == ".xml":
        import xml.etree.ElementTree as ET

        suite = next(ET.parse(path).getroot().iter("testsuite"))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        text = f"{int(suite.get('tests', 0)) - failed - int(suite.get('skipped', 0))} passed, {failed} failed"
    closing = next((line for line in reversed(text.splitlines()) if re.search(r"\d+ passed", line)), "")
    out = {k: [len(tests[k]), seconds[k]] for k, _ in KINDS}
    ran = sum(int(n) for n in re.findall(r"(\d+) (?:passed|failed)", closing))
    out[KINDS[-1][0]][0] += max(0, ran - sum(v[0] for v in out.values()))  # lines under --durations-min: plain
    return out, sum(seconds.values()), closing


def table(outputs: list[str]) -> None:
    """``outputs``: ``FILE`` or ``FILE=LABEL`` (the column's name)."""
    paths = [Path(o.split("=", 1)[0]) for o in outputs]
    labels = [o.split("=", 1)[1] if "=" in o else Path(o).name for o in outputs]
    runs = [by_kind(p) for p in paths]
    head = " | ".join(f"{label}: tests | min" for label in labels)
    print(f"| cost kind | {head} |\n|---|" + "---|" * (2 * len(paths)))
    for kind, _ in KINDS:
        cells = " | ".join(f"{r[0][kind][0]} | {r[0][kind][1] / 60:.1f}" for r in runs)
        print(f"| {kind} | {cells} |")
    cells = " | ".join(f"{sum(v[0] for v in r[0].values())} | {r[1] / 60:.1f}" for r in runs)
    print(f"| all (durations summed) | {cells} |")
    for label, r in zip(labels, runs):
        print(f"{label}: {r[2].strip('= ')}")


def startups(tests: list[str], rounds: int) -> None:
    from lora_overhead import machine

    print(machine())
    times: dict[str, list[float]] = {"rank pool": [], "torchrun": []}
    for r in range(rounds):
        for arm in (("rank pool", "torchrun") if r % 2 == 0 else ("torchrun", "rank pool")):
            env = {**os.environ, "MLORA_TEST_TORCHRUN": "1" if arm == "torchrun" else "0"}
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                                  cwd=ROOT, env=env, capture_output=True, text=True)
            took = time.perf_counter() - t
            if proc.returncode != 0:
                sys.exit(f"{arm}: pytest failed:\n{proc.stdout[-3000:]}")
            times[arm].append(took)
            print(f"round {r + 1} {arm:9s}: {took:6.1f} s  ({proc.stdout.strip().splitlines()[-1]})", flush=True)
    pool, torchrun = (statistics.median(times[a]) for a in ("rank pool", "torchrun"))
    print(f"median: rank pool {pool:.1f} s, torchrun {torchrun:.1f} s; rank pool / torchrun = {pool / torchrun:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("outputs", nargs="+", help="FILE or FILE=LABEL")
    s = sub.add_parser("startups")
    s.add_argument("tests", nargs="*", default=list(DEFAULT_STARTUP_TESTS))
    s.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.cmd == "table":
        table(args.outputs)
    else:
        startups(args.tests, args.rounds)


if __name__ == "__main__":
    import records  # the run becomes a record of bench/records.jsonl

    records.main(main, group="Test suite")
