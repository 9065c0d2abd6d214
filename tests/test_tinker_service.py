"""The Tinker API served by mlora (``python -m mlora.service``), driven by the real ``tinker`` SDK 0.38, unchanged,
over HTTP on 127.0.0.1, on a tiny random Llama in float32.

- ``forward_backward(cross_entropy)``: the learner log-probs the SDK gets back equal transformers' and mlora's own
  (≤ 1e-5), and ``loss:sum`` is ``-Σ w·logp``.
- ``optim_step``: two steps (weight decay, gradient clipping) leave the adapter where torch's AdamW takes the same
  adapter on the same gradients in-process (≤ 2e-5 of the largest factor).
- (N, K) targets (top-K distillation): log-probs [N, K] equal transformers'; the update equals the K columns sent
  as K requests. ``gspo`` and ``dro``: ``loss:sum`` is their documented formula.
- Two clients of different ranks (4 and 8) interleave pipelined calls, so their ``forward_backward`` requests run
  as one mixed-adapter batch (the server says so in its log); each ends where it ends alone (≤ 1e-5).
- ``save_state`` → server restart → ``create_training_client_from_state_with_optimizer`` continues exactly.
- Sampling (the server's vLLM engine, each client's sampler weights a LoRA adapter of it): the log-probs of sampled
  and prompt tokens equal the trainer's ``forward`` of the same tokens (≤ 1e-4); two clients' samplers asked at
  once run in one batch and sample what each samples alone (same seeds, same tokens); a short request sent while a
  long one decodes joins it and is answered first (continuous batching). ``target_prompt_logprobs`` (dense, sparse
  CSR) are transformers' log-probs of the ids named, also on a prompt the prefix cache holds; ``prompt_alt_tokens``
  are drawn from the distribution at the request's temperature, seeded, with the model's log-probs.
- Bad requests fail that request's future with the SDK's user error and the client goes on; another API key sees
  none of a client's models or checkpoints; a session without heartbeats has its models freed.
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import torch
from tinker_server import Server

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

LOGPROB_TOL = 1e-5  # float32 log-probs, server vs transformers / mlora (measured: ≤ 1e-6)
# adapter after optim_step vs torch AdamW, relative to the largest factor (measured: 5.3e-6): the gradients agree to
# float32 rounding across the two processes, and Adam's early steps scale a difference in g by about lr / eps
ADAM_TOL = 2e-5
MIX_TOL = 1e-5  # a client in mixed batches vs alone, relative (measured: ≤ 1e-6)
KEY = "tml-mlora-test-a"
SAMPLE_TOL = 1e-4  # vLLM's log-probs of sampled / prompt tokens vs the trainer's, float32 (measured: ≤ 1e-6)
MAX_LORA_RANK = 16  # the server's sampling limit (--max-lora-rank)
# eps well above the gradients' float32 noise: with 1e-8, Adam's first steps divide gradients of a LoRA factor near zero
# by their own magnitude, and the last bits of a sum taken in another order move such an element by up to lr
ADAM = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-4, weight_decay=0.01, grad_clip_norm=5.0)
# TP2 x PP2 vs one process: the gradients differ by float32 rounding (sums in another order); an eps above the gradients
# keeps Adam from scaling that by lr / eps, so the adapters compare at float32 precision (measured: see the test)
MESH_ADAM = {**ADAM, "eps": 1e-1, "learning_rate": 1e-1}
MESH_TOL = 1e-5  # relative to the largest factor
MESH_LOGPROB_TOL = 5e-5  # log-probs near -7 after the two steps, sums in another order (measured: 1.2e-5, 2e-6 relative)


@pytest.fixture(scope="module")
def base(tiny_llama) -> Path:
    return tiny_llama


@pytest.fixture(scope="module")
def server(base, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tinker_server")
    s = Server(base, tmp / "data", tmp / "server.log", ["--batch-window", "0.2", "--kv-cache-bytes", str(64 << 20),
                                                         "--max-lora-rank", str(MAX_LORA_RANK)])
    yield s
    for client in _CLIENTS:  # their sessions finish and their heartbeat threads stop before the server goes
        client.close("success").result()
    _CLIENTS.clear()
    s.stop()


_CLIENTS: list = []


def _service(server: Server, key: str = KEY):
    client = tinker.ServiceClient(base_url=server.url, api_key=key)
    _CLIENTS.append(client)
    return client


def _trainer(service, base: Path, rank: int, seed: int):
    return service.create_lora_training_client(base_model=str(base), rank=rank, seed=seed,
                                               train_unembed=False).result()


def _batch(seed: int, lengths=(7, 12, 5), vocab: int = 1000) -> list:
    """Datums of random tokens, each predicting its next token with random weights."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        tokens = torch.randint(0, vocab, (n + 1,), generator=g)
        weights = torch.rand(n, generator=g)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": tokens[1:].tolist(), "weights": weights.tolist()}))
    return out


def _tokens(datum) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.tensor(datum.model_input.to_ints())
    target = datum.loss_fn_inputs["target_tokens"].to_torch()
    weights = datum.loss_fn_inputs["weights"].to_torch()
    return ids, target, weights


