"""The docs pages made from the code's own definitions: `omnictl`'s reference (click's own help of every
command), the OpenAPI page (every operation the daemon documents, with its summary) and the list of
every metric (the daemon's own Prometheus registry: name, type, help).

`python tests/docs_pages.py` writes them into docs/reference/; tests/unit/test_docs.py fails while a page
differs from what this makes (a command, option or operation added, changed or removed), saying to run it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
OMNICTL_PAGE = ROOT / "docs/reference/omnictl.md"
OPENAPI_PAGE = ROOT / "docs/reference/openapi.md"
METRICS_PAGE = ROOT / "docs/reference/metric-list.md"
WIDTH = 100
REGENERATE = "python tests/docs_pages.py"


def _commands(cmd: click.Command, ctx: click.Context) -> list[tuple[click.Command, click.Context]]:
    """`cmd` and, for a group, every subcommand under it, depth first, in name order."""
    found = [(cmd, ctx)]
    if isinstance(cmd, click.Group):
        for name in sorted(cmd.list_commands(ctx)):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                found += _commands(sub, click.Context(sub, info_name=name, parent=ctx, **sub.context_settings))
    return found


def omnictl_page() -> str:
    from omnictl.cli import cli
    root = click.Context(cli, info_name="omnictl", **{**cli.context_settings, "terminal_width": WIDTH,
                                                      "max_content_width": WIDTH})
    parts = ["# `omnictl` reference", "",
             f"Every command's own `--help`, as click prints it (made by `{REGENERATE}`; a test fails while this",
             "page and the commands differ). The exit codes are on [Using it](../guides/tour.md).", ""]
    for cmd, ctx in _commands(cli, root):
        name = ctx.command_path
        parts += [f"## `{name}`", "", "```text", cmd.get_help(ctx).rstrip(), "```", ""]
    return "\n".join(parts)


def openapi_page() -> str:
    from omnid.supervisor.http.openapi import OPERATIONS
    parts = ["# The OpenAPI document", "",
             "`GET /v1/openapi.json` is an OpenAPI 3.1 document of the whole API, generated from the rules the daemon",
             "validates with, its schemas filled in from the config in force (each pipeline's inputs and each stage's",
             "parameters); tests check real answers against it. Fetch it from a running daemon:", "",
             "```sh", "curl --unix-socket /run/omnid/omnid.sock http://omnid/v1/openapi.json", "```", "",
             "Its operations (made from `omnid/supervisor/http/openapi.py` by "
             f"`{REGENERATE}`; a test fails while they differ). The job document, events and error codes are in",
             "the [HTTP API](../api.md) page.", "",
             "| method | path | what |", "| --- | --- | --- |"]
    for (method, path), op in OPERATIONS.items():
        summary = " ".join(op["summary"].split()).replace("|", "\\|")
        parts.append(f"| {method} | `{path}` | {summary} |")
    return "\n".join(parts) + "\n"


def metrics_page() -> str:
    """Every family the daemon's registry serves: its own collectors asked with stand-ins for the disk watch
    and the connection guard (which report only once the daemon has made them)."""
    from types import SimpleNamespace

    from omnid.supervisor.metrics import Metrics
    metrics = Metrics({})
    disk = SimpleNamespace(check=lambda: SimpleNamespace(free_bytes=1, free_inodes=1, full=False, store_failing=None,
                                                         ballast=True),
                           min_free_bytes=1, ballast_bytes=1, released=0)
    guard = SimpleNamespace(connections=lambda: [], limit=1, refused=0)
    metrics.watch(disk, guard)  # type: ignore[arg-type]
    parts = ["# Every metric", "",
             "What `GET /metrics` serves, family by family, as the daemon's own Prometheus registry describes it",
             f"(made by `{REGENERATE}`; a test fails while this page and the registry differ). What they",
             "mean together, their labels and exemplars: [Metrics and spans](metrics.md).", "",
             "| metric | type | what |", "| --- | --- | --- |"]
    standard = []
    for fam in metrics.registry.collect():
        suffix = "_total" if fam.type == "counter" else "_info" if fam.type == "info" else ""
        if not fam.name.startswith("omnid_"):
            standard.append(fam.name + suffix)
            continue
        help_ = " ".join(fam.documentation.split()).replace("|", "\\|")
        parts.append(f"| `{fam.name}{suffix}` | {fam.type} | {help_} |")
    parts += ["", "Besides these, the standard series of a Python exporter: " +
              ", ".join(f"`{n}`" for n in sorted(standard)) + "."]
    return "\n".join(parts) + "\n"


def main() -> None:
    for page, text in ((OMNICTL_PAGE, omnictl_page()), (OPENAPI_PAGE, openapi_page()), (METRICS_PAGE, metrics_page())):
        page.write_text(text)
        print(f"wrote {page.relative_to(ROOT)} ({len(text.encode())} bytes)")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
