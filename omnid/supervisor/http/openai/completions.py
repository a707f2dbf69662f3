"""`POST /v1/completions`: a prompt continued by a pipeline that ends in text, one ordinary omnid job.

Here: the body's model (`CompletionRequest`) and the handler; the answer, whole or streamed, is
jobs.py's (`OpenAiJobs.text_answer`, as a chat's). The prompt is the job's `prompt` input as it is
(a token stage's `prompt_template` is set empty: a completion continues its prompt); `echo` puts it
before the answer. Runs in the supervisor's event-loop thread; nothing blocks.
"""

from __future__ import annotations

from typing import Annotated, Any

from aiohttp import web
from pydantic import Field

from omnid.supervisor.http import admission
from omnid.supervisor.http.openai.common import (
    One,
    TextBody,
    checked_later,
    fixed,
    generation,
    pipeline_for,
    read_body,
    sampling,
    submit,
)
from omnid.supervisor.http.openai.jobs import Endpoint


class CompletionRequest(TextBody):
    """A completion. stream_options only with stream: true."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    echo: bool | None = None
    suffix: None = None
    logprobs: None = None
    best_of: One = checked_later({"const": 1})

    MESSAGES = {
        **TextBody.MESSAGES,
        ("prompt",): (fixed("prompt must be a string (or a list of one string); token arrays and batches are "
                             "not supported"), None),
        ("echo",): (fixed("echo must be true or false"), None),
        ("suffix",): (fixed("suffix is not supported here"), None),
        ("logprobs",): (fixed("logprobs is not supported here"), None),
        ("best_of",): (fixed("best_of is not supported here"), None),     # (but 1)
    }

    @property
    def text(self) -> str:
        """The prompt (a list of one string is its string)."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class Completions(Endpoint):
    """The completion handler."""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await read_body(request)
        completion = CompletionRequest.parse(body)
        p = pipeline_for(self.api.config, self.api.store, completion, "text")
        stream, include_usage = completion.stream_flags()
        prompt, echo = completion.text, completion.echo
        stage = admission.token_stage(self.api.config, p)
        extra: dict[str, Any] = {"include_prompt": False}
        if stage is not None and self.api.config.stages[stage].defaults.get("prompt_template"):
            extra["prompt_template"] = ""           # a completion continues the prompt as it is
        params = sampling(self.api.config, p, completion.sampling_values(), extra)
        inputs, summary = admission.inputs(self.api.config, {"prompt": prompt}, p)
        gen = generation(self.api.config, p)
        job = submit(self.api, request, p, inputs, params, summary)
        return await self.jobs.text_answer(request, p, job, gen, stream, include_usage, chat=False,
                                           echo=prompt if echo else "")
