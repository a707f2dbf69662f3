"""The `vllm` engine: an autoregressive LLM through vLLM's `LLMEngine`.

Runs in a stage worker's main thread; `step()` is one `LLMEngine.step()`
(a few ms on the tiny CPU model) and never blocks longer than one decode
step, so a cancel takes effect at the next step through `abort_request`.
Several requests are in flight at once when the stage's `max_inflight > 1`
(vLLM batches them).

The engine is kept inside this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
`distributed_executor_backend="uni"`): one stage, one process tree. Token
deltas are streamed as text segments (`RequestOutputKind.DELTA`); the stage's
output `text` is the whole generation (prefixed by the prompt when the job
sets `include_prompt`). An input `messages` (a chat, as JSON text) replaces
`prompt`: it is rendered with the tokenizer's chat template.
"""

from __future__ import annotations

import itertools
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from omnid.config import StageConfig
from omnid.params import VLLM_OMNID_PARAMS, check_param, merged, parallel_size
from omnid.engines.base import Engine, RequestContext


@dataclass
class _Request:
    ctx: RequestContext
    prefix: str
    max_tokens: int
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0


def engine_args(stage: StageConfig) -> dict[str, Any]:
    """vLLM's EngineArgs for a stage: its `args` over omnid's defaults.

    The executor: one model in one process (`uni`: the engine core stays in this worker, one
    process tree) unless the stage asks for tensor or pipeline parallelism, which needs one process
    per GPU (`mp`); the worker's process group still holds them all. An explicit
    `distributed_executor_backend` in `args` wins (`--check` refuses `uni` with parallelism).
    """
    args: dict[str, Any] = {"model": str(stage.model), "disable_log_stats": True}
    if not stage.devices:
        # CUDA graphs and torch.compile warm-up cost ~40 s on a CPU and buy nothing there.
        args["enforce_eager"] = True
    args.update(stage.args)
    args.setdefault("distributed_executor_backend", "mp" if parallel_size(stage.args) > 1 else "uni")
    return args


PROGRESS_EVERY = 8      # tokens between two progress reports (and one at the end)


class VllmEngine(Engine):
    def __init__(self, stage: StageConfig) -> None:
        if not stage.devices:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        warnings.filterwarnings("ignore", category=FutureWarning)
        from vllm import EngineArgs, LLMEngine, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._SamplingParams = SamplingParams
        self._delta = RequestOutputKind.DELTA
        self.stage = stage
        self.engine = LLMEngine.from_engine_args(EngineArgs(**engine_args(stage)))
        self.default_max_tokens = int(stage.defaults.get("max_tokens", 16))
        self._ids = itertools.count()
        self._requests: dict[str, _Request] = {}
        self._by_job: dict[str, str] = {}
        self._render = self._renderer()

    def _renderer(self) -> Any:
        """vLLM >= 0.30 wants rendered prompts; older ones take a plain string."""
        try:
            from vllm.renderers.inputs.preprocess import parse_model_prompt
            renderer = self.engine.renderer
            tok_params = renderer.default_cmpl_tok_params

            def render(text: str) -> Any:
                (rendered,) = renderer.render_cmpl([parse_model_prompt(self.engine.model_config, text)], tok_params)
                return rendered
            render("warm-up")
            return render
        except Exception:
            return lambda text: text

    def info(self) -> dict[str, Any]:
        cfg = self.engine.model_config
        return {"model": str(self.stage.model), "dtype": str(getattr(cfg, "dtype", "")),
                "max_model_len": getattr(cfg, "max_model_len", None)}

    def add(self, ctx: RequestContext) -> None:
        prompt = ctx.inputs.get("prompt")
        messages = ctx.inputs.get("messages")
        if messages is not None:        # a chat: rendered with the model's chat template instead
            prompt = ""
        if not isinstance(prompt, str):
            ctx.fail(f"a vllm stage needs a text input \"prompt\" (or \"messages\"); "
                     f"got {sorted(ctx.inputs) or 'no inputs'}")
            return
        params = merged(self.stage.defaults, ctx.params)
        # The door checked the job's values and --check the defaults; this guards what reaches vLLM.
        for key, value in params.items():
            if (why := check_param("vllm", key, value)) is not None:
                ctx.fail(f"{key} {why}, not {value!r}")
                return
        own = {key: params.pop(key) for key in VLLM_OMNID_PARAMS if key in params}
        include_prompt = bool(own.get("include_prompt", False))
        template = own.get("prompt_template")
        text: Any = str(template).replace("{prompt}", prompt) if template else prompt
        params.setdefault("max_tokens", self.default_max_tokens)
        try:
            if messages is not None:
                text = self._chat_prompt(messages)
            sampling = self._SamplingParams(**params, output_kind=self._delta)
            request_id = f"{ctx.job}-{next(self._ids)}"
            self.engine.add_request(request_id, self._render(text), sampling)
        except Exception as e:          # bad parameter values, a prompt longer than the model
            ctx.fail(f"{type(e).__name__}: {e}")
            return
        prefix = prompt if include_prompt else ""
        self._requests[request_id] = _Request(ctx, prefix, int(params["max_tokens"]))
        self._by_job[ctx.job] = request_id

    def _chat_prompt(self, messages: Any) -> dict[str, Any]:
        """`messages` (a list of {"role", "content"}, or that list as JSON text) rendered with the
        tokenizer's chat template, as token ids (the template writes its own special tokens)."""
        if isinstance(messages, str):
            messages = json.loads(messages)
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("\"messages\" must be a list of {\"role\", \"content\"} objects")
        tokenizer = self.engine.get_tokenizer()
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer of {self.stage.model} has no chat template: send a \"prompt\"")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return {"prompt_token_ids": list(tokenizer.encode(text, add_special_tokens=False))}

    def step(self) -> None:
        for out in self.engine.step():
            req = self._requests.get(out.request_id)
            if req is None:
                continue
            completion = out.outputs[0]
            if completion.text:
                req.pieces.append(completion.text)
            before, req.tokens = req.tokens, req.tokens + len(completion.token_ids)
            req.ctx.segment({"text": completion.text}, is_last=out.finished)
            if out.finished or req.tokens // PROGRESS_EVERY != before // PROGRESS_EVERY:
                req.ctx.progress(req.tokens, req.max_tokens)   # every few tokens: the segments tell each one
            if out.finished:
                del self._requests[out.request_id]
                self._by_job.pop(req.ctx.job, None)
                generated = "".join(req.pieces)
                sep = " " if req.prefix and generated and not generated[0].isspace() else ""
                req.ctx.finish({"text": (req.prefix + sep + generated).strip()})

    def abort(self, job: str) -> None:
        request_id = self._by_job.pop(job, None)
        if request_id is None:
            return
        self.engine.abort_request([request_id])
        # vLLM reports nothing more for an aborted request: complete it here.
        req = self._requests.pop(request_id)
        req.ctx.stopped()

    def has_work(self) -> bool:
        return bool(self._requests)
