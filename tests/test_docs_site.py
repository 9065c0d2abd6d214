"""The docs site builds in strict mode (a broken link, a missing page or anchor, a griffe warning of the API
reference fail it), and its generated pages hold what they are generated from: every configuration key, every
command line, every performance record."""

from __future__ import annotations

import re

import pytest
from docs_build import ROOT, built_site, load


@pytest.fixture(scope="module")
def site():
    build = built_site()
    print(f"mkdocs build --strict: {build.seconds} s -> {build.site}")
    assert build.returncode == 0, build.log[-6000:]
    return build.site


def _page(site, path: str) -> str:
    return (site / path / "index.html").read_text()


def test_strict_build_and_generated_pages(site):
    config = _page(site, "reference/configuration")
    keys = re.findall(r'<h3 id="([a-z_.]+)"', config)  # one heading per key (every key: test_docs_reference.py)
    assert len(keys) > 240 and "trainer.policy.model.lora.rank" in keys and "generator.sampling_params.top_p" in keys
    assert 'id="skyrl-absent"' in config  # SkyRL's keys mlora refuses, with why

    cli = _page(site, "reference/cli")
    for text in ("python tools/convert_checkpoint.py hf-to-mcore", "--make-vocab-size-divisible-by",
                 "python tools/import_adapter.py", "mlora export-adapter", "python -m mlora.service",
                 "--max-resident-clients", "smollm2_arithmetic"):
        assert text in cli, text

    api = _page(site, "reference/api")
    for name in ("mlora.MLoraModel", "mlora.init_parallel", "mlora.LoraConfig", "merge_adapter", "stack_adapters"):
        assert name in api, name

    records = load("bench/records.py")
    performance = _page(site, "performance")
    missing = [r["id"] for r in records.load() if f'record <code>{r["id"]}</code>' not in performance]
    assert not missing, missing


def test_readme_figures_are_records():
    """The README's headline figures (``**1.17×**``) are typed once, in ``bench/records.jsonl``: each is a headline
    figure of a record (the performance page's), not a second copy that could drift."""
    records = load("bench/records.py")
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    figures = [f for f in re.findall(r"\*\*(.+?)\*\*", section) if re.fullmatch(r"\d+(\.\d+)?×", f)]
    known = [f for r in records.load() for f in records.headline(r)]  # e.g. "6.04 GiB = 1.08×"
    missing = [f for f in figures if not any(k == f or k.endswith(" " + f) for k in known)]
    assert figures and not missing, (missing, known)
