"""A vLLM stage's hidden-state tap keeps rows only for the jobs that ask for them
(omnid/engines/vllm_engine.py `add`, omnid/engines/vllm_tap.py): a job that does not ask for
`hidden_states` (its `ctx.wants`) is never watched, so the tap selects, copies and hands over no
row of it, even in a step it shares with a job that asks.

In-process, no vLLM: the real `VllmEngine.add` / `step` / `_take_rows` and the real
`HiddenStateTap` (installed by `omnid_tap_install` on a small torch decoder, its hooks running in
the forward), under a stand-in for vLLM's engine that schedules every request's prompt in one
step and then one token a step, as vLLM's scheduler reports it to the model runner.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from omnid.config import StageConfig
from omnid.engines.base import RequestContext
from omnid.engines.vllm_engine import VllmEngine
from omnid.engines.vllm_tap import HiddenStateTap

pytestmark = pytest.mark.vllm

HIDDEN = 8
VOCAB = 32


class Decoder(torch.nn.Module):
    """The shape the tap hooks: `model.model.layers` and `model.model.norm`, rows (tokens, hidden)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])
        self.norm = torch.nn.LayerNorm(HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.norm(h)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Decoder()
        self.config = SimpleNamespace(hidden_size=HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


class Runner:
    """vLLM's model runner as the tap sees it: the batch's requests in order, what each has
    computed, and `execute_model(scheduler_output)` running the forward over the step's tokens."""

    def __init__(self) -> None:
        self.model = Model()
        self.requests: dict[str, Any] = {}
        self.input_batch = SimpleNamespace(req_ids=[], num_reqs=0, num_computed_tokens_cpu=[])
        self.tokens: dict[str, list[int]] = {}
        self.forwards = 0
        self.rows_computed = 0

    def get_model(self) -> Model:
        return self.model

    def execute_model(self, scheduler_output: Any) -> Any:
        batch = self.input_batch
        ids: list[int] = []
        for i, rid in enumerate(batch.req_ids):
            start = int(batch.num_computed_tokens_cpu[i])
            ids += self.tokens[rid][start:start + scheduler_output.num_scheduled_tokens[rid]]
        self.forwards += 1
        self.rows_computed += len(ids)
        with torch.no_grad():
            return self.model(torch.tensor(ids))


class Engine:
    """Stands in for vLLM's LLMEngine: requests (a character a token), a step that schedules every
    live request (its prompt first, then one token) and runs the runner, `collective_rpc` reaching
    the worker's tap. It yields no outputs: only the tap's rows are looked at here."""

    def __init__(self) -> None:
        self.runner = Runner()
        self.tap = HiddenStateTap()
        self.tap.model_runner = self.runner
        self.tap.rank = 0
        self.computed: dict[str, int] = {}
        self.taken: list[dict[str, Any]] = []

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        answer = getattr(self.tap, method)(*args)
        if method == "omnid_tap_take" and answer:
            self.taken.append(answer)
        return [answer]

    def add_request(self, request_id: str, prompt: Any, sampling: Any) -> str:
        internal = f"{request_id}-0a1b2c3d"                  # vLLM's own id extends the given one
        self.runner.tokens[internal] = [ord(c) % VOCAB for c in str(prompt)] + [1] * 8
        self.runner.requests[internal] = SimpleNamespace(num_prompt_tokens=len(str(prompt)))
        self.computed[internal] = 0
        return internal

    def step(self) -> list[Any]:
        runner = self.runner
        order = list(self.computed)
        scheduled = {rid: (runner.requests[rid].num_prompt_tokens if self.computed[rid] == 0 else 1) for rid in order}
        runner.input_batch = SimpleNamespace(req_ids=order, num_reqs=len(order),
                                             num_computed_tokens_cpu=[self.computed[r] for r in order])
        runner.execute_model(SimpleNamespace(num_scheduled_tokens=scheduled))
        for rid in order:
            self.computed[rid] += scheduled[rid]
        return []


def vllm_engine(engine: Engine) -> VllmEngine:
    """omnid's VllmEngine for a stage some pipeline asks hidden states of (the tap installed), on
    the stand-in engine: only the fields `add`, `step` and `_take_rows` use."""
    stage = StageConfig(name="gen", engine="vllm", model=Path("/nonexistent"), max_inflight=4,
                        defaults={"max_tokens": 4}, outputs=("hidden_states",), hidden_layers=(-1,),
                        tensor_outputs=frozenset({"hidden_states"}))
    e = object.__new__(VllmEngine)
    e.stage, e.engine, e.media = stage, engine, stage.media
    e.default_max_tokens = 4
    e._ids = itertools.count()
    e._requests, e._by_job = {}, {}
    e._processor = None
    e._render = e._render_chat = lambda prompt: prompt
    e._SamplingParams = dict
    e._delta = None
    e._tapped = True
    e._watching, e._forget, e._by_internal = set(), [], {}
    e._hidden, e._max_len = HIDDEN, 64
    e._own_core, e._core_outputs = False, None
    engine.collective_rpc("omnid_tap_install", args=([-1],))
    return e


def test_a_job_that_does_not_ask_for_hidden_states_has_no_rows_kept() -> None:
    engine = Engine()
    e = vllm_engine(engine)
    asks = RequestContext(job="asks", stage="gen", inputs={"prompt": "a red fox"}, params={},
                          wants=frozenset({"hidden_states"}))
    plain = RequestContext(job="plain", stage="gen", inputs={"prompt": "the sea at dawn"}, params={})
    e.add(asks)
    e.add(plain)
    assert not asks.done and not plain.done, (asks.error, plain.error)
    asks_id, plain_id = e._requests[e._by_job["asks"]].internal_id, e._requests[e._by_job["plain"]].internal_id
    # Only the job that asks is watched, by the tap and by the engine.
    assert set(engine.tap._omnid_tap.watched) == {e._by_job["asks"]}
    assert e._watching == {asks_id}
    for _ in range(3):                       # the prefill of both, then two decode steps: one batch each
        e.step()
    assert engine.runner.forwards == 3 and engine.runner.rows_computed == 9 + 15 + 2 + 2
    # The tap kept and handed over the rows of the job that asked, and none of the other's.
    assert engine.taken and all(set(answer) == {asks_id} for answer in engine.taken), \
        [sorted(a) for a in engine.taken]
    assert plain_id not in {rid for answer in engine.taken for rid in answer}
    assert e._requests[e._by_job["plain"]].rows == []
    rows = torch.cat(e._requests[e._by_job["asks"]].rows)
    # one row for the prompt's last position, then one a generated token (hidden_prompt is off)
    assert rows.shape == (3, HIDDEN)
    with torch.no_grad():                   # (each row the forward's final row at its position)
        expected = engine.runner.model(torch.tensor(engine.runner.tokens[asks_id][:11]))[8:11]
    assert torch.allclose(rows, expected, atol=1e-6)
