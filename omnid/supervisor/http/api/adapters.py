"""A stage's LoRA adapters at run time: `GET`, `POST /v1/stages/{name}/adapters`, `DELETE
/v1/stages/{name}/adapters/{adapter}` (`omnictl adapter list/add/rm`).

The adapters in force are the stage's `lora.adapters` in the config in force (`Live`): an add or a
remove puts a config with the new set in force, for new jobs (the door checks a job's `adapter`
against it), for the stage's live workers (a `Reconfigure`: each gives its engine the new set
between two steps; running jobs keep theirs) and for the workers started later (a restart, a wake).
A reload of the config file puts the file's set in force the same way (`LoraConfig.adapters` is not
part of the stage's definition: no new worker). Nothing running is dropped: a removed adapter stays
in an engine until the last job that named it ends.

A stage that takes no adapters (a python stage, or one without a `lora` table: vLLM's LoRA is on or
off at load) answers 409; an adapter folder that fails the checks, 400.

Adds and removes are root's or the admin group's (over TCP: a key of such a uid); anyone may list.
Runs in the event-loop thread; an add reads the adapter's and the model's safetensors headers only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import structlog
from aiohttp import web
from pydantic import ConfigDict, Field, ValidationError

from omnid import lora as L
from omnid.config_types import Config, StageConfig
from omnid.engines.capabilities import capabilities
from omnid.lora import describe
from omnid.protocol import Reconfigure
from omnid.supervisor.errors import Refused
from omnid.supervisor.http.admission import CheckedBody, Said, fixed, json_body
from omnid.vocabulary import ErrorCode

if TYPE_CHECKING:
    from omnid.supervisor.http.api.core import ApiCore
    from omnid.supervisor.workers.stage_group import StageGroup

log = structlog.get_logger("omnid.adapters")



def with_stage(config: Config, stage: StageConfig) -> Config:
    """`config` with `stage` in place of its namesake."""
    stages = dict(config.stages)
    stages[stage.name] = stage
    return dataclasses.replace(config, stages=stages)


class AdapterRequest(CheckedBody):
    """`POST /v1/stages/{name}/adapters`: a LoRA adapter to add to the stage."""

    model_config = ConfigDict(strict=True, extra="forbid")
    MESSAGES: ClassVar[Said] = {
        ("name",): (lambda at, value: "\"name\" is required: the adapter's name" if value is None
                    else L.name_problem(value) or "\"name\" must name the adapter", None),
        ("path",): (fixed("\"path\" must be the adapter's folder"), None),
    }

    name: str = Field(pattern=L.NAME.pattern)
    path: str = Field(min_length=1, description="the adapter's folder (relative: to the config file's folder)")


class Adapters:
    """The handlers; they read and change the config in force through the API's `Live`."""

    def __init__(self, api: ApiCore) -> None:
        self.api = api

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/stages/{name}/adapters", self.list),
                web.post("/v1/stages/{name}/adapters", self.add),
                web.delete("/v1/stages/{name}/adapters/{adapter}", self.remove)]

    def _stage(self, request: web.Request) -> tuple[StageGroup, StageConfig]:
        group = self.api.stage(request)
        stage = self.api.config.stages[group.name]
        if not capabilities(stage.engine).lora:
            raise Refused(409, ErrorCode.INVALID_ADAPTER, f"stage {group.name!r} is a {stage.engine} stage: it "
                          f"takes no LoRA adapters")
        return group, stage

    async def list(self, request: web.Request) -> web.Response:
        """A stage's LoRA adapters in force and their base model (`lora`: null for a stage without)."""
        group = self.api.stage(request)
        return web.json_response({"stage": group.name, "lora": describe(self.api.config.stages[group.name])})

    async def add(self, request: web.Request) -> web.Response:
        """Add an adapter: `{"name": "sql", "path": "/srv/loras/sql"}` (a path relative to the config
        file's folder, as the config's). 201 with the stage's adapters."""
        self.api.admin(request, "add_adapter")
        group, stage = self._stage(request)
        body = await json_body(request)
        if not isinstance(body, dict):
            raise Refused(400, ErrorCode.INVALID_REQUEST, "the body is {\"name\": NAME, \"path\": FOLDER}")
        try:
            asked = AdapterRequest.model_validate(body)
        except ValidationError as e:
            said = AdapterRequest.problems(e, body)
            raise Refused(400, ErrorCode.INVALID_REQUEST, "; ".join(dict.fromkeys(m for _, m in said))) from None
        name, path = asked.name, asked.path
        if stage.lora is None:
            raise Refused(409, ErrorCode.INVALID_ADAPTER, f"stage {group.name!r} has no lora table: vLLM's LoRA "
                          f"is off. Add `lora = {{ max_lora_rank = 16 }}` to stages.{group.name} and restart it")
        if name in stage.adapters:
            raise Refused(409, ErrorCode.ADAPTER_EXISTS, f"stage {group.name!r} has an adapter {name!r} already "
                          f"({stage.adapters[name]}); remove it first")
        folder = Path(path).expanduser()
        source = self.api.config.source
        if not folder.is_absolute():
            folder = (source.parent if source is not None else Path.cwd()) / folder
        try:
            info = L.check(folder, stage.model, stage.lora.max_lora_rank)
        except (L.AdapterError, OSError) as e:
            raise Refused(400, ErrorCode.INVALID_ADAPTER, f"adapter {name!r}: {e}") from None
        adapters = dict(stage.adapters)
        adapters[name] = folder
        self._put(group, adapters)
        log.info("audit", action="add_adapter", uid=request["uid"], stage=group.name, adapter=name, path=str(folder),
                 rank=info.rank)
        return web.json_response({"stage": group.name, "added": name, "rank": info.rank,
                                  "lora": describe(self.api.config.stages[group.name])}, status=201)

    async def remove(self, request: web.Request) -> web.Response:
        """Remove an adapter: new jobs may no longer name it; running ones finish with it."""
        self.api.admin(request, "remove_adapter")
        group, stage = self._stage(request)
        name = request.match_info["adapter"]
        if name not in stage.adapters:
            raise Refused(404, ErrorCode.UNKNOWN_ADAPTER, f"stage {group.name!r} has no adapter {name!r} (its "
                          f"adapters: {', '.join(sorted(stage.adapters)) or 'none'})")
        for key in ("adapter", "adapters"):
            default = stage.defaults.get(key)
            if default == name or (isinstance(default, dict) and name in default):
                raise Refused(409, ErrorCode.INVALID_ADAPTER, f"stage {group.name!r}'s defaults.{key} names "
                              f"{name!r}: change the config first")
        adapters = {n: p for n, p in stage.adapters.items() if n != name}
        self._put(group, adapters)
        log.info("audit", action="remove_adapter", uid=request["uid"], stage=group.name, adapter=name)
        return web.json_response({"stage": group.name, "removed": name,
                                  "lora": describe(self.api.config.stages[group.name])})

    def _put(self, group: StageGroup, adapters: dict[str, Path]) -> None:
        """Put the new adapter set in force: the public config (the door), the workers' config (later
        spawns), and each live worker of the stage (a Reconfigure)."""
        live = self.api.live
        public = live.config.stages.get(group.name)
        if public is not None:
            live.config = with_stage(live.config, public.with_adapters(adapters))
        worker = live.worker.stages.get(group.name)
        if worker is not None:
            live.worker = with_stage(live.worker, worker.with_adapters(adapters))
        for handle in group.replicas:
            handle.send(Reconfigure(handle.config))
