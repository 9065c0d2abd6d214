"""The generated references of the docs site have something to say about everything: every configuration key a
description (a comment beside it in ``mlora/config/schema.py``) and SkyRL's name for it, checked against SkyRL's
own configuration; every command line and argument a help text; every performance record its fields, and every
bench script records its runs. Pure: no site build (``test_docs_site.py`` builds it)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from docs_build import load

ROOT = Path(__file__).resolve().parents[1]
records = load("bench/records.py")
cli_reference = load("docs/cli_reference.py")


def test_every_config_key_has_a_description_type_and_default():
    from mlora.config.reference import config_rows, render_markdown

    rows, sections = config_rows()
    assert len(rows) > 240  # the whole schema, nested sections included
    undescribed = [r.key for r in rows if not r.description]
    assert not undescribed, f"keys with no comment in mlora/config/schema.py: {undescribed}"
    by_key = {r.key: r for r in rows}
    rank = by_key["trainer.policy.model.lora.rank"]
    assert (rank.type, rank.default, rank.skyrl) == ("int", "32", "same key")
    assert by_key["trainer.policy.model.path"].default == "(required)"
    assert by_key["trainer.critic.optimizer_config.lr"].default == "5e-06"  # the section's own default_factory
    assert by_key["generator.eval_sampling_params.temperature"].default == "0.0"
    assert by_key["trainer.dtype"].type == "str | null" and by_key["trainer.dtype"].mlora_only
    assert by_key["preference.beta"].mlora_only  # the section's docstring marks it mlora's
    assert "inference_engine.num_engines" in by_key["generator.num_inference_engines"].skyrl
    page = "\n".join(render_markdown(rows, sections, {"trainer.tags": "no tags | here"}))
    assert all(f"### {r.key} {{#{r.key}}}" in page for r in rows)  # a heading of its own: search and links find it
    assert "no tags &#124; here" in page and "<run_dir>" not in page


def test_comment_parsing():
    from mlora.config.reference import field_comments

    source = '''
from dataclasses import dataclass

@dataclass
class S:
    """doc"""

    # above
    # two lines
    a: int = 1  # trailing
    b: int = 2

    c: list = field(
        default_factory=list)  # end of a statement of two lines
'''
    fields, docs = field_comments(source)
    assert fields["S"] == {"a": "above two lines trailing", "b": "", "c": "end of a statement of two lines"}
    assert docs["S"] == "doc"


def test_skyrl_names_agree_with_skyrl():
    """A key the reference calls mlora's own is not in SkyRL 0.3.0's configuration; one it calls SkyRL's is there,
    or is an older SkyRL name, or says where SkyRL has it (a newer SkyRL, an example's config)."""
    from skyrl_oracle import config_keys

    from mlora.config.reference import SKYRL_OLD_NAMES, config_rows

    skyrl = config_keys()
    rows, _ = config_rows()
    mine = {r.key for r in rows}
    wrongly_mine = [r.key for r in rows if r.mlora_only and r.key in skyrl]
    assert not wrongly_mine, f"in SkyRL's configuration, but described as mlora's own ('mlora...'): {wrongly_mine}"
    unexplained = [r.key for r in rows if not r.mlora_only and r.key not in skyrl and r.key not in SKYRL_OLD_NAMES
                   and not any(k.startswith(r.key + ".") for k in skyrl) and "SkyRL" not in r.description]
    assert not unexplained, f"not SkyRL 0.3.0's keys: start their comment with 'mlora' or say where SkyRL has them: " \
                            f"{unexplained}"
    for old, new in SKYRL_OLD_NAMES.items():
        assert old in mine and new in mine, (old, new)


@pytest.mark.parametrize("old", ["generator.num_inference_engines", "generator.inference_engine_tensor_parallel_size",
                                 "generator.run_engines_locally", "generator.gpu_memory_utilization",
                                 "trainer.use_sample_packing"])
def test_old_skyrl_names_are_merged_by_validate(old):
    """What the reference says (one value under two names) is what the config's validation does."""
    from mlora.config import validate
    from mlora.config.reference import SKYRL_OLD_NAMES
    from mlora.config.schema import TrainConfig

    values = {"generator.num_inference_engines": 3, "generator.inference_engine_tensor_parallel_size": 2,
              "generator.run_engines_locally": False, "generator.gpu_memory_utilization": 0.5,
              "trainer.use_sample_packing": True}
    cfg = TrainConfig()
    *path, name = SKYRL_OLD_NAMES[old].split(".")
    section = cfg
    for part in path:
        section = getattr(section, part)
    setattr(section, name, values[old])
    if old.startswith("generator."):
        validate._resolve_generator(cfg)
    else:
        validate._check_packing(cfg.trainer, False)
    got = cfg
    for part in old.split("."):
        got = getattr(got, part)
    assert got == values[old]


def test_every_command_and_argument_has_help():
    commands, config_names = cli_reference.commands, cli_reference.config_names

    cmds = commands()
    names = {c.name for c in cmds}
    tools = {f"python tools/{p.name}" for p in (ROOT / "tools").glob("*.py")}
    assert {"mlora", "mlora plan", "mlora merge", "mlora export-adapter", "python -m mlora.service",
            "python tools/convert_checkpoint.py hf-to-mcore"} | tools <= names
    no_help = [c.name for c in cmds if not c.summary]
    assert not no_help, f"commands with no description or help: {no_help}"
    bad = [f"{c.name} {a.flags}" for c in cmds for a in c.arguments if not a.help.strip()]
    assert not bad, f"arguments with no help text: {bad}"
    wrappers = {c.name: c.same_as for c in cmds if c.same_as}
    assert wrappers == {"python tools/export_adapter.py": "mlora export-adapter", "python tools/merge.py": "mlora merge",
                        "python tools/plan.py": "mlora plan"}
    configs = config_names()
    assert {"ppo", "cpu_demo", "sft", "rm", "dpo"} <= set(configs)
    assert all(configs.values()), [k for k, v in configs.items() if not v]


def test_performance_records():
    rs = records.load()
    records.check(rs)  # fields, ids of their own
    assert len(rs) >= 24
    for r in rs:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]), r["id"]
        assert r["machine"]["cpu"] and r["command"], r["id"]
    page = "\n".join(records.render_markdown(rs))
    assert all(f"{{#{r['id']}}}" in page for r in rs)


