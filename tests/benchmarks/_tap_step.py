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
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from omnid.config import StageConfig  # noqa: E402
from omnid.engines.base import RequestContext  # noqa: E402
from omnid.engines.vllm_engine import VllmEngine  # noqa: E402


def main(model: str, rounds: int, batch: int, tokens: int) -> None:
    stage = StageConfig(name="bench", engine="vllm", model=Path(model), max_inflight=batch,
                        args={"max_model_len": 512, "dtype": "bfloat16", "seed": 0},
                        defaults={"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True},
                        tensor_outputs=frozenset({"hidden_states", "token_ids"}))
    engine = VllmEngine(stage)
    wants = {"on": frozenset({"hidden_states", "token_ids"}), "off": frozenset()}
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds + 1):
        for kind in ("on", "off"):
            ctxs = [RequestContext(job=f"{kind}{r}-{i}", stage="bench", inputs={"prompt": f"a lighthouse {i}"},
                                   params={}, wants=wants[kind]) for i in range(batch)]
            for ctx in ctxs:
                engine.add(ctx)
            engine.step()                       # the prefill
            # CPU time of this process (the engine runs in it): other processes on a shared machine
            # slow the wall clock of a step far more than its CPU time
            steps, t0 = 0, time.process_time()
            while engine.has_work():
                engine.step()
                steps += 1
            wall = time.process_time() - t0
            if not all(ctx.outcome == "finished" for ctx in ctxs):
                raise SystemExit(f"{kind}: {[ctx.error for ctx in ctxs]}")
            if kind == "on" and ctxs[0].outputs and ctxs[0].outputs["hidden_states"].shape[0] != tokens:
                raise SystemExit("the tap gave the wrong number of rows")
            if r:                               # the first round: warm-up
                times[kind].append(1000 * wall / max(1, steps))
    print(json.dumps(times), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
