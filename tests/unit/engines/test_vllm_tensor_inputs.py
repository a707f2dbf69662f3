"""A vLLM stage's tensor inputs checked before they reach vLLM (`prompt_token_ids`, `prompt_embeds`):
in-process, torch and numpy only (no engine)."""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pytest
import torch

from omnid.engines.vllm_tensors import TensorInputError, prompt_embeds, prompt_token_ids

pytestmark = pytest.mark.vllm


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


@pytest.mark.parametrize("value", [[1, 2, 3], np.array([1, 2, 3], np.int32), torch.tensor([1, 2, 3]),
                                   npy(np.array([1, 2, 3], np.int64)), "[1, 2, 3]"])
def test_token_ids_in_every_form(value: Any) -> None:
    assert prompt_token_ids(value, vocab=10, max_len=8) == [1, 2, 3]


@pytest.mark.parametrize(("value", "fragment"), [
    ([1.5, 2.0], "token ids are integers, not float64"),
    ([True, False], "token ids are integers, not bool"),
    ([[1, 2], [3, 4]], "one dimension (tokens) is needed, not shape (2, 2)"),
    ([], "0 tokens; the model takes 1 to 8"),
    (list(range(9)), "9 tokens; the model takes 1 to 8"),
    ([1, 10], "ids must be in [0, 10)"),
    ([-1], "ids must be in [0, 10)"),
    ([[1], [2, 3]], "ragged"),
    ("not json", "text that is not a JSON list"),
    (b"PK\x03\x04", "a file that is not a .npy array"),
    ({"a": 1}, "a tensor, array, .npy file or JSON list is needed, not dict"),
])
def test_bad_token_ids_say_why(value: Any, fragment: str) -> None:
    with pytest.raises(TensorInputError) as err:
        prompt_token_ids(value, vocab=10, max_len=8)
    assert fragment in str(err.value) and "prompt_token_ids" in str(err.value)


def test_embeds_become_the_models_dtype() -> None:
    rows = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    for value in (rows, torch.from_numpy(rows), npy(rows), json.dumps(rows.tolist())):
        out = prompt_embeds(value, hidden=4, max_len=8, dtype=torch.bfloat16)
        assert out.dtype == torch.bfloat16 and out.shape == (3, 4) and out.is_contiguous()
        assert torch.allclose(out.float(), torch.from_numpy(rows), atol=0.02)


@pytest.mark.parametrize(("value", "fragment"), [
    (np.ones((3, 4), np.int64), "embeddings are floats, not int64"),
    (torch.ones((3, 4), dtype=torch.int32), "embeddings are floats, not torch.int32"),
    (np.ones(4, np.float32), "two dimensions (tokens, hidden) are needed, not shape (4,)"),
    (np.ones((1, 3, 4), np.float32), "not shape (1, 3, 4)"),
    (np.ones((3, 5), np.float32), "rows of width 5, but the model's hidden size is 4"),
    (np.ones((9, 4), np.float32), "9 tokens; the model takes 1 to 8"),
    (np.array([[0, 1, np.nan, 0]], np.float32), "NaN or infinite"),
    (np.array([[0, 1, np.inf, 0]], np.float32), "NaN or infinite"),
])
def test_bad_embeds_say_why(value: Any, fragment: str) -> None:
    with pytest.raises(TensorInputError) as err:
        prompt_embeds(value, hidden=4, max_len=8, dtype=torch.bfloat16)
    assert fragment in str(err.value) and "prompt_embeds" in str(err.value)