def test_every_bench_records_its_runs():
    missing = [p.name for p in (ROOT / "bench").glob("*.py")
               if p.name != "records.py" and "records.main(main" not in p.read_text()]
    assert not missing, f"bench scripts that do not append to bench/records.jsonl: {missing}"


def test_a_bench_run_becomes_a_record(tmp_path, monkeypatch, capsys):
    out = tmp_path / "records.jsonl"
    monkeypatch.setenv("MLORA_BENCH_RECORDS", str(out))
    monkeypatch.setattr(sys, "argv", ["bench/fake.py", "--reps", "2"])
    assert records.main(lambda: print("mixed / single 0.97x") or 7, group="LoRA compute", title="fake") == 7
    monkeypatch.setattr(sys, "argv", ["bench/fake.py", "--child"])  # a bench's own child process: no record
    records.main(lambda: print("child"), group="LoRA compute")
    (r,) = records.load(out)
    assert r["output"] == "mixed / single 0.97x" and r["command"] == ".venv/bin/python bench/fake.py --reps 2"
    assert r["group"] == "LoRA compute" and r["machine"]["cores"] and r["commit"] and r["id"].startswith("fake-")
    assert "recorded as fake-" in capsys.readouterr().out


def test_a_page_cites_a_record_by_id():
    """``<!-- mlora:record ID -->`` in a docs page becomes the record's figures, linked to the performance page."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location("_docs_hooks", ROOT / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = SimpleNamespace(file=SimpleNamespace(src_uri="reference/x.md", src_path="reference/x.md"))
    text = hooks.on_page_markdown("4 clients: <!-- mlora:record tinker-clients-4-2026-12-04 -->.", page, None, None)
    assert text.startswith("4 clients: **0.89×**, **1.18×** — [4 RL clients on one base")
    assert "](../performance.md#tinker-clients-4-2026-12-04) (2026-12-04, AMD EPYC" in text
    with pytest.raises(ValueError, match="no record 'nope'"):
        hooks.on_page_markdown("<!-- mlora:record nope -->", page, None, None)
