"""The table of the Tinker SDK's surface in docs/tinker.md is complete and current: every public method of the SDK's
ServiceClient, TrainingClient, SamplingClient and RestClient (the installed tinker, walked here) has a row in
:data:`mlora.service.surface.SURFACE` (served / partial / not served, and why), no row names a method the SDK no
longer has, and docs/tinker.md holds exactly the table :func:`mlora.service.surface.markdown` prints."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick
ROOT = Path(__file__).resolve().parents[1]


def _sdk_methods() -> set[str]:
    from tinker.lib.public_interfaces import rest_client, sampling_client, service_client, training_client

    out = set()
    for module, name in ((service_client, "ServiceClient"), (training_client, "TrainingClient"),
                         (sampling_client, "SamplingClient"), (rest_client, "RestClient")):
        cls = getattr(module, name)
        out |= {f"{name}.{m}" for m, v in inspect.getmembers(cls)
                if not m.startswith("_") and callable(v) and not m.endswith("_async")}
    return out


def test_every_sdk_method_has_a_row_and_the_docs_show_the_table():
    from mlora.service.surface import NOT_SERVED, PARTIAL, SERVED, SURFACE, markdown

    sdk = _sdk_methods()
    assert sorted(sdk - set(SURFACE)) == [], "SDK methods without a row in mlora/service/surface.py"
    assert sorted(set(SURFACE) - sdk) == [], "rows for methods the SDK does not have"
    assert all(status in (SERVED, PARTIAL, NOT_SERVED) and note for status, note in SURFACE.values())
    assert markdown() in (ROOT / "docs" / "tinker.md").read_text(), \
        "docs/tinker.md's table differs from what python -m mlora.service.surface prints"