def test_cross_entropy_logprobs_equal_transformers_and_mlora(server, base):
    import transformers

    import mlora

    trainer = _trainer(_service(server), base, 4, 1)
    data = _batch(0)
    out = trainer.forward_backward(data, "cross_entropy").result()
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model = mlora.from_pretrained(base, mlora.init_parallel(), dtype=torch.float32)
    total = 0.0
    for datum, result in zip(data, out.loss_fn_outputs):
        ids, target, weights = _tokens(datum)
        got = result["logprobs"].to_torch()
        with torch.no_grad():
            ref = torch.log_softmax(hf(ids[None]).logits[0].float(), -1).gather(-1, target[:, None])[:, 0]
            own = torch.log_softmax(model.logits(ids[None])[0].float(), -1).gather(-1, target[:, None])[:, 0]
        assert got.shape == target.shape
        assert (got - ref).abs().max() <= LOGPROB_TOL and (got - own).abs().max() <= LOGPROB_TOL, (got, ref, own)
        total -= float((ref * weights).sum())
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)


def test_optim_step_equals_torch_adamw(server, base):
    trainer = _trainer(_service(server), base, 4, 7)
    steps = [_batch(10), _batch(11)]
    for data in steps:
        trainer.forward_backward(data, "cross_entropy").result()
        trainer.optim_step(types.AdamParams(**ADAM)).result()
    got = server.weights(trainer.save_weights_for_sampler("adam").result().path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server runs (OMP_NUM_THREADS=1): its GEMMs summed in the same order
    try:
        want = _torch_adamw_reference(base, steps)
    finally:
        torch.set_num_threads(threads)
    assert got.keys() == want.keys()
    scale = max(v.abs().max() for v in want.values())
    diff = max((got[k] - want[k]).abs().max() for k in want)
    assert scale > 0 and diff <= ADAM_TOL * scale, (diff, scale)


def _torch_adamw_reference(base: Path, steps: list) -> dict[str, torch.Tensor]:
    """The adapter after torch's AdamW (gradients clipped by torch) on each step's batch, computed in-process."""
    import mlora
    from mlora.models.packing import PackedRows
    from mlora.rl.vocab_parallel import vocab_parallel_logprobs
    from mlora.service.tenants import INIT_KEY, lora_config

    model = mlora.from_pretrained(base, mlora.init_parallel(), dtype=torch.float32)
    model.add_adapter("ref", lora_config(4, 7, True, True, False, "ref"), key=INIT_KEY)
    params = model.adapter_parameters("ref")
    opt = torch.optim.AdamW(params, lr=ADAM["learning_rate"], betas=(ADAM["beta1"], ADAM["beta2"]), eps=ADAM["eps"],
                            weight_decay=ADAM["weight_decay"])
    vocab = model.spec.vocab_size
    for data in steps:  # the batch as the server runs it: the rows packed back to back in one micro-batch
        rows = [_tokens(d) for d in data]
        lengths = tuple(len(ids) for ids, _, _ in rows)
        packed = PackedRows(lengths, max(lengths), sum(lengths))
        ids, target, weights = (torch.cat(parts)[None] for parts in zip(*rows))

        def loss_fn(logits, mb):  # the server's log-prob function: the same float32 sums, so the same gradients
            logp = vocab_parallel_logprobs(logits, target, 0, vocab)[0]
            return -(logp * weights).sum(), {}
        with model.use_adapters("ref"):
            model.forward_backward([{"input_ids": ids, "packed": packed}], loss_fn)
        torch.nn.utils.clip_grad_norm_(params, ADAM["grad_clip_norm"])
        opt.step()
        opt.zero_grad()
    return model.adapter_tensors("ref")


def _steps(trainer, seed: int, n: int = 3, wait: bool = True, adam: dict = ADAM):
    """``n`` steps of forward_backward + optim_step; pipelined (futures awaited at the end) unless ``wait``."""
    futures = []
    for step in range(n):
        futures.append(trainer.forward_backward(_batch(seed + step, lengths=(6, 9)), "cross_entropy"))
        futures.append(trainer.optim_step(types.AdamParams(**adam)))
        if wait:
            futures[-2].result(), futures[-1].result()
    return futures


def test_two_clients_of_different_ranks_in_mixed_batches_equal_each_alone(server, base):
    service_a, service_b = _service(server), _service(server, "tml-mlora-test-b")
    solo = {}
    for name, service, rank in (("a", service_a, 4), ("b", service_b, 8)):
        trainer = _trainer(service, base, rank, 3)
        _steps(trainer, 100 if name == "a" else 200)
        solo[name] = server.weights(trainer.save_weights_for_sampler("solo").result().path)
    log_before = server.log.read_text().count("models' forward_backward in one batch")
    a, b = _trainer(service_a, base, 4, 3), _trainer(service_b, base, 8, 3)
    pending = []
    for step in range(3):  # both clients' calls in flight at once, as the SDK pipelines them
        pending += _steps(a, 100 + step, n=1, wait=False) + _steps(b, 200 + step, n=1, wait=False)
    for f in pending:
        f.result()
    mixed = {"a": server.weights(a.save_weights_for_sampler("mixed").result().path),
             "b": server.weights(b.save_weights_for_sampler("mixed").result().path)}
    assert server.log.read_text().count("models' forward_backward in one batch") > log_before
    for name in "ab":
        assert mixed[name].keys() == solo[name].keys()
        scale = max(v.abs().max() for v in solo[name].values())
        diff = max((mixed[name][k] - solo[name][k]).abs().max() for k in solo[name])
        assert diff <= MIX_TOL * scale, (name, diff, scale)
    assert solo["a"]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape[0] == 4
    assert solo["b"]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape[0] == 8


def test_topk_targets_gspo_and_dro_through_the_sdk(server, base):
    """(N, K) target_tokens and weights, as tinker_cookbook's top-K distillation (``distillation/sdft.py``) sends
    them: the log-probs come back [N, K] and equal transformers' (≤ 1e-5), and one such request moves the adapter as
    its K columns sent as K requests do (≤ MIX_TOL). gspo and dro: ``loss:sum`` is their page's formula on the
    log-probs the server returns."""
    import transformers

    service = _service(server)
    g = torch.Generator().manual_seed(21)
    k_targets, data, columns = 3, [], [[] for _ in range(3)]
    for n in (6, 9):
        tokens = torch.randint(0, 1000, (n,), generator=g)
        targets, weights = torch.randint(0, 1000, (n, k_targets), generator=g), torch.rand(n, k_targets, generator=g)
        prompt = types.ModelInput.from_ints(tokens.tolist())
        data.append(types.Datum(model_input=prompt, loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(targets), "weights": types.TensorData.from_torch(weights)}))
        for k in range(k_targets):
            columns[k].append(types.Datum(model_input=prompt, loss_fn_inputs={
                "target_tokens": targets[:, k].tolist(), "weights": weights[:, k].tolist()}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    topk, by_column = _trainer(service, base, 4, 11), _trainer(service, base, 4, 11)
    out = topk.forward_backward(data, "cross_entropy").result()
    total = 0.0
    for datum, result in zip(data, out.loss_fn_outputs):
        targets = datum.loss_fn_inputs["target_tokens"].to_torch()
        got = result["logprobs"].to_torch()
        with torch.no_grad():
            logits = hf(torch.tensor(datum.model_input.to_ints())[None]).logits[0].float()
        ref = torch.log_softmax(logits, -1).gather(-1, targets)
        assert got.shape == targets.shape and (got - ref).abs().max() <= LOGPROB_TOL, (got, ref)
        total -= float((ref * datum.loss_fn_inputs["weights"].to_torch()).sum())
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    for column in columns:
        by_column.forward_backward(column, "cross_entropy").result()
    for trainer in (topk, by_column):  # an eps above the gradients: Adam does not scale their float32 rounding up
        trainer.optim_step(types.AdamParams(**MESH_ADAM)).result()
    got = server.weights(topk.save_weights_for_sampler("topk").result().path)
    want = server.weights(by_column.save_weights_for_sampler("columns").result().path)
    scale = max(v.abs().max() for v in want.values())
    assert max((got[key] - want[key]).abs().max() for key in want) <= MIX_TOL * scale

    n = 10
    datum = _batch(31, lengths=(n,))[0]
    q, adv = -torch.rand(n, generator=g) * 2, torch.randn(n, generator=g)
    mask = (torch.arange(n) >= 3).float()
    inputs = {"target_tokens": datum.loss_fn_inputs["target_tokens"], "logprobs": q.tolist(),
              "advantages": (adv * mask).tolist()}
    out = topk.forward([types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)], "dro",
                       loss_fn_config={"beta": 0.05}).result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_torch()
    assert out.metrics["loss:sum"] == pytest.approx(float(-(lp * adv * mask - 0.025 * (lp - q) ** 2).sum()), rel=1e-5)
    inputs["sequence_ratio_mask"] = mask.tolist()
    out = topk.forward([types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)], "gspo").result()
    lp = out.loss_fn_outputs[0]["logprobs"].to_torch()
    ratio = torch.exp((lp - q)[mask != 0].mean())
    want_gspo = -torch.minimum(ratio * adv * mask, ratio.clamp(0.8, 1.2) * adv * mask).sum()
    assert out.metrics["loss:sum"] == pytest.approx(float(want_gspo), rel=1e-5)
    with pytest.raises(tinker.RequestFailedError, match="StableReinforce is in alpha"):
        topk.forward_backward([types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)],
                              "stable_reinforce").result()


