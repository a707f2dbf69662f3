"""What every ``omnictl`` command is made with: the global options (``Settings``), the documented exit
codes, ``--json``, the daemon-asked shell completion of pipeline, stage and job names, the
``command`` decorator, and JSON output.

Runs in the omnictl process's main thread, as the commands do (cli.py, the root group and its
exit-code mapping, puts them together; the commands are in job_commands.py, stage_commands.py and
daemon_commands.py). Completion asks the daemon with a short timeout and stays silent on any error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any, NoReturn

import click
from click.shell_completion import CompletionItem

from omnictl.client import Client

COMPLETE_TIMEOUT_S = 1.0               # how long a <TAB> may wait for the daemon


class ExitCode(IntEnum):
    OK = 0
    JOB_FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    REFUSED = 4
    INTERRUPTED = 130


@dataclass
class Settings:
    """The global options, shared by every command through the click context."""

    socket: str | None = None
    json: bool = False

    def client(self) -> Client:
        return Client(self.socket)


pass_settings = click.make_pass_decorator(Settings, ensure=True)


def fail(message: str, code: ExitCode) -> NoReturn:
    click.echo(f"omnictl: {message}", err=True)
    raise click.exceptions.Exit(int(code))


# --- shared options, defined once ------------------------------------------------------------


def _enable_json(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(Settings).json = True


json_option = click.option(
    "--json",
    "json_output",
    is_flag=True,
    expose_value=False,
    callback=_enable_json,
    help="Print the API's JSON instead of text (also accepted before the command).",
)

output_dir_option = click.option(
    "-o",
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write the outputs here (default: ./<job id>/).",
)

# --- shell completion: names asked of the daemon, quietly -----------------------------------


def _completion_client(ctx: click.Context) -> Client:
    """A client for <TAB>: the ``--socket`` given so far (else the default), a short timeout."""
    socket = ctx.find_root().params.get("socket")
    return Client(socket if isinstance(socket, str) else None, timeout=COMPLETE_TIMEOUT_S)


def _names(ctx: click.Context, listing: Callable[[Client], Any], key: str, field: str) -> list[Any]:
    """The documents under ``key`` of a listing, or [] when the daemon cannot say (never an error)."""
    try:
        document = listing(_completion_client(ctx))
    except Exception:  # completion must stay silent whatever goes wrong: the shell shows nothing
        return []
    items = document.get(key) if isinstance(document, dict) else None
    return [item for item in items or [] if isinstance(item, dict) and isinstance(item.get(field), str)]


def complete_pipelines(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    return [CompletionItem(p["name"], help=", ".join(map(str, p.get("stages") or [])))
            for p in _names(ctx, Client.pipelines, "pipelines", "name") if p["name"].startswith(incomplete)]


def complete_stages(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    return [CompletionItem(s["name"], help=f"{s.get('engine')}, {s.get('state')}")
            for s in _names(ctx, Client.stages, "stages", "name") if s["name"].startswith(incomplete)]


def complete_jobs(ctx: click.Context, _param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    return [CompletionItem(j["id"], help=f"{j.get('pipeline')}, {j.get('state')}")
            for j in _names(ctx, lambda c: c.jobs(limit=200), "jobs", "id") if j["id"].startswith(incomplete)]


job_ids_argument = click.argument("job_ids", metavar="JOB...", nargs=-1, required=True, shell_complete=complete_jobs)


def command(*options: Callable[[Any], Any]) -> Callable[[Callable[..., None]], click.Command]:
    """Make a command with ``--json`` and the given options, passing it the Settings (cli.py adds it
    to ``omnictl``'s group)."""

    def decorate(fn: Callable[..., None]) -> click.Command:
        wrapped: Any = pass_settings(fn)
        for option in reversed(options):
            wrapped = option(wrapped)
        return click.command(name=fn.__name__.rstrip("_").replace("_", "-"))(json_option(wrapped))

    return decorate


# --- output helpers ------------------------------------------------------------------------------


def print_json(document: Any) -> None:
    click.echo(json.dumps(document, indent=2))


def print_json_line(document: Any) -> None:
    click.echo(json.dumps(document))
