"""OpenAI-compatible endpoints on the daemon's socket (and its TCP listener); each request is one
ordinary omnid job of the caller's uid, shown in `GET /v1/jobs` like any other.

The router: the daemon mounts it on the socket API's aiohttp application (`OpenAiApi(api).mount(api.app)`).
Each endpoint is a file of its own, its body's model, its handler and its serving:

- `GET /v1/models`, `GET /v1/models/{model}`: models.py (the pipelines and their LoRA adapters).
- `POST /v1/chat/completions`: chat.py (a pipeline that ends in text; in speech too, with
  `modalities: ["text", "audio"]`).
- `POST /v1/completions`: completions.py.
- `POST /v1/images/generations`: images.py (a pipeline that ends in an image, `b64_json` only).
- `POST /v1/audio/speech`: speech.py (a pipeline that ends in audio, streamed as it is produced).
- `GET /v1/realtime`: realtime/ (mounted by the daemon: `RealtimeApi`).

What they share up to a request's job is common.py's (errors, a body read and checked, the model
looked up, the sampling fields, the job submitted); once the job exists, jobs.py's (followed, its
text answer, streamed, cancelled when its caller goes away). A request's checks are admission's
(admission.py), in OpenAI's words where the OpenAI shape has its own. The answers carry the job's id
in `X-Omnid-Job`. Errors on these paths are OpenAI's shape: `{"error": {"message", "type", "param",
"code"}}` (common.py). Runs in the supervisor's event-loop thread; handlers never block. Nothing of
the engines is imported here (no tokenizer in the supervisor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from omnid.supervisor.http.http_common import DISCONNECT_POLL_S as DISCONNECT_POLL_S  # (re-exported)
from omnid.supervisor.http.openai.chat import Chat
from omnid.supervisor.http.openai.common import openai_errors
from omnid.supervisor.http.openai.completions import Completions
from omnid.supervisor.http.openai.images import Images
from omnid.supervisor.http.openai.jobs import OpenAiJobs, on_prepare
from omnid.supervisor.http.openai.models import Models
from omnid.supervisor.http.openai.speech import Speech

if TYPE_CHECKING:
    from omnid.supervisor.http.api.core import ApiCore


class OpenAiApi:
    """The OpenAI-shaped endpoints, on the `ApiCore`'s collaborators (config, store, scheduler, info)."""

    def __init__(self, api: ApiCore) -> None:
        self.api = api
        self.jobs = OpenAiJobs(api)

    def mount(self, app: web.Application) -> None:
        app.middlewares.append(openai_errors)
        app.on_response_prepare.append(on_prepare)
        models = Models(self.api)
        app.add_routes([
            web.get("/v1/models", models.list_models),
            web.get("/v1/models/{model}", models.get_model),
            web.post("/v1/chat/completions", Chat(self.jobs).handle),
            web.post("/v1/completions", Completions(self.jobs).handle),
            web.post("/v1/images/generations", Images(self.jobs).handle),
            web.post("/v1/audio/speech", Speech(self.jobs).handle),
        ])
