"""The raw-engine anchors of the vLLM batching rows: vLLM's LLMEngine driven by this one process.

Run as a subprocess by bench_engines (never imported by the suite):

    python _raw_vllm.py MODEL ARGS_JSON [inline|process]

Builds the engine with the same arguments and environment as omnid's vllm_engine.py (CPU, uni
executor, enforce_eager, stats off, the model's OpenMP threads, plus ARGS_JSON: the bench's max_model_len/dtype/seed):
`inline` (the default) keeps the engine core in this process; `process` puts it in a child process,
as vLLM's multiprocessing LLMEngine and omnid's `engine_core = "process"` do (the model in the
core's process). Runs a small warm-up batch and prints {"load_s": ...}. Then, for each line
`N TOKENS` read from stdin, adds N greedy requests of TOKENS tokens at once (ignore_eos, deltas, as
omnid asks for them), steps until every one has finished and prints {"wall": seconds}; a line
`N TOKENS serial` runs the N one after another. It exits at EOF. So the caller can alternate its
runs with the daemon's, under the same noise.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # (process mode: enable_multiprocessing below)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# The model's threads as omnid's vllm_engine.cpu_threads sets them: all CPUs but one (alone here,
# one thread is faster too on 2 cores: 0.54-0.59 s against 0.60-0.64 s for 16 x 64 tokens).
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) - 1)))


def main(model: str, args_json: str, mode: str = "inline") -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    t = time.monotonic()
    args: dict[str, Any] = {"model": model, "distributed_executor_backend": "uni", "disable_log_stats": True,
                            "enforce_eager": True, **json.loads(args_json)}
    engine = LLMEngine.from_engine_args(EngineArgs(**args), enable_multiprocessing=mode == "process")
    try:                                   # as vllm_engine.VllmEngine._renderer
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        renderer = engine.renderer
        tok_params = renderer.default_cmpl_tok_params

        def render(text: str) -> Any:
            (rendered,) = renderer.render_cmpl([parse_model_prompt(engine.model_config, text)], tok_params)
            return rendered
        render("warm-up")
    except Exception:
        def render(text: str) -> Any:
            return text
    load_s = time.monotonic() - t
    ids = iter(range(1 << 30))

    def batch(n: int, tokens: int) -> float:
        sampling = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                  output_kind=RequestOutputKind.DELTA)
        t0 = time.perf_counter()
        live = set()
        for i in range(n):
            rid = f"r{next(ids)}"
            engine.add_request(rid, render(f"prompt {i}"), sampling)
            live.add(rid)
        while live:
            for out in engine.step():
                if out.finished:
                    live.discard(out.request_id)
        return time.perf_counter() - t0

    batch(2, 8)                            # warm-up
    print(json.dumps({"load_s": load_s}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        n, tokens = int(words[0]), int(words[1])
        if words[2:] == ["serial"]:
            wall = sum(batch(1, tokens) for _ in range(n))
        else:
            wall = batch(n, tokens)
        print(json.dumps({"wall": wall}), flush=True)
    if mode == "process":
        engine.engine_core.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "{}", sys.argv[3] if len(sys.argv) > 3 else "inline")
