"""The pure parts of ``target_prompt_logprobs`` and ``prompt_alt_tokens_k``: reading a vLLM-ranked distribution
(:class:`mlora.rollout.prompt_distribution.PromptDistribution`) and a request's target tensor, dense or sparse CSR
(:func:`mlora.service.sampler.prompt_targets`), into the SDK's response tensors."""

from __future__ import annotations

import numpy as np
import pytest

from mlora.rollout.prompt_distribution import PromptDistribution
from mlora.service.sampler import encode_sample_response, prompt_targets

VOCAB = 7


def _distribution(seed: int = 0, rows: int = 3) -> tuple[PromptDistribution, np.ndarray]:
    """A distribution laid out as vLLM hands it over, and the log-probs by token id it ranks, ``[rows, VOCAB]``."""
    rng = np.random.default_rng(seed)
    logits = 2 * rng.normal(size=(rows, VOCAB))
    by_id = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
    order = np.argsort(-by_id, axis=-1, kind="stable")
    prompt = rng.integers(0, VOCAB, rows)
    ids = np.concatenate([prompt[:, None], order], axis=1).astype(np.int32)
    logprobs = np.concatenate([by_id[np.arange(rows), prompt][:, None], np.take_along_axis(by_id, order, -1)], 1)
    return PromptDistribution(ids, logprobs), by_id


def test_reads_and_draws():
    dist, by_id = _distribution()
    assert np.array_equal(dist.prompt_logprobs(), dist.logprobs[:, 0])
    top_ids, top_lps = dist.topk(2)
    assert np.array_equal(top_lps, -np.sort(-by_id, axis=-1)[:, :2]) and np.array_equal(
        np.take_along_axis(by_id, top_ids.astype(np.int64), -1), top_lps)
    rows, ids = np.array([0, 2, 2, 1]), np.array([3, 1, 6, 3])
    assert np.array_equal(dist.logprobs_of(rows, ids), by_id[rows, ids])
    n, temperature = 20000, 0.5
    tokens, logprobs = dist.draw(n, temperature, seed=3)
    assert tokens.shape == logprobs.shape == (3, n) and (tokens.dtype, logprobs.dtype) == (np.int64, np.float32)
    assert np.array_equal(logprobs, np.take_along_axis(by_id, tokens, -1))  # the model's, before temperature
    assert np.array_equal(dist.draw(n, temperature, seed=3)[0], tokens)
    # per row, each token expected 25+ times, and the others together, are drawn within 6 standard deviations of
    # their expected count at the temperature (a seed failing this has probability < 1e-7); at temperature 1 the
    # same counts fail
    scaled = np.exp(by_id.astype(np.float64) / temperature)
    want = scaled / scaled.sum(-1, keepdims=True)
    own = want * n >= 25

    def follows(p: np.ndarray) -> bool:
        for row, keep, q in zip(tokens, own, p):
            observed = np.bincount(row, minlength=VOCAB)
            observed, q = np.append(observed[keep], observed[~keep].sum()), np.append(q[keep], q[~keep].sum())
            if (np.abs(observed - n * q) > 6 * np.sqrt(n * q * (1 - q))).any():
                return False
        return True

    assert follows(want) and not follows(np.exp(by_id.astype(np.float64)))
    greedy, _ = dist.draw(4, 0.0, seed=None)
    assert np.array_equal(greedy, np.repeat(by_id.argmax(-1)[:, None], 4, axis=1))


def _decoded(targets, logprobs: np.ndarray):
    """The SDK's ``target_prompt_logprobs`` of a response carrying ``logprobs`` for ``targets``' cells."""
    from tinker.proto.response_conv import deserialize_sample_response

    result = {"sequences": [], "prompt_logprobs": None, "topk_prompt": None, "alt_tokens": None, "target": logprobs}
    return deserialize_sample_response(encode_sample_response(result, targets)).target_prompt_logprobs


def test_targets_dense_and_sparse_answer_in_their_layout():
    pytest.importorskip("tinker")
    dense = prompt_targets({"data": [1, -1, 3, 4, -1, -1], "dtype": "int64", "shape": [3, 2]}, 4, VOCAB)
    rows, ids = dense.cells()
    assert rows.tolist() == [0, 1, 1] and ids.tolist() == [1, 3, 4] and dense.most_distinct_in_a_row() == 2
    answer = _decoded(dense, np.array([-1.0, -2.0, -3.0], dtype=np.float32))
    assert answer.sparse_crow_indices is None and answer.to_numpy().tolist() == [[-1, 0], [-2, -3], [0, 0]]
    sparse = prompt_targets({"data": [1, -1, 3], "dtype": "int64", "shape": [3, 2], "sparse_crow_indices": [0, 1, 1, 3],
                             "sparse_col_indices": [1, 0, 1]}, 4, VOCAB)
    rows, ids = sparse.cells()
    assert rows.tolist() == [0, 2] and ids.tolist() == [1, 3] and sparse.most_distinct_in_a_row() == 1
    answer = _decoded(sparse, np.array([-1.0, -2.0], dtype=np.float32))
    assert (answer.sparse_crow_indices, answer.sparse_col_indices) == ([0, 1, 1, 3], [1, 0, 1])
    assert answer.to_numpy().tolist() == [[0, -1], [0, 0], [0, -2]]  # the listed -1 cell answers 0.0 too


@pytest.mark.parametrize("tensor, message", [
    ({"data": [1] * 6, "dtype": "float32", "shape": [3, 2]}, r"int64 tensor of token ids, got dtype 'float32'"),
    ({"data": [1] * 6, "dtype": "int64", "shape": [2, 3]}, r"shape \[2, 3\]: give \[len\(prompt\) - 1, K\] = \[3, K\]"),
    ({"data": [1] * 5, "dtype": "int64", "shape": [3, 2]}, r"5 values for shape \[3, 2\]"),
    ({"data": [1.5] * 6, "dtype": "int64", "shape": [3, 2]}, r"integer token ids"),
    ({"data": [1, 9, -2, 0, 0, 0], "dtype": "int64", "shape": [3, 2]}, r"token ids \[-2, 9\] are outside the vocab"),
    ({"data": [-1] * 6, "dtype": "int64", "shape": [3, 2]}, r"names no token id"),
    ({"data": [1], "dtype": "int64", "shape": [3, 2], "sparse_crow_indices": [0, 1, 1, 1]}, r"needs both"),
    ({"data": [1, 3], "dtype": "int64", "shape": [3, 2], "sparse_crow_indices": [0, 1, 1, 3],
      "sparse_col_indices": [1, 0]}, r"sparse_crow_indices must be 4 non-decreasing offsets from 0 to the 2 values"),
    ({"data": [1, 3], "dtype": "int64", "shape": [3, 2], "sparse_crow_indices": [0, 2, 2, 2],
      "sparse_col_indices": [1, 1]}, r"sparse_col_indices must be 2 column indices in \[0, 2\), increasing"),
])
def test_bad_targets_are_refused_by_name(tensor, message):
    with pytest.raises(ValueError, match=message):
        prompt_targets(tensor, 4, VOCAB)
