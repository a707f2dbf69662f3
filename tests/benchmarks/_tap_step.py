"""The anchor-in-one-process measurement of the hidden-state tap's cost: one vLLM engine, two kinds of batch.

Run as a subprocess by bench_tensors (never imported by the suite):

    python _tap_step.py MODEL ROUNDS BATCH TOKENS

Builds omnid's own `VllmEngine` (CPU, in-process core) for a stage whose pipelines ask for hidden
states (the tap installed), then alternates ROUNDS times: BATCH requests of TOKENS greedy tokens
that ask for `hidden_states` and `token_ids` (rows tapped, tensor segments built), and the same
batch asking for nothing (text only, as a stage nothing asks). Both kinds run on the same engine in
the same process, one right after the other, so the machine's noise falls on both. Prints one JSON
line: {"on": [ms per decode step, ...], "off": [...]} (the CPU time of each batch's steps after
its prefill, divided by their count: on a shared machine far steadier than their wall clock).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _vllm_step import timed_batch, vllm_engine  # noqa: E402


def main(model: str, rounds: int, batch: int, tokens: int) -> None:
    engine = vllm_engine(model, batch, tokens, tensor_outputs=frozenset({"hidden_states", "token_ids"}))
    wants = {"on": frozenset({"hidden_states", "token_ids"}), "off": frozenset()}
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds + 1):
        for kind in ("on", "off"):
            ctxs, ms = timed_batch(engine, [f"{kind}{r}-{i}" for i in range(batch)], f"{kind}: ", wants=wants[kind])
            if kind == "on" and ctxs[0].outputs and ctxs[0].outputs["hidden_states"].shape[0] != tokens:
                raise SystemExit("the tap gave the wrong number of rows")
            if r:                               # the first round: warm-up
                times[kind].append(ms)
    print(json.dumps(times), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
