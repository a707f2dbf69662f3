"""A python stage that steps every live job together: a tiny recurrent "talker" that says one code
per step for each job, all jobs' hidden states advanced by one batched GRU cell per step.

    [stages.talk]
    engine = "python"
    sessions = "sessions_stage:TinyTalker"
    python_path = ["examples"]     # from the config file's folder (etc/)
    max_inflight = 8
    defaults = { max_codes = 32 }

Each job's session is a slot: its hidden state and its last code. `step` stacks the ready sessions'
states (a batch of B), runs one forward, and gives each session its next code. Sessions join (as
jobs arrive) and leave (when they end, fail or are cancelled) between steps; the output of each is
what it would be alone, since the rows of a batch do not mix. Runs in the stage worker's main
thread (omnid.engines.python_sessions says what omnid calls when).
"""

from __future__ import annotations

from typing import Any

import torch

from omnid.engines.python_sessions import Done

CODES = 64
WIDTH = 32


class TinyTalker:
    def __init__(self, load: Any) -> None:
        """As the stage starts (ready means loaded): the weights. `load.model` is the stage's
        `model` directory, if it names one; this toy makes random ones."""
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(CODES, WIDTH)
        self.cell = torch.nn.GRUCell(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, CODES)

    def open(self, inputs: dict[str, Any], params: dict[str, Any], ctx: Any) -> dict[str, Any]:
        """A job's session: its state, seeded from its text (the prefill of a real talker)."""
        text = str(inputs.get("text", inputs.get("prompt", "")))
        seed = sum(text.encode()) % CODES
        return {"state": torch.zeros(WIDTH), "code": seed, "said": 0, "max": int(params.get("max_codes", 32))}

    @torch.no_grad()
    def step(self, sessions: list[dict[str, Any]]) -> list[Any]:
        """One code for every session, from one batched forward."""
        states = torch.stack([s["state"] for s in sessions])                   # (B, WIDTH)
        codes = torch.tensor([s["code"] for s in sessions])                    # (B,)
        states = self.cell(self.embed(codes), states)
        next_codes = self.head(states).argmax(dim=-1).tolist()
        results: list[Any] = []
        for s, state, code in zip(sessions, states, next_codes):
            s["state"], s["code"], s["said"] = state, code, s["said"] + 1
            segment = {"codes": torch.tensor([code], dtype=torch.int64)}
            results.append(Done(segment) if s["said"] >= s["max"] else segment)
        return results

    def close(self, session: dict[str, Any]) -> None:
        """The session is over (done, failed or cancelled): a real talker frees its KV slot here."""
        session.clear()