def test_the_readme_server_command_as_written(base, tmp_path):
    """``python -m mlora.service --model ... --data-dir ... --port ...``, no other flag (the command docs/tinker.md shows): the
    engine's memory and the micro-batches' token budget are sized at start and printed, and a client trains and
    samples."""
    server = Server(base, tmp_path / "data", tmp_path / "server.log", [])
    client = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    try:
        log = server.log.read_text()
        assert "sampling engine: vLLM engine memory per host" in log and "the trainer keeps" in log, log[-3000:]
        assert "forward_backward micro-batches of at most" in log, log[-3000:]
        trainer = _trainer(client, base, 4, 1)
        assert trainer.forward_backward(_batch(0), "cross_entropy").result().metrics["loss:sum"] > 0
        sampler = trainer.save_weights_and_get_sampling_client().result()
        out = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=4, seed=1)).result()
        assert len(out.sequences) == 2
    finally:
        client.close("success").result()
        server.stop()


def test_bad_requests_fail_alone_and_owners_are_apart(server, base):
    service = _service(server)
    trainer = _trainer(service, base, 4, 5)
    with pytest.raises(tinker.RequestFailedError, match=r"loss_fn 'dpo' is not supported; valid: cross_entropy"):
        trainer.forward_backward(_batch(1), "dpo").result()
    with pytest.raises(tinker.RequestFailedError, match=r"outside this model's vocabulary \[0, 1001\)"):
        trainer.forward_backward(_batch(1, vocab=5000), "cross_entropy").result()
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})
    with pytest.raises(tinker.RequestFailedError, match=r"needs loss_fn_inputs \['weights'\]"):
        trainer.forward_backward([bad], "cross_entropy").result()
    out = trainer.forward_backward(_batch(1), "cross_entropy").result()  # the client goes on
    assert out.metrics["loss:sum"] > 0
    trainer.optim_step(types.AdamParams(**ADAM)).result()
    path = trainer.save_state("mine").result().path
    # another API key: none of this client's models or checkpoints
    other = _service(server, "tml-mlora-test-intruder")
    with pytest.raises(Exception, match=r"checkpoint .* not found"):
        other.create_training_client_from_state(path).result()
    with pytest.raises(Exception, match=r"base_model 'Qwen/Qwen3-8B' is not served here"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4, train_unembed=False).result()


