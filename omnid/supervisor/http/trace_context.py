"""The W3C trace context on the front ends (`[daemon] tracing`): a caller's `traceparent` and
`tracestate` joined, and the job's trace named in the answer.

Every path that makes a job (the socket's and the TCP listener's `POST /v1/jobs`, the OpenAI paths)
goes through `ApiCore.take`, which calls `joined` (the caller's context and the request's arrival into
the `Submission`: the job span hangs under the caller's span) and `answered` (the job's context,
sent back in a `traceresponse` header, W3C Trace Context level 2; `POST /v1/jobs` also says
`trace_id` in its body). Mounted only when tracing is on (`mount`: a middleware that stamps each
request's arrival, and the header on the way out). Runs in the event-loop thread; imports no
OpenTelemetry.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from omnid.supervisor.jobs.submission import Submission
from omnid.tracing import trace_headers, trace_id_of

RECEIVED_KEY = "omnid_received_at"
TRACEPARENT_KEY = "omnid_traceparent"
RESPONSE_HEADER = "traceresponse"


def mount(app: web.Application) -> None:
    app.middlewares.insert(0, _stamp)
    app.on_response_prepare.append(_name_trace)


@web.middleware
async def _stamp(request: web.Request,
                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    request[RECEIVED_KEY] = time.time()
    return await handler(request)


async def _name_trace(request: web.Request, response: web.StreamResponse) -> None:
    traceparent = request.get(TRACEPARENT_KEY)
    if traceparent:
        response.headers[RESPONSE_HEADER] = traceparent


def joined(sub: Submission, request: web.Request) -> Submission:
    """The submission with the caller's trace context (if a valid one came) and the request's arrival."""
    return dataclasses.replace(sub, trace=trace_headers(request.headers.get("traceparent"),
                                                        request.headers.get("tracestate")),
                               received_at=request.get(RECEIVED_KEY))


def answered(request: web.Request, traceparent: str) -> None:
    """The answer to `request` names the job's trace (the `traceresponse` header)."""
    request[TRACEPARENT_KEY] = traceparent


def trace_id(request: web.Request) -> str | None:
    """The trace id of the job this request made, once `answered`."""
    return trace_id_of(request.get(TRACEPARENT_KEY))
