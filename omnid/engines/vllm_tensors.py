"""The tensors a `vllm` stage takes and gives (omnid/engines/vllm_engine.py): a job's
`prompt_token_ids` and `prompt_embeds` checked and made into what vLLM takes, and the token ids and
hidden-state rows a request gives, per segment and whole. torch and numpy are imported where they are
used: this module is imported where vLLM is, in a stage worker only.
"""

from __future__ import annotations

import io
import json
from typing import Any, Protocol

from omnid.engines.base import RequestContext


class Tracked(Protocol):
    """What the output helpers read and write of a vLLM request (`vllm_engine._Request`)."""

    ctx: RequestContext
    tokens: int                     # tokens generated so far
    prompt_len: int
    ids: list[int]                  # generated token ids (when asked)
    prompt_ids: list[int] | None    # the prompt's ids, once sent (when asked)
    rows: list[Any]                 # hidden-state rows not yet in a segment
    rows_sent: int                  # hidden-state rows given in segments so far
    prompt_n: int                   # the prompt's length in tokens, once seen
    hidden: list[Any]               # every segment's rows (the final output)


# ------------------------------------------------------------------ in: a job's tensor inputs

class TensorInputError(ValueError):
    """A job's prompt_token_ids or prompt_embeds cannot be used; the message names the input."""


def _as_array(name: str, value: Any) -> Any:
    """An input tensor as a numpy array or torch tensor: a tensor, an array, `.npy` bytes, a JSON
    list (or its text)."""
    import numpy as np

    if type(value).__module__.split(".")[0] == "torch" and hasattr(value, "dim"):
        return value
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not bytes(value[:6]) == b"\x93NUMPY":
            raise TensorInputError(f"input {name!r}: a file that is not a .npy array")
        try:
            return np.load(io.BytesIO(bytes(value)), allow_pickle=False)
        except Exception as e:
            raise TensorInputError(f"input {name!r}: not a readable .npy array: {e}") from None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise TensorInputError(f"input {name!r}: text that is not a JSON list") from None
    if isinstance(value, (list, tuple)):
        try:
            array = np.asarray(value)
        except ValueError as e:
            raise TensorInputError(f"input {name!r}: a ragged list ({e})") from None
        if array.dtype == object:
            raise TensorInputError(f"input {name!r}: a list of numbers (or of equal-length lists) is needed")
        return array
    raise TensorInputError(f"input {name!r}: a tensor, array, .npy file or JSON list is needed, "
                           f"not {type(value).__name__}")


def prompt_token_ids(value: Any, vocab: int, max_len: int) -> list[int]:
    """A job's `prompt_token_ids` checked: integers in [0, vocab), one dimension, 1..max_len of them."""
    import numpy as np

    array = _as_array("prompt_token_ids", value)
    array = array.detach().cpu().numpy() if hasattr(array, "detach") else array
    if array.size == 0:
        raise TensorInputError(f"input 'prompt_token_ids': 0 tokens; the model takes 1 to {max_len} (max_model_len)")
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise TensorInputError(f"input 'prompt_token_ids': token ids are integers, not {array.dtype}")
    if array.ndim != 1:
        raise TensorInputError(f"input 'prompt_token_ids': one dimension (tokens) is needed, not shape "
                               f"{tuple(array.shape)}")
    if not 1 <= len(array) <= max_len:
        raise TensorInputError(f"input 'prompt_token_ids': {len(array)} tokens; the model takes 1 to "
                               f"{max_len} (max_model_len)")
    if array.min() < 0 or array.max() >= vocab:
        raise TensorInputError(f"input 'prompt_token_ids': ids must be in [0, {vocab}) (the vocabulary), "
                               f"found {int(array.min())}..{int(array.max())}")
    return [int(t) for t in array]


