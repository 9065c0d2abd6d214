"""The Tinker service's pure parts: its losses against their formulas, and its protobuf reading and writing against
the ``tinker`` SDK's own encoder and decoder (``tinker.proto.request_conv`` / ``response_conv``)."""

from __future__ import annotations

import pytest
import torch

from mlora.service.losses import check_loss, datum_loss
from mlora.service.wire import decode_forward_backward, encode_forward_backward_output

pytestmark = pytest.mark.quick
tinker = pytest.importorskip("tinker")


def _inputs(n: int = 6, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, generator=g) * 3
    return logp, {"weights": torch.rand(n, generator=g), "logprobs": logp.detach() + 0.5 * torch.randn(n, generator=g),
                  "advantages": torch.randn(n, generator=g)}


def test_losses_are_their_formulas():
    logp, x = _inputs()
    ratio = torch.exp(logp - x["logprobs"])
    lo, hi = 0.8, 1.2
    assert datum_loss("cross_entropy", logp, x, {}) == pytest.approx(float(-(x["weights"] * logp).sum()))
    assert datum_loss("importance_sampling", logp, x, {}) == pytest.approx(float(-(ratio * x["advantages"]).sum()))
    config = check_loss("ppo", {}, {"target_tokens", "logprobs", "advantages"})
    assert config == {"clip_low_threshold": lo, "clip_high_threshold": hi}
    clipped = torch.minimum(ratio * x["advantages"], ratio.clamp(lo, hi) * x["advantages"])
    assert datum_loss("ppo", logp, x, config) == pytest.approx(float(-clipped.sum()))
    # CISPO: the clipped ratio is a constant weight of the log-prob's gradient
    p = logp.clone().requires_grad_()
    datum_loss("cispo", p, x, check_loss("cispo", {"clip_high_threshold": 1.1}, {"target_tokens", "logprobs",
                                                                                 "advantages"})).backward()
    assert torch.allclose(p.grad, -(ratio.clamp(lo, 1.1) * x["advantages"]))


@pytest.mark.parametrize("name, config, inputs, message", [
    ("dpo", {}, {"target_tokens"}, r"loss_fn 'dpo' is not supported; valid: cross_entropy, importance_sampling"),
    ("ppo", {"eps": 0.2}, {"target_tokens", "logprobs", "advantages"},
     r"loss_fn_config keys \['eps'\] do not apply to loss_fn 'ppo'; valid keys: clip_low_threshold"),
    ("cross_entropy", {"clip_low_threshold": 0.5}, {"target_tokens", "weights"}, r"valid keys: none"),
    ("importance_sampling", {}, {"target_tokens", "logprobs"}, r"needs loss_fn_inputs \['advantages'\]"),
    ("ppo", {"clip_low_threshold": 1.5}, {"target_tokens", "logprobs", "advantages"}, r"0 <= clip_low_threshold <= 1"),
    ("ppo", {"clip_low_threshold": "x"}, {"target_tokens", "logprobs", "advantages"}, r"must be a number"),
])
def test_loss_errors(name, config, inputs, message):
    with pytest.raises(ValueError, match=message):
        check_loss(name, config, inputs)


def _request(data, loss_fn="ppo", config=None) -> bytes:
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn=loss_fn, loss_fn_config=config), model_id="s1:train:0", seq_id=7)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_forward_backward_request_as_the_sdk_encodes_it():
    from tinker import types

    chunks = [types.EncodedTextChunk(tokens=[1, 2, 3]), types.EncodedTextChunk(tokens=[70000, 5])]
    datum = types.Datum(model_input=types.ModelInput(chunks=chunks),
                        loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "logprobs": [0.0, -1.0, -2.0, -0.5, -0.25],
                                        "advantages": [0.0, 1.0, 1.0, -1.0, 2.0]})
    fb = decode_forward_backward(_request([datum], config={"clip_low_threshold": 0.7, "mode": "text"}))
    assert (fb.model_id, fb.seq_id, fb.loss_fn, fb.forward_only) == ("s1:train:0", 7, "ppo", False)
    assert fb.config == {"clip_low_threshold": 0.7, "mode": "text"}  # numbers and strings (loss_fn_config_v2)
    (d,) = fb.data
    assert d.tokens.tolist() == [1, 2, 3, 70000, 5] and d.tokens.dtype == torch.int64  # chunks concatenated
    assert d.inputs["target_tokens"].tolist() == [2, 3, 4, 5, 6] and d.inputs["target_tokens"].dtype == torch.int64
    assert d.inputs["logprobs"].tolist() == [0.0, -1.0, -2.0, -0.5, -0.25]
    assert d.inputs["advantages"].dtype == torch.float32


def test_forward_backward_request_errors():
    from tinker import types

    two_d = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=[1, 2, 3, 4], dtype="int64",
                                                                          shape=[2, 2]), "weights": [1.0, 1.0]})
    with pytest.raises(ValueError, match=r"datum 0: loss_fn_inputs\['weights'\] has shape \[2\]; with target_tokens of "
                                         r"shape \[2, 2\] it must be \[2, 2\]"):
        decode_forward_backward(_request([two_d], "cross_entropy"))
    short = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [1, 2]})
    with pytest.raises(ValueError, match=r"has shape \[2\]; this datum of 3 tokens takes \[3\] or \[3, K\]"):
        decode_forward_backward(_request([short], "cross_entropy"))
    k2 = types.TensorData(data=[1, 2, 3, 4], dtype="int64", shape=[2, 2])
    k1 = types.TensorData(data=[1, 2], dtype="int64", shape=[2, 1])
    mixed = [types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": k}) for k in
             (k2, k1)]
    with pytest.raises(ValueError, match="datum 1 has 1 targets per position, datum 0 2"):
        decode_forward_backward(_request(mixed, "cross_entropy"))


def test_topk_targets_and_their_output_shape():
    from tinker import types
    from tinker.proto.response_conv import deserialize_forward_backward_output

    targets = types.TensorData(data=[1, 2, 3, 4, 5, 6], dtype="int64", shape=[3, 2])
    weights = types.TensorData(data=[0.5, 0.25, 1.0, 0.0, 0.125, 0.875], dtype="float32", shape=[3, 2])
    datum = types.Datum(model_input=types.ModelInput.from_ints([7, 8, 9]),
                        loss_fn_inputs={"target_tokens": targets, "weights": weights})
    (d,) = decode_forward_backward(_request([datum], "cross_entropy")).data
    assert d.inputs["target_tokens"].tolist() == [[1, 2], [3, 4], [5, 6]]
    assert d.inputs["weights"].shape == (3, 2)
    out = deserialize_forward_backward_output(encode_forward_backward_output([torch.full((3, 2), -0.5)], {}))
    assert out.loss_fn_outputs[0]["logprobs"].to_torch().shape == (3, 2)  # the SDK reshapes by trailing_shape


def test_output_reads_back_in_the_sdk():
    from tinker.proto.response_conv import deserialize_forward_backward_output

    logprobs = [torch.tensor([-1.5, -0.25, -3.0]), torch.tensor([-0.125])]
    out = deserialize_forward_backward_output(encode_forward_backward_output(logprobs, {"loss:sum": 4.5}))
    assert out.metrics == {"loss:sum": 4.5} and out.loss_fn_output_type == "ArrayRecord"
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.5, -0.25, -3.0], [-0.125]]
    assert out.loss_fn_outputs[0]["logprobs"].dtype == "float32" and out.loss_fn_outputs[0]["logprobs"].shape == [3]