def test_save_restart_load_continues_identically(server, base):
    trainer = _trainer(_service(server), base, 4, 9)
    _steps(trainer, 300, n=1)
    path = trainer.save_state("mid").result().path
    _steps(trainer, 301, n=1)
    want = trainer.forward_backward(_batch(400), "cross_entropy").result()
    server.restart()
    resumed = _service(server).create_training_client_from_state_with_optimizer(path).result()
    _steps(resumed, 301, n=1)
    got = resumed.forward_backward(_batch(400), "cross_entropy").result()
    for w, g in zip(want.loss_fn_outputs, got.loss_fn_outputs):
        assert torch.equal(w["logprobs"].to_torch(), g["logprobs"].to_torch())
    # the old server's model is gone, and says how to go on
    with pytest.raises(Exception, match=r"lost when the server restarted; create a training client from"):
        trainer.forward_backward(_batch(1), "cross_entropy").result()


MESHES = {  # label: (ranks, command-line arguments, what the server says)
    # micro-batches of at most 24 tokens: a batch of the two clients' rows fills the pipeline with two or three
    "tp2-pp2": (4, ["--tp", "2", "--pp", "2", "--max-tokens-per-microbatch", "24"], "TP 2 x PP 2 x DP 1"),
    # each replica runs its share of the rows; a one-datum call leaves one replica without rows
    "dp2": (2, [], "TP 1 x PP 1 x DP 2"),
}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_mesh_server_equals_the_one_process_server(server, base, tmp_path, mesh_name):
    """Two clients (ranks 4 and 8, pipelined: their calls run in mixed batches when they meet, which a loaded machine
    may not make happen) on a server over several ranks (torchrun; rank 0 serves HTTP, every rank runs every model
    call, each DP replica its share of a batch's rows) end where the same calls end on the one-process server."""
    nproc, args, says = MESHES[mesh_name]
    mesh = Server(base, tmp_path / "data", tmp_path / "server.log", ["--no-sampling", "--batch-window", "0.5", *args],
                  nproc=nproc)
    results = {}
    try:
        for label, s in (("one", server), ("mesh", mesh)):
            clients = [tinker.ServiceClient(base_url=s.url, api_key=key) for key in (KEY, "tml-mlora-test-b")]
            try:
                a, b = _trainer(clients[0], base, 4, 41), _trainer(clients[1], base, 8, 42)
                pending = []
                for step in range(2):
                    pending += (_steps(a, 600 + step, n=1, wait=False, adam=MESH_ADAM)
                                + _steps(b, 700 + step, n=1, wait=False, adam=MESH_ADAM))
                for f in pending:
                    f.result()
                out = a.forward_backward(_batch(800), "cross_entropy").result()
                one = a.forward(_batch(801, lengths=(11,)), "cross_entropy").result()
                results[label] = ([s.weights(t.save_weights_for_sampler("end").result().path) for t in (a, b)],
                                  [o["logprobs"].to_torch() for o in out.loss_fn_outputs + one.loss_fn_outputs])
            finally:
                for c in clients:
                    c.close("success").result()
        assert f"serving on {nproc} ranks ({says})" in mesh.log.read_text()
    finally:
        mesh.stop()
    (one_adapters, one_lp), (mesh_adapters, mesh_lp) = results["one"], results["mesh"]
    for want, got in zip(one_adapters, mesh_adapters):
        assert want.keys() == got.keys()
        scale = max(v.abs().max() for v in want.values())
        diff = max((got[k] - want[k]).abs().max() for k in want)
        assert diff <= MESH_TOL * scale, (diff, scale)
    assert len(one_lp) == len(mesh_lp) == 4
    for want, got in zip(one_lp, mesh_lp):
        assert (got - want).abs().max() <= MESH_LOGPROB_TOL


def _forward_logprobs(trainer, tokens: list[int]) -> torch.Tensor:
    """The trainer's log-probs of ``tokens[1:]`` given what precedes each (a ``forward`` call)."""
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
    return trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()


PROMPT = [5, 17, 300, 42, 9, 77]


