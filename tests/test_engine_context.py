"""The engines' max_model_len follows the run's lengths (prompt + longest response, capped by the model's
own context; an explicit generator.engine_init_kwargs.max_model_len wins), for local and Ray engines
and the printed serve command. The started engine's value is checked in test_vllm_engine.py."""

from __future__ import annotations

import json
import sys

import pytest

from mlora.rollout.model_len import model_context_limit, read_context_limit, run_max_model_len

pytestmark = pytest.mark.quick


def test_run_max_model_len():
    assert run_max_model_len(512, [256, 256], 8192) == 768  # SmolLM2: 768, not its own 8,192
    assert run_max_model_len(512, [256, 1024], 8192) == 1536  # eval may generate longer than training
    assert run_max_model_len(200, [100, None], 256) == 256  # capped by the model (None: not given)
    assert run_max_model_len(100, [28], None) == 128  # a config without a limit: no cap
    with pytest.raises(ValueError, match="max_prompt_length=0 must be >= 1"):
        run_max_model_len(0, [8], None)
    with pytest.raises(ValueError, match=r"max_generate_length values \[0\]"):
        run_max_model_len(8, [0], None)


def test_model_context_limit(tmp_path):
    assert model_context_limit({"max_position_embeddings": 8192}) == 8192
    assert model_context_limit({"n_positions": 1024, "max_position_embeddings": 2048}) == 1024  # smallest, as vLLM
    assert model_context_limit({"text_config": {"max_position_embeddings": 4096}}) == 4096
    assert model_context_limit({"hidden_size": 64}) is None
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 300}))
    assert read_context_limit(tmp_path) == 300
    assert read_context_limit(tmp_path / "none") is None


def _cfg(model_dir, **generator):
    from mlora.config.schema import TrainConfig
    from mlora.config.validate import finalize

    cfg = TrainConfig()
    cfg.trainer.policy.model.path = str(model_dir)
    cfg.trainer.max_prompt_length = 40
    cfg.generator.sampling_params.max_generate_length = 16
    cfg.generator.eval_sampling_params.max_generate_length = 24
    for key, value in generator.items():
        setattr(cfg.generator, key, value)
    finalize(cfg, 1, cuda=False)
    return cfg


def test_engine_options_carry_the_derived_max_model_len(tmp_path, monkeypatch):
    """What Rollouts hands build_engines (local and Ray engines alike), and what the serve command gets."""
    from mlora.rollout import serve
    from mlora.train.rollouts import engine_max_model_len, engine_options

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    cfg = _cfg(tmp_path)
    options = engine_options(cfg, tmp_path, cuda=False)
    assert options["max_model_len"] == 40 + 24  # the eval responses are the longer ones
    cfg.generator.inference_engine.run_engines_locally = False  # Ray: the same engine arguments
    assert engine_options(cfg, tmp_path, cuda=False)["max_model_len"] == 64

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 50}))
    assert engine_options(cfg, tmp_path, cuda=False)["max_model_len"] == 50  # the model's own limit caps it

    explicit = _cfg(tmp_path, engine_init_kwargs={"max_model_len": 1024})
    assert engine_options(explicit, tmp_path, cuda=False)["max_model_len"] == 1024  # the user's value wins
    assert engine_max_model_len(explicit, tmp_path) == 1024

    monkeypatch.setattr(serve, "_vllm_distribution", lambda: None)
    argv = serve.serve_command(tmp_path, {"policy": tmp_path / "a"}, 8,
                               max_model_len=engine_max_model_len(cfg, tmp_path))
    assert argv[argv.index("--max-model-len") + 1] == "50"
    assert argv[:3] == [sys.executable, "-m", serve.API_SERVER_MODULE]
    assert "--max-model-len" not in serve.serve_command(tmp_path, {"policy": tmp_path / "a"}, 8)
    with pytest.raises(ValueError, match="max_model_len=0 must be >= 1"):
        serve.serve_command(tmp_path, {"policy": tmp_path / "a"}, 8, max_model_len=0)