def prompt_embeds(value: Any, hidden: int, max_len: int, dtype: Any) -> Any:
    """A job's `prompt_embeds` checked: floats (tokens, hidden) with the model's width, finite,
    1..max_len rows; as a CPU torch tensor in the model's dtype."""
    import torch

    array = _as_array("prompt_embeds", value)
    tensor = array.detach() if hasattr(array, "detach") else None
    if tensor is None:
        import numpy as np
        if not np.issubdtype(array.dtype, np.floating):
            raise TensorInputError(f"input 'prompt_embeds': embeddings are floats, not {array.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(array))
    if not tensor.is_floating_point():
        raise TensorInputError(f"input 'prompt_embeds': embeddings are floats, not {tensor.dtype}")
    if tensor.dim() != 2:
        raise TensorInputError(f"input 'prompt_embeds': two dimensions (tokens, hidden) are needed, not shape "
                               f"{tuple(tensor.shape)}")
    if tensor.shape[1] != hidden:
        raise TensorInputError(f"input 'prompt_embeds': rows of width {tensor.shape[1]}, but the model's "
                               f"hidden size is {hidden}")
    if not 1 <= tensor.shape[0] <= max_len:
        raise TensorInputError(f"input 'prompt_embeds': {tensor.shape[0]} tokens; the model takes 1 to "
                               f"{max_len} (max_model_len)")
    tensor = tensor.to("cpu")
    if not bool(torch.isfinite(tensor).all()):
        raise TensorInputError("input 'prompt_embeds': it holds NaN or infinite values")
    return tensor.to(dtype).contiguous()


# ------------------------------------------------------------------ out: a request's tensors

def step_tensors(req: Tracked, ids: list[int], prompt_ids: Any, tapped: bool, hidden_prompt: bool) -> dict[str, Any]:
    """One step's asked-for tensors: its token ids, and the hidden-state rows that came since the last
    (and, in the first segment, the prompt's ids). `tapped`: the stage's hidden states are tapped;
    `hidden_prompt`: its first segment carries the prompt's rows too."""
    import torch

    found: dict[str, Any] = {}
    if "prompt_token_ids" in req.ctx.wants and req.prompt_ids is None:
        req.prompt_ids = [int(t) for t in prompt_ids or ()]
        found["prompt_token_ids"] = torch.tensor(req.prompt_ids, dtype=torch.int64)
    if "token_ids" in req.ctx.wants:
        req.ids.extend(ids)
        found["token_ids"] = torch.tensor(ids, dtype=torch.int64)
    if "hidden_states" in req.ctx.wants and tapped:
        rows = req.rows[0] if len(req.rows) == 1 else torch.cat(req.rows, dim=0) if req.rows else None
        req.rows = []
        if rows is not None:
            # A segment carries the rows of its own tokens: the first, the prompt's too (`hidden_prompt`).
            # An engine core in a process of its own may have run the next step before the take:
            # its rows wait for their token's segment.
            if req.prompt_n < 0:            # (vLLM gives the prompt's ids with the first output only)
                req.prompt_n = len(prompt_ids or ()) or req.prompt_len
            due = req.tokens + (req.prompt_n - 1 if hidden_prompt else 0)
            if rows.shape[0] > due - req.rows_sent:
                rows, ahead = rows[:due - req.rows_sent], rows[due - req.rows_sent:]
                req.rows = [ahead]
            req.rows_sent += rows.shape[0]
        if rows is not None and rows.shape[0]:
            found["hidden_states"] = rows
            req.hidden.append(rows)
    return found

def whole_tensors(req: Tracked) -> dict[str, Any]:
    """The request's asked-for tensors whole (its final outputs)."""
    import torch

    found: dict[str, Any] = {}
    if "token_ids" in req.ctx.wants:
        found["token_ids"] = torch.tensor(req.ids, dtype=torch.int64)
    if "prompt_token_ids" in req.ctx.wants:
        found["prompt_token_ids"] = torch.tensor(req.prompt_ids or [], dtype=torch.int64)
    if "hidden_states" in req.ctx.wants and req.hidden:
        found["hidden_states"] = req.hidden[0] if len(req.hidden) == 1 else torch.cat(req.hidden, dim=0)
    return found