def test_sampled_logprobs_equal_the_trainers(server, base):
    service = _service(server)
    trainer = service.create_lora_training_client(base_model=str(base), rank=8, seed=21)  # lm_head adapted too
    _steps(trainer, 500, n=2)  # B != 0: the adapter changes what is sampled
    sampler = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop=[])
    out = sampler.sample(types.ModelInput.from_ints(PROMPT), 3, params, include_prompt_logprobs=True,
                         topk_prompt_logprobs=3).result()
    assert len(out.sequences) == 3 and len({s.sequence_id for s in out.sequences}) == 3
    for seq in out.sequences:
        assert len(seq.tokens) == 8 and seq.stop_reason == "length"  # stop=[]: no EOS stop, max_tokens reached
        want = _forward_logprobs(trainer, PROMPT + list(seq.tokens))
        got = torch.tensor(seq.logprobs)
        assert (got - want[len(PROMPT) - 1:]).abs().max() <= SAMPLE_TOL, (got, want)
    assert out.prompt_logprobs[0] is None
    prompt_lp = torch.tensor(out.prompt_logprobs[1:])
    assert (prompt_lp - want[:len(PROMPT) - 1]).abs().max() <= SAMPLE_TOL
    top = out.topk_prompt_logprobs
    assert top[0] is None and all(len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1] for row in top[1:])
    assert all(row[0][1] >= lp - SAMPLE_TOL for row, lp in zip(top[1:], prompt_lp.tolist()))
    # the base model samples another distribution: the adapter was applied
    base_out = service.create_sampling_client(base_model=str(base)).sample(
        types.ModelInput.from_ints(PROMPT), 1, params, include_prompt_logprobs=True).result()
    assert (torch.tensor(base_out.prompt_logprobs[1:]) - prompt_lp).abs().max() > 1e-3
    # a named sampler checkpoint, sampled by path, is the same adapter; another API key cannot sample it
    path = trainer.save_weights_for_sampler("named").result().path
    again = service.create_sampling_client(model_path=path).sample(
        types.ModelInput.from_ints(PROMPT), 3, params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in out.sequences]
    with pytest.raises(Exception, match=r"checkpoint .* not found"):
        _service(server, "tml-mlora-test-intruder").create_sampling_client(model_path=path).result()
    # published (the REST API), another API key samples it too
    tinker.RestClient(base_url=server.url, api_key=KEY).publish_checkpoint_from_tinker_path(path).result()
    theirs = _service(server, "tml-mlora-test-intruder").create_sampling_client(model_path=path).sample(
        types.ModelInput.from_ints(PROMPT), 3, params).result()
    assert [s.tokens for s in theirs.sequences] == [s.tokens for s in out.sequences]
    # prompt_logprobs_last_n: only the last N positions are scored, the same values
    last = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params, include_prompt_logprobs=True,
                          topk_prompt_logprobs=3, prompt_logprobs_last_n=2).result()
    assert last.prompt_logprobs[:4] == [None] * 4 and last.topk_prompt_logprobs[:4] == [None] * 4
    assert (torch.tensor(last.prompt_logprobs[4:]) - prompt_lp[-2:]).abs().max() <= SAMPLE_TOL
    assert last.topk_prompt_logprobs[4:] == top[4:]
    with pytest.raises(tinker.BadRequestError, match=r"prompt_logprobs_last_n=6 must be an integer from 1 to"):
        sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params, include_prompt_logprobs=True,
                       prompt_logprobs_last_n=6).result()


