"""The hidden-state tap: a vLLM worker extension that copies watched requests' rows out of the model.

Runs where the model runs, inside vLLM's worker object: with the `uni` executor that is the
stage worker's main thread, during `LLMEngine.step()`; with `mp` (tensor parallelism) or an
engine core in a process of its own, it is that process, reached through
`LLMEngine.collective_rpc`. vLLM mixes this class into its worker class
(`worker_extension_cls`), so every method here is called as `collective_rpc("omnid_tap_...")`.
Nothing here blocks: the hooks run inside the model's forward, `omnid_tap_take` only hands over
what they kept.

- `omnid_tap_install(layers)` hooks the model once: the final norm for layer -1 (or the last
  layer), decoder layer k-1's output (its hidden state plus the residual) for layer k, as in
  transformers' `output_hidden_states` (index 0 would be the input embeddings: not offered).
  It also wraps the model runner's `execute_model`, so a hook knows the step it runs in (its
  scheduler output); warm-up and dummy runs outside a step are never tapped.
- `omnid_tap_watch(request_id, with_prompt)`: keep this request's rows (vLLM's internal id,
  as `add_request` returns it). Without `with_prompt`, from the prompt's last position on:
  one row per generated token, the state it was sampled from.
- `omnid_tap_take(forget)`: the rows kept since the last take, by request, each a CPU tensor
  `(rows, hidden)` (`(rows, layers, hidden)` for several layers); `forget` ends watches. A hook
  never raises into the forward: its failure comes back as `{TAP_ERROR: message}`, and the
  engine fails the watched requests with it.

Rows are found from the scheduler's numbers, never from a prompt's length: each request's
rows are contiguous in the batch, in the order of the runner's `input_batch.req_ids`, as many as
the scheduler gave it this step (`num_scheduled_tokens`: a chunked prefill's chunk, or 1 in a
decode step), starting at its `num_computed_tokens` position. A position already delivered
(a preempted request computed again) is not kept twice.

On a GPU the rows are gathered on the device and copied to pinned host memory without a sync;
`take` waits on the copy's event, which the step's own sampling (a device-to-host copy of the
sampled ids) has passed already. Only rank 0 answers `take` (every tensor-parallel rank holds the
same rows after the all-reduce); pipeline parallelism is not tapped (`--check` refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TAP_CLASS = "omnid.engines.vllm_tap.HiddenStateTap"
TAP_ERROR = "!error"        # the key under which `omnid_tap_take` reports a hook's failure


@dataclass
class _Watch:
    with_prompt: bool
    next_pos: int = 0                   # positions before this one were kept (or skipped) already


@dataclass
class _TapState:
    layers: tuple[int, ...]             # as configured (1..L, or -1..-L)
    watched: dict[str, _Watch] = field(default_factory=dict)
    step: Any = None                    # the scheduler output of the step being executed, else None
    # this step's selection, made by the first hook that runs in it: (request id, first row, rows)
    selection: list[tuple[str, int, int]] | None = None
    index: Any = None                   # the selected rows' indices, on the model's device
    parts: dict[int, Any] = field(default_factory=dict)       # layer slot -> this step's rows
    kept: list[tuple[list[tuple[str, int]], list[Any], Any]] = field(default_factory=list)
    error: str | None = None            # a hook's failure, reported by the next take


def _as_rows(output: Any, with_residual: bool) -> Any:
    """A module's output as the residual stream's rows: vLLM's norm and decoder layers return
    (hidden, residual); the stream is their sum after a layer, the first of them after the norm."""
    if isinstance(output, tuple):
        hidden, residual = output[0], output[1] if len(output) > 1 else None
        if with_residual and residual is not None:
            return hidden + residual
        return hidden
    return output


def pack(t: Any) -> tuple[bytes, str, list[int]]:
    """A CPU tensor as (its bytes, its dtype's name, its shape): what crosses a process unchanged."""
    t = t.contiguous()
    return t.view(-1).view(__import__("torch").uint8).numpy().tobytes(), str(t.dtype).removeprefix("torch."), \
        list(t.shape)


def unpack(block: Any) -> Any:
    """`pack`'s tensor back (a tensor given as itself passes through)."""
    import torch

    if isinstance(block, torch.Tensor):
        return block
    data, dtype, shape = block
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


class HiddenStateTap:
    """Mixed into vLLM's worker class (`worker_extension_cls`); see the module docstring."""

    model_runner: Any                   # (vLLM's worker has these; annotations only, no attributes)
    rank: int
    _omnid_tap: _TapState
    _omnid_tap_hidden: int

    def omnid_tap_install(self, layers: list[int]) -> int:
        """Hook the model for `layers`; the model's hidden size. Idempotent."""
        if getattr(self, "_omnid_tap", None) is not None:
            return int(self._omnid_tap_hidden)
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        inner = getattr(model, "model", None)
        if inner is None and hasattr(model, "language_model"):
            inner = getattr(model.language_model, "model", None)
        decoder = getattr(inner, "layers", None)
        norm = getattr(inner, "norm", None)
        if decoder is None or norm is None:
            raise RuntimeError(f"cannot tap {type(model).__name__}: no model.layers and model.norm to hook")
        count = len(decoder)
        state = _TapState(layers=tuple(layers))
        for slot, layer in enumerate(layers):
            k = layer if layer > 0 else count + 1 + layer
            if not 1 <= k <= count:
                raise ValueError(f"hidden layer {layer} is not in 1..{count} (or -1..-{count})")
            if k == count:
                module, residual = norm, False          # the last: after the final norm, as transformers
            else:
                module, residual = decoder[k - 1], True
            module.register_forward_hook(self._omnid_hook(state, slot, residual))
        inner_execute = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            state.step, state.selection, state.parts = scheduler_output, None, {}
            try:
                return inner_execute(scheduler_output, *args, **kwargs)
            finally:
                if state.selection:
                    state.kept.append(self._omnid_keep(state))
                state.step, state.selection, state.parts = None, None, {}

        runner.execute_model = execute_model
        self._omnid_tap = state
        self._omnid_tap_hidden = int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0)
        return int(self._omnid_tap_hidden)

    def omnid_tap_watch(self, request_id: str, with_prompt: bool) -> None:
        self._omnid_tap.watched[request_id] = _Watch(with_prompt)

    def omnid_tap_take(self, forget: list[str], packed: bool = False) -> dict[str, Any] | None:
        """The rows kept since the last take, by request id (CPU tensors); None on ranks other than 0.
        `packed` (an engine core in a process of its own: the answer crosses vLLM's msgpack, which
        gives tensors back as lists): each as `(bytes, dtype name, shape)` instead, see `unpack`."""
        state: _TapState = self._omnid_tap
        kept, state.kept = state.kept, []
        for request_id in forget:
            state.watched.pop(request_id, None)
        if getattr(self, "rank", 0) != 0:
            return None
        if state.error is not None:
            error, state.error = state.error, None
            return {TAP_ERROR: error}
        import torch

        rows: dict[str, list[Any]] = {}
        for selection, parts, event in kept:
            if event is not None:
                event.synchronize()             # the step's sampling passed it already: no wait
            stacked = parts[0] if len(parts) == 1 else torch.stack(parts, dim=1)
            at = 0
            for request_id, n in selection:
                rows.setdefault(request_id, []).append(stacked[at:at + n])
                at += n
        whole = {rid: (r[0] if len(r) == 1 else torch.cat(r, dim=0)) for rid, r in rows.items()}
        if packed:
            return {rid: pack(t) for rid, t in whole.items()}
        return whole

    # ------------------------------------------------------------------ inside the forward

    def _omnid_hook(self, state: _TapState, slot: int, residual: bool) -> Any:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            if state.step is None or not state.watched:
                return
            try:
                if state.selection is None:
                    self._omnid_select(state, output)
                if not state.selection:
                    return
                rows = _as_rows(output, residual)
                state.parts[slot] = rows.index_select(0, state.index)
            except Exception as e:      # never into the forward: the watched requests fail, the engine goes on
                state.error = f"the hidden-state tap failed: {type(e).__name__}: {e}"
                state.selection = []
        return hook

    def _omnid_select(self, state: _TapState, output: Any) -> None:
        """Which of this step's rows are kept, from the scheduler's numbers (see the module docstring)."""
        import torch

        runner = self.model_runner
        batch = runner.input_batch
        scheduled = state.step.num_scheduled_tokens
        selection: list[tuple[str, int, int]] = []
        indices: list[int] = []
        row = 0
        for i, request_id in enumerate(batch.req_ids[:batch.num_reqs]):
            n = int(scheduled.get(request_id, 0))
            # watched by the id given to add_request (before it: a core in a process of its own may
            # run the request's first step before any later word reaches it), which vLLM's own id
            # extends with "-" and 8 random characters
            watch = state.watched.get(request_id) or state.watched.get(request_id.rpartition("-")[0])
            if watch is not None and n > 0:
                start = int(batch.num_computed_tokens_cpu[i])
                prompt = int(runner.requests[request_id].num_prompt_tokens)
                first = max(watch.next_pos, 0 if watch.with_prompt else prompt - 1, start)
                end = start + n
                if first < end:
                    selection.append((request_id, first - start, end - first))
                    indices.extend(range(row + first - start, row + n))
                watch.next_pos = max(watch.next_pos, end)
            row += n
        state.selection = selection
        if selection:
            device = _as_rows(output, False).device
            index = torch.tensor(indices, dtype=torch.long)
            if device.type == "cuda":
                index = index.pin_memory()      # a copy that does not wait for the host
            state.index = index.to(device, non_blocking=True)

    def _omnid_keep(self, state: _TapState) -> tuple[list[tuple[str, int]], list[Any], Any]:
        """This step's rows, on their way to host memory (no sync on a GPU)."""
        import torch

        parts = [state.parts[slot] for slot in range(len(state.layers)) if slot in state.parts]
        selection = [(rid, n) for rid, _, n in state.selection or ()]
        if len(parts) != len(state.layers):     # a layer did not run this step (cannot happen): keep nothing
            return [], [], None
        event = None
        if parts[0].is_cuda:
            parts = [p.to("cpu", non_blocking=True) for p in parts]
            event = torch.cuda.Event()
            event.record()
        return selection, parts, event
