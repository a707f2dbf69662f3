"""One side of the "no tensor edge vs main" row: omnid's VllmEngine from a given source tree, on command.

Run as a subprocess by bench_tensors (never imported by the suite), once for this tree and once
for main's (unpacked by `git archive`):

    python _plain_step.py TREE MODEL BATCH TOKENS

Imports `omnid` from TREE, builds its `VllmEngine` for a stage nothing asks tensors of (the
stage as main knows it: only keys main has), prints {"ready": true}, then for each line read from
stdin runs BATCH greedy requests of TOKENS tokens and prints {"ms": CPU ms per decode step} (the
steps after the prefill; CPU time of this process, steadier than the wall clock on a shared
machine). It exits at EOF. So the caller alternates the two trees under the same noise.
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


def main(tree: str, model: str, batch: int, tokens: int) -> None:
    sys.path.insert(0, tree)
    from omnid.config import StageConfig
    from omnid.engines.base import RequestContext
    from omnid.engines.vllm_engine import VllmEngine

    stage = StageConfig(name="bench", engine="vllm", model=Path(model), max_inflight=batch,
                        args={"max_model_len": 512, "dtype": "bfloat16", "seed": 0},
                        defaults={"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True})
    engine = VllmEngine(stage)
    print(json.dumps({"ready": True, "from": str(Path(sys.modules["omnid"].__file__ or "").parent)}), flush=True)
    n = 0
    for _ in sys.stdin:
        n += 1
        ctxs = [RequestContext(job=f"j{n}-{i}", stage="bench", inputs={"prompt": f"a lighthouse {i}"}, params={})
                for i in range(batch)]
        for ctx in ctxs:
            engine.add(ctx)
        engine.step()                           # the prefill
        steps, t0 = 0, time.process_time()
        while engine.has_work():
            engine.step()
            steps += 1
        cpu = time.process_time() - t0
        if not all(ctx.outcome == "finished" for ctx in ctxs):
            raise SystemExit(f"{[ctx.error for ctx in ctxs]}")
        print(json.dumps({"ms": 1000 * cpu / max(1, steps)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