def test_target_prompt_logprobs_and_prompt_alt_tokens(server, base):
    """The whole next-token distribution at prompt positions, against transformers' on the base model:
    ``target_prompt_logprobs`` (dense and sparse CSR) are its log-probs (≤ SAMPLE_TOL), 0.0 in -1 cells, also on a
    prompt the prefix cache holds (as ``prompt_logprobs`` are);
    ``prompt_alt_tokens`` have the SDK's shapes, each draw's log-prob is its token's, a seed gives the same draws,
    and 2500 draws at one position follow the distribution at the request's temperature; bad values are refused."""
    import transformers

    sampler = _service(server).create_sampling_client(base_model=str(base))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():  # row i: the distribution over prompt position i + 1
        ref = torch.log_softmax(hf(torch.tensor(PROMPT)[None]).logits[0, :-1].float(), -1)
    rows, prompt = len(PROMPT) - 1, types.ModelInput.from_ints(PROMPT)
    ids = torch.randint(0, ref.shape[1], (rows, 4), generator=torch.Generator().manual_seed(3))
    ids[1, 2], ids[3] = -1, -1
    params = types.SamplingParams(max_tokens=1, temperature=0.7, seed=11)

    def ask(target, k=0, p=params, tokens=prompt):
        return sampler.sample(tokens, 1, p, include_prompt_logprobs=True, target_prompt_logprobs=target,
                              prompt_alt_tokens_k=k).result()

    def expected(cells: torch.Tensor) -> torch.Tensor:
        return torch.where(cells >= 0, ref.gather(-1, cells.clamp(min=0)), 0.0)

    out = ask(types.TensorData.from_torch(ids), 5)
    got = out.target_prompt_logprobs.to_torch()
    assert got.dtype == torch.float32 and got.shape == ids.shape and (got - expected(ids)).abs().max() <= SAMPLE_TOL
    assert (got[ids < 0] == 0).all()
    assert (torch.tensor(out.prompt_logprobs[1:]) - ref.gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
            ).abs().max() <= SAMPLE_TOL  # read from the same distribution
    # sparse CSR in, sparse CSR out: the cells listed, the others 0.0 when densified
    cells = torch.full((rows, 4), -1)
    cells[2, 1], cells[4, 3] = 7, 900
    sparse = types.TensorData.from_torch_sparse(cells, pad_value=-1)
    assert sparse.sparse_crow_indices is not None
    answer = ask(sparse).target_prompt_logprobs
    assert (answer.sparse_crow_indices, answer.sparse_col_indices) == (sparse.sparse_crow_indices,
                                                                       sparse.sparse_col_indices)
    assert (answer.to_torch() - expected(cells)).abs().max() <= SAMPLE_TOL
    # a prompt the prefix cache holds (longer than the engine's 128-token KV block, sampled before) is still scored
    # at every position, with and without the whole distribution
    long_ids = torch.randint(0, ref.shape[1], (140,), generator=torch.Generator().manual_seed(5))
    cached = types.ModelInput.from_ints(long_ids.tolist())
    sampler.sample(cached, 1, params).result()
    with torch.no_grad():
        want = torch.log_softmax(hf(long_ids[None]).logits[0, :-1].float(), -1).gather(-1, long_ids[1:, None])
    scored = ask(types.TensorData.from_torch(long_ids[1:, None]), 0, params, cached)
    assert (scored.target_prompt_logprobs.to_torch() - want).abs().max() <= SAMPLE_TOL
    for again in (scored, sampler.sample(cached, 1, params, include_prompt_logprobs=True).result()):
        assert (torch.tensor(again.prompt_logprobs[1:]) - want[:, 0]).abs().max() <= SAMPLE_TOL
    # the draws: [len(prompt) - 1, k], the model's log-prob of each drawn token (as prompt_logprobs, no temperature)
    tokens, logprobs = out.prompt_alt_tokens.tokens.to_torch(), out.prompt_alt_tokens.logprobs.to_torch()
    assert tokens.shape == logprobs.shape == (rows, 5) and (tokens.dtype, logprobs.dtype) == (torch.int64,
                                                                                              torch.float32)
    assert (logprobs - ref.gather(-1, tokens)).abs().max() <= SAMPLE_TOL
    assert torch.equal(ask(None, 5).prompt_alt_tokens.tokens.to_torch(), tokens)  # the same seed, the same draws
    # 2500 draws at position 1 at temperature 0.05 (this random model's distribution is nearly flat; at 0.05 its
    # likeliest tokens stand out): each token expected 25+ times, and the others together, are drawn within 6
    # standard deviations of their expected count (a seed failing this has probability < 1e-7 over the 10 or so
    # counts); the distribution at temperature 1 fails the same check
    n, cold = 2500, types.SamplingParams(max_tokens=1, temperature=0.05, seed=4)
    drawn = ask(None, n, cold, types.ModelInput.from_ints(PROMPT[:2])).prompt_alt_tokens.tokens.to_torch()[0]
    counts = torch.bincount(drawn, minlength=ref.shape[1]).double()
    tempered = torch.softmax(ref[0].double() / 0.05, -1)
    own = tempered * n >= 25

    def follows(p: torch.Tensor) -> bool:
        observed = torch.cat([counts[own], counts[~own].sum()[None]])
        q = torch.cat([p[own], p[~own].sum()[None]])
        return bool(((observed - n * q).abs() <= 6 * (n * q * (1 - q)).sqrt()).all())

    assert follows(tempered) and not follows(ref[0].double().exp())
    for target, k, tokens, message in [
            (ids[:-1], 0, prompt, r"target_prompt_logprobs has shape \[4, 4\]: give \[len\(prompt\) - 1, K\] = \[5, K\]"),
            (torch.full((rows, 1), 5000), 0, prompt, r"token ids \[5000\] are outside the vocabulary \[0, 1001\)"),
            (torch.full((rows, 2), -1), 0, prompt, r"names no token id \(every cell is -1\)"),
            (torch.arange(854).repeat(rows, 1), 0, prompt,
             r"names up to 854 distinct token ids in a row: len\(prompt\) \* 854 = 5124 passes this server's bound "
             r"of 5120 \(top-k 20 x context 256\); at most 853 a row"),
            (None, 2561, types.ModelInput.from_ints(PROMPT[:2]),
             r"prompt_alt_tokens_k=2561: len\(prompt\) \* k = 5122 passes this server's bound of 5120 \(top-k 20 x "
             r"context 256\); k is at most 2560"),
    ]:
        with pytest.raises(tinker.BadRequestError, match=message):
            ask(None if target is None else types.TensorData.from_torch(target), k, params, tokens)
    with pytest.raises(tinker.BadRequestError, match=r"num_samples \* len\(prompt\) \* vocab = 140 \* 240 \* 1001 = "
                                                     r"33633600 passes this server's bound of 33554432"):
        sampler.sample(types.ModelInput.from_ints([5] * 240), 140, params, prompt_alt_tokens_k=1).result()


def test_two_clients_sample_in_one_batch_as_each_alone(server, base):
    clients = []
    for key, rank, seed in ((KEY, 4, 31), ("tml-mlora-test-b", 8, 32)):
        trainer = _trainer(_service(server, key), base, rank, seed)
        _steps(trainer, seed, n=1)
        clients.append(trainer.save_weights_and_get_sampling_client().result())
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    prompt = types.ModelInput.from_ints(PROMPT)
    alone = [c.sample(prompt, 2, params).result() for c in clients]
    before = server.log.read_text().count("the sampling engine: 2 requests running (2 adapters)")
    together = [f.result() for f in [c.sample(prompt, 2, params) for c in clients]]
    assert server.log.read_text().count("the sampling engine: 2 requests running (2 adapters)") > before
    for a, t in zip(alone, together):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in t.sequences]
        for x, y in zip(a.sequences, t.sequences):
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) <= SAMPLE_TOL
    assert [s.tokens for s in alone[0].sequences] != [s.tokens for s in alone[1].sequences]
    # continuous batching: a short request sent while a long one decodes joins it and is answered first, not after it
    finished: dict[str, float] = {}

    def wait(name: str, future) -> None:
        future.result()
        finished[name] = time.monotonic()
    long = clients[0].sample(prompt, 4, types.SamplingParams(max_tokens=240, temperature=1.0, seed=1, stop=[]))
    waiters = [threading.Thread(target=wait, args=("long", long))]
    waiters[0].start()
    time.sleep(0.5)  # the long request is decoding
    short = clients[1].sample(prompt, 1, types.SamplingParams(max_tokens=2, temperature=1.0, seed=2, stop=[]))
    waiters.append(threading.Thread(target=wait, args=("short", short)))
    waiters[1].start()
    for w in waiters:
        w.join()
    assert finished["short"] < finished["long"], finished
    with pytest.raises(Exception, match=r"max_tokens=None: give the number of tokens"):
        clients[0].sample(prompt, 1, types.SamplingParams(temperature=1.0)).result()
    with pytest.raises(Exception, match=rf"above this server's sampling limit --max-lora-rank={MAX_LORA_RANK}"):
        _trainer(_service(server), base, 2 * MAX_LORA_RANK, 1)


