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
import sys
from pathlib import Path

from _vllm_step import timed_batch, vllm_engine


def main(tree: str, model: str, batch: int, tokens: int) -> None:
    sys.path.insert(0, tree)
    engine = vllm_engine(model, batch, tokens)
    print(json.dumps({"ready": True, "from": str(Path(sys.modules["omnid"].__file__ or "").parent)}), flush=True)
    n = 0
    for _ in sys.stdin:
        n += 1
        _, ms = timed_batch(engine, [f"j{n}-{i}" for i in range(batch)])
        print(json.dumps({"ms": ms}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
