"""Every key of SkyRL's own configuration (skyrl 0.3.0's ``SkyRLTrainConfig``, walked from its dataclasses) is
either mlora's (a schema key, or below one of mlora's dict fields) or refused by name with a reason
(:mod:`mlora.config.skyrl_absent`): none reaches Hydra's generic "Key ... not in ..." error. Through the real
entry point, such a key stops the run before anything loads, with exit 2 and the reason."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from skyrl_oracle import config_keys

pytestmark = pytest.mark.quick


def test_every_skyrl_key_is_mloras_or_refused_by_name():
    from mlora.config.skyrl_absent import ABSENT, absent_reason, schema_keys

    leaves, dicts = schema_keys()
    keys = config_keys()
    assert len(keys) > 300  # SkyRL's whole configuration, not a part of it
    mine = {k for k in keys if k in leaves or any(k.startswith(d + ".") for d in dicts)}
    refused = {k: absent_reason(k) for k in keys if k not in mine}
    assert all(refused.values()), sorted(k for k, why in refused.items() if not why)
    # every entry is needed: it names some SkyRL key mlora lacks, and none of mlora's own
    for prefix in ABSENT:
        assert any(k == prefix or k.startswith(prefix + ".") for k in refused), f"{prefix}: no SkyRL key it refuses"
    assert not any(absent_reason(k) for k in leaves)
    print(f"{len(keys)} SkyRL keys: {len(mine)} mlora's, {len(refused)} refused by name")


def test_a_skyrl_key_mlora_lacks_stops_the_run_naming_it(tmp_path):
    from mlora.config.errors import ConfigError
    from mlora.config.skyrl_absent import check_overrides

    with pytest.raises(ConfigError, match=r"trainer.tags=\[a\]: a SkyRL key mlora does not have: mlora's trackers"):
        check_overrides(["trainer.tags=[a]"])
    with pytest.raises(ConfigError, match="generator.inference_engine.max_num_seqs=64: .*engine_init_kwargs.max_num_seqs"):
        check_overrides(["++generator.inference_engine.max_num_seqs=64"])
    check_overrides(["generator.engine_init_kwargs.max_num_seqs=64", "+environment.skyrl_gym.search.topk=3",
                     "trainer.ref.megatron_config.tensor_model_parallel_size=2"])  # mlora's own keys pass
    proc = subprocess.run([sys.executable, "-m", "mlora.train", "--config-name", "cpu_demo",
                           f"trainer.run_dir={tmp_path}", "trainer.fully_async.simulate_training=true"],
                          capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "trainer.fully_async.simulate_training=true: a SkyRL key mlora does not have: SkyRL's simulated-trainer" \
        in proc.stdout + proc.stderr