def test_silent_session_frees_its_models(base, tmp_path):
    """In process: a session that sends no heartbeat and makes no call for ``session_timeout`` has its models freed;
    calls keep it alive."""
    import mlora
    from mlora.service.app import Service
    from mlora.service.tenants import Tenants

    model = mlora.from_pretrained(base, mlora.init_parallel(), dtype=torch.float32)
    service = Service(Tenants(model), base, tmp_path / "data", session_timeout=1.0)
    try:
        session = service.create_session("owner", {})["session_id"]
        future = service.create_model("owner", {"session_id": session, "model_seq_id": 0, "base_model": str(base),
                                                "lora_config": {"rank": 2, "train_unembed": False}})
        assert service.scheduler.wait(future["request_id"], 60)
        model_id = f"{session}:train:0"
        assert list(service.tenants.clients) == [model_id] and len(model.adapters) == 1
        # a client that keeps calling is alive without heartbeats (on a loaded machine they queue behind its polls)
        for _ in range(12):
            service.get_info("owner", {"model_id": model_id})
            time.sleep(0.25)
        assert service.store.model(model_id)["state"] == "live"
        deadline = time.time() + 30
        while service.store.model(model_id)["state"] == "live" and time.time() < deadline:
            time.sleep(0.2)
        assert service.store.model(model_id)["state"] == "freed"
        deadline = time.time() + 30
        while service.tenants.clients and time.time() < deadline:
            time.sleep(0.2)
        assert not service.tenants.clients and not model.adapters
        with pytest.raises(Exception, match=re.escape(f"model {model_id!r} was freed")):
            service.get_info("owner", {"model_id": model_id})
    finally:
        service.close()


def _request(model_id: str, seed: int, lengths=(6, 9)):
    """An in-process ``forward_backward`` request (:class:`mlora.service.wire.ForwardBackward`) of ``_batch``'s
    datums, cross-entropy."""
    from mlora.service.wire import Datum, ForwardBackward

    data = [Datum(torch.tensor(d.model_input.to_ints()), {"target_tokens": d.loss_fn_inputs["target_tokens"].to_torch(),
                                                          "weights": d.loss_fn_inputs["weights"].to_torch()})
            for d in _batch(seed, lengths=lengths)]
    return ForwardBackward(model_id, 0, "cross_entropy", {}, False, data)


def test_idle_clients_wait_in_host_memory_and_come_back_exactly(base):
    """In process, ``max_resident=1`` (``--max-resident-clients 1``): two clients alternating calls swap in and out
    at every call (factors, pending gradients and AdamW state to host memory and back) and end bit for bit where the
    same calls end with both resident."""
    import mlora
    from mlora.service.tenants import Tenants, lora_config

    model = mlora.from_pretrained(base, mlora.init_parallel(), dtype=torch.float32)
    lru, every = Tenants(model, max_resident=1), Tenants(model)

    for tenants, tag in ((lru, "lru"), (every, "all")):
        for k, rank in ((0, 4), (1, 8)):
            tenants.create(f"{tag}{k}", lora_config(rank, 50 + k, True, True, False, f"{tag}{k}"))
        for step in range(3):  # A's gradients wait in host memory while B computes its own, and back again
            for k in (0, 1):
                tenants.forward_backward([_request(f"{tag}{k}", 900 + 10 * step + k)])
            for k in (0, 1):
                tenants.optim_step(f"{tag}{k}", ADAM)
    assert lru.resident() == ["lru1"] and lru.client("lru1").host is None and lru.clients["lru0"].host is not None
    assert not any(name.startswith("t_lru0") for name in model.adapters)  # its adapter left the model
    for k in (0, 1):
        got = model.adapter_tensors(lru.client(f"lru{k}").adapter)
        want = model.adapter_tensors(every.client(f"all{k}").adapter)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_micro_batches_leave_a_mixed_batch_unchanged(base):
    """In process, ``max_tokens=13`` (``--max-tokens-per-microbatch 13``): two clients' mixed batch packed into
    micro-batches of at most 13 tokens (rows of 9 + 4 tokens of each client, and one micro-batch holding the 6-token
    rows of both) gives the log-probs and gradients of the same batch in one micro-batch
    (≤ 1e-5, relative to the largest gradient); a datum longer than the budget is refused, naming it."""
    import mlora
    from mlora.service.tenants import Tenants, lora_config

    model = mlora.from_pretrained(base, mlora.init_parallel(), dtype=torch.float32)
    split, whole = Tenants(model, max_tokens=13), Tenants(model)

    outs = {}
    for tenants, tag in ((split, "split"), (whole, "whole")):
        for k, rank in ((0, 4), (1, 8)):
            tenants.create(f"{tag}{k}", lora_config(rank, 60 + k, True, True, False, f"{tag}{k}"))
        tenants.forward_backward([_request(f"{tag}{k}", 950 + k, (6, 9, 4)) for k in (0, 1)])
        for k in (0, 1):  # B != 0 from here: A's gradients too
            tenants.optim_step(f"{tag}{k}", ADAM)
        outs[tag] = tenants.forward_backward([_request(f"{tag}{k}", 960 + k, (6, 9, 4)) for k in (0, 1)])
    for (lp_split, m_split), (lp_whole, m_whole) in zip(outs["split"], outs["whole"]):
        assert all((a - b).abs().max() <= MIX_TOL for a, b in zip(lp_split, lp_whole))
        assert m_split["loss:sum"] == pytest.approx(m_whole["loss:sum"], rel=1e-6)
    for k in (0, 1):
        got = [p.grad for p in model.adapter_parameters(split.client(f"split{k}").adapter)]
        want = [p.grad for p in model.adapter_parameters(whole.client(f"whole{k}").adapter)]
        scale = max(g.abs().max() for g in want)
        assert scale > 0 and max((a - b).abs().max() for a, b in zip(got, want)) <= MIX_TOL * scale
    with pytest.raises(ValueError, match=r"a datum of 14 tokens is longer than this server's "
                                         r"--max-tokens-per-microbatch=13"):
        split.forward_backward([_request("split0", 970, (14,))])


