"""Tinker's REST API served by mlora, driven by the real ``tinker`` SDK 0.38's ``RestClient`` and tinker-cookbook
0.6.1's ``weights.download``, unchanged, on a tiny random Llama in float32 (a server without a sampling engine).

- Training runs, checkpoints (per run and per user, paginated), weights info and sessions answer what the client
  made: ranks, types, sizes, the newest checkpoint of each kind.
- Owners: another API key sees none of it (each route says "not found") until the owner publishes a checkpoint;
  then that key reads the checkpoint's weights info and training run (``access_scope="accessible"``) and trains from
  it, but cannot delete, re-time or unpublish it. Unpublished, it is private again.
- TTL: set, listed as ``expires_at``, out-of-range values refused naming the range; the reaper deletes a checkpoint
  whose TTL ran out (files and row).
- Download: the cookbook's ``weights.download`` of a training checkpoint (a training client from it, an
  age-encrypted ``save_weights_external`` export, signed URLs, decryption, the export deleted) leaves PEFT files that
  equal the server's own sampler export and that PEFT loads: its log-probs equal the trainer's ``forward`` (≤ 1e-5).
  A forged or stale signed URL is refused.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from tinker_server import Server

tinker = pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")
from tinker import types  # noqa: E402

KEY, OTHER = "tml-mlora-rest-owner", "tml-mlora-rest-other"
LOGPROB_TOL = 1e-5  # PEFT on the downloaded files vs the server's forward, float32 (measured: see the test)
ADAM = dict(learning_rate=5e-2, beta1=0.9, beta2=0.95, eps=1e-8)


@pytest.fixture(scope="module")
def base(tiny_llama) -> Path:
    return tiny_llama


@pytest.fixture(scope="module")
def server(base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rest_server")
    s = Server(base, tmp / "data", tmp / "server.log", ["--no-sampling"])
    clients: list = []
    s.clients = clients
    yield s
    for c in clients:
        c.close("success").result()
    s.stop()


def _service(server: Server, key: str):
    client = tinker.ServiceClient(base_url=server.url, api_key=key)
    server.clients.append(client)
    return client


def _datum(seed: int, n: int = 9) -> types.Datum:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (n + 1,), generator=g)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                       loss_fn_inputs={"target_tokens": tokens[1:].tolist(), "weights": [1.0] * n})


@pytest.fixture(scope="module")
def trained(server, base):
    """A rank-4 client (attention, MLP and lm_head) after one step: its session, training and sampler checkpoints."""
    service = _service(server, KEY)
    trainer = service.create_lora_training_client(base_model=str(base), rank=4, seed=3,
                                                  user_metadata={"purpose": "rest"}).result()
    trainer.forward_backward([_datum(1), _datum(2)], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(**ADAM)).result()
    state = trainer.save_state("s1").result().path
    sampler = trainer.save_weights_for_sampler("smp").result().path
    return trainer, state, sampler


def test_runs_checkpoints_sessions_and_weights_info(server, trained):
    trainer, state, sampler = trained
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    model_id = trainer.model_id
    runs = rest.list_training_runs(limit=50).result()
    assert model_id in [r.training_run_id for r in runs.training_runs] and runs.cursor.total_count >= 1
    run = rest.get_training_run_by_tinker_path(state).result()
    assert (run.training_run_id, run.lora_rank, run.is_lora, run.user_metadata) == (model_id, 4, True,
                                                                                     {"purpose": "rest"})
    assert run.last_checkpoint.tinker_path == state and run.last_sampler_checkpoint.tinker_path == sampler
    listed = {c.tinker_path: c for c in rest.list_checkpoints(model_id).result().checkpoints}
    assert listed[state].checkpoint_type == "training" and listed[state].checkpoint_id == "weights/s1"
    assert listed[sampler].checkpoint_type == "sampler" and listed[sampler].size_bytes > 0
    assert listed[state].size_bytes > listed[sampler].size_bytes  # the AdamW moments too
    page = rest.list_user_checkpoints(limit=1).result()
    assert len(page.checkpoints) == 1 and page.cursor.total_count >= 2
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.lora_rank, info.train_attn, info.train_mlp, info.train_unembed) == (4, True, True, True)
    session_id = model_id.split(":")[0]
    assert session_id in rest.list_sessions().result().sessions
    assert model_id in rest.get_session(session_id).result().training_run_ids
    admin = tinker.AdminClient(base_url=server.url, api_key=KEY)
    usage = admin.get_current_checkpoint_storage_usage().result().data[0]
    assert usage.checkpoint_count == page.cursor.total_count and usage.size_bytes >= sum(
        c.size_bytes for c in listed.values())
    with pytest.raises(tinker.BadRequestError, match="this server has no projects"):
        rest.list_training_runs(project_id="p1").result()


def test_owners_publish_and_unpublish(server, base, trained):
    trainer, state, _ = trained
    mine, other = (tinker.RestClient(base_url=server.url, api_key=k) for k in (KEY, OTHER))
    model_id = trainer.model_id
    for call in (lambda: other.get_training_run(model_id), lambda: other.list_checkpoints(model_id),
                 lambda: other.get_weights_info_by_tinker_path(state),
                 lambda: other.delete_checkpoint_from_tinker_path(state),
                 lambda: other.publish_checkpoint_from_tinker_path(state),
                 lambda: other.get_session(model_id.split(":")[0])):
        with pytest.raises(tinker.NotFoundError, match="not found"):
            call().result()
    assert model_id not in [r.training_run_id for r in other.list_training_runs().result().training_runs]
    with pytest.raises(Exception, match="not found"):
        _service(server, OTHER).create_training_client_from_state(state).result()

    mine.publish_checkpoint_from_tinker_path(state).result()
    assert {c.tinker_path: c.public for c in mine.list_checkpoints(model_id).result().checkpoints}[state]
    assert other.get_weights_info_by_tinker_path(state).result().lora_rank == 4
    assert other.get_training_run(model_id, access_scope="accessible").result().training_run_id == model_id
    with pytest.raises(tinker.NotFoundError):
        other.get_training_run(model_id).result()  # owned only
    theirs = _service(server, OTHER).create_training_client_from_state(state).result()
    datum = _datum(5)
    want = trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    got = theirs.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert torch.equal(want, got)  # the same weights, in the other owner's own client
    for call in (lambda: other.delete_checkpoint_from_tinker_path(state),
                 lambda: other.set_checkpoint_ttl_from_tinker_path(state, 7200),
                 lambda: other.unpublish_checkpoint_from_tinker_path(state)):
        with pytest.raises(tinker.NotFoundError):
            call().result()
    mine.unpublish_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(state).result()


def test_ttl_set_listed_refused_and_reaped(server, trained, tmp_path):
    trainer, _, _ = trained
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    path = trainer.save_weights_for_sampler("ttl").result().path
    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    expires = {c.tinker_path: c.expires_at for c in rest.list_checkpoints(trainer.model_id).result().checkpoints}[path]
    assert abs(expires.timestamp() - (time.time() + 7200)) < 120
    with pytest.raises(tinker.BadRequestError, match=r"ttl_seconds=10 must be an integer from 3600 \(1 hour\)"):
        rest.set_checkpoint_ttl_from_tinker_path(path, 10).result()
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert {c.tinker_path: c.expires_at for c in rest.list_checkpoints(trainer.model_id).result().checkpoints}[path] \
        is None

    # the reaper's expiry, on a store of its own: a checkpoint past its TTL goes, files and row
    from mlora.service.rest import Rest
    from mlora.service.store import Store

    store = Store(tmp_path / "s.sqlite")
    directory = tmp_path / "ck"
    (directory / "adapter").mkdir(parents=True)
    (directory / "adapter" / "f").write_text("x")
    store.add_checkpoint("tinker://m/weights/a", "m", "o", "weights", "a", str(directory), {"rank": 1},
                         expires=time.time() + 5)
    rest_state = Rest(store, tmp_path)
    assert rest_state.expire(time.time()) == []
    assert rest_state.expire(time.time() + 10) == ["tinker://m/weights/a"]
    assert store.checkpoint("tinker://m/weights/a") is None and not directory.exists()


def test_cookbook_download_is_the_peft_adapter(server, base, trained, tmp_path, monkeypatch):
    import httpx
    import safetensors.torch
    import transformers
    from peft import PeftModel
    from tinker_cookbook import weights

    trainer, state, sampler = trained
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    out = Path(weights.download(tinker_path=state, output_dir=str(tmp_path / "adapter"), base_url=server.url))
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    served = Path(server.data_dir) / "checkpoints" / trainer.model_id / "sampler_weights" / "smp" / "adapter"
    got = safetensors.torch.load_file(out / "adapter_model.safetensors")
    want = safetensors.torch.load_file(served / "adapter_model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    # the download's temporary export is gone (the cookbook deletes it)
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    kinds = [c.checkpoint_type for c in rest.list_checkpoints(trainer.model_id).result().checkpoints]
    assert "external" not in kinds

    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, out).eval()
    datum = _datum(9)
    ids = torch.tensor(datum.model_input.to_ints())
    target = datum.loss_fn_inputs["target_tokens"].to_torch()
    with torch.no_grad():
        ref = torch.log_softmax(peft_model(ids[None]).logits[0].float(), -1).gather(-1, target[:, None])[:, 0]
    logp = trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    diff = float((logp - ref).abs().max())
    print(f"\nPEFT on the downloaded adapter vs the server's forward: {diff:.2e}")
    assert diff <= LOGPROB_TOL

    # an unencrypted export: its signed URLs, a forged one, and one of a deleted export
    export = trainer.save_weights_external("plain", ttl_seconds=3600).result().path
    urls = rest.get_external_weights_urls(export).result().urls
    assert sorted(urls) == ["adapter_config.json", "adapter_model.safetensors"]
    assert httpx.get(urls["adapter_config.json"]).json()["r"] == 4
    claim, _, mac = urls["adapter_config.json"].rpartition("/")[2].partition(".")
    forged = urls["adapter_config.json"].replace(mac, "0" * len(mac))
    assert httpx.get(forged).status_code == 403
    with pytest.raises(tinker.BadRequestError, match="age recipient 'nope' is neither"):
        trainer.save_weights_external("bad", age_encryption_recipients=["nope"]).result()
    rest.delete_checkpoint_from_tinker_path(export).result()
    assert httpx.get(urls["adapter_config.json"]).status_code == 404