def test_a_failed_mixed_batch_leaves_every_clients_gradients_as_before(base, monkeypatch):
    """In process, micro-batches of at most 13 tokens: a mixed batch of two clients that fails in its last
    micro-batch (after the first ones' backward) leaves both clients' gradients exactly as before it, so the
    scheduler's one-by-one rerun gives each client the gradients of its request alone (issue 49: they were
    counted twice)."""
    import mlora
    import mlora.service.tenants as tenants_module
    from mlora.service.tenants import Tenants, lora_config

    model = mlora.from_pretrained(base, mlora.init_parallel(), dtype=torch.float32)
    mixed, alone = Tenants(model, max_tokens=13), Tenants(model, max_tokens=13)
    for tenants, tag in ((mixed, "fail"), (alone, "solo")):
        for k, rank in ((0, 4), (1, 8)):
            tenants.create(f"{tag}{k}", lora_config(rank, 70 + k, True, True, False, f"{tag}{k}"))
        tenants.forward_backward([_request(f"{tag}{k}", 980 + k, (6, 9, 4)) for k in (0, 1)])  # gradients pending
    grads = {k: [p.grad.clone() for p in model.adapter_parameters(mixed.client(f"fail{k}").adapter)] for k in (0, 1)}
    real, calls = tenants_module.datum_loss, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 5:  # the last of the batch's 6 rows: micro-batches before it ran their backward
            raise RuntimeError("a fault in the last micro-batch")
        return real(*args)

    monkeypatch.setattr(tenants_module, "datum_loss", failing)
    with pytest.raises(RuntimeError, match="a fault in the last micro-batch"):
        mixed.forward_backward([_request(f"fail{k}", 990 + k, (6, 9, 4)) for k in (0, 1)])
    monkeypatch.setattr(tenants_module, "datum_loss", real)
    for k in (0, 1):
        assert all(torch.equal(p.grad, g) for p, g in zip(model.adapter_parameters(mixed.client(f"fail{k}").adapter),
                                                          grads[k]))
        mixed.forward_backward([_request(f"fail{k}", 990 + k, (6, 9, 4))])  # the scheduler's rerun
        alone.forward_backward([_request(f"solo{k}", 990 + k, (6, 9, 4))])
        got = [p.grad for p in model.adapter_parameters(mixed.client(f"fail{k}").adapter)]
        want = [p.grad for p in model.adapter_parameters(alone.client(f"solo{k}").adapter)]
        scale = max(g.abs().max() for g in want)
        assert max((a - b).abs().max() for a, b in zip(got, want)) <= MIX_TOL * scale


def test_a_held_sampling_client_outlives_newer_snapshots(server, base):
    """The DPO recipe's shape (issue 49): a reference sampling client, sampled after a newer snapshot was saved, is
    kept however many snapshots follow (it failed with "checkpoint not found" after 8); a snapshot nobody sampled
    again is pruned once 8 newer exist."""
    trainer = _trainer(_service(server), base, 4, 41)
    params = types.SamplingParams(max_tokens=2, temperature=1.0, seed=3)
    prompt = types.ModelInput.from_ints(PROMPT)
    reference = trainer.save_weights_and_get_sampling_client().result()
    unused = trainer.save_weights_and_get_sampling_client().result()  # superseded, never sampled again
    reference.sample(prompt, 1, params).result()  # held: sampled after a newer save
    for _ in range(8):
        trainer.save_weights_and_get_sampling_client().result()
    with pytest.raises(Exception, match="no adapter files any more|not found"):
        unused.sample(prompt, 1, params).result()
    assert len(reference.sample(prompt, 1, params).result().sequences) == 1


def test_the_port_is_held_from_the_start():
    """The server binds its port before the engine and the trainer load (their connections take ephemeral ports
    meanwhile); a port already taken stops it at once, naming the port."""
    import socket

    from mlora.service.__main__ import listen

    held = listen("127.0.0.1", 0)
    port = held.getsockname()[1]
    held.listen()
    try:
        with pytest.raises(OSError, match=f"--port {port}: cannot listen there"):
            listen("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # bound and listening: connections queue until uvicorn serves
    finally:
        held.close()
