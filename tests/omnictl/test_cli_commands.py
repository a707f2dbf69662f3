"""omnictl's group is put together from its command modules (omnictl/cli.py): every command a module
defines is in the group, by its name, once; none is left out of its module's ``COMMANDS``."""

from __future__ import annotations

import click

from omnictl import daemon_commands, job_commands, stage_commands
from omnictl.cli import cli


def test_every_command_a_module_defines_is_in_the_group() -> None:
    seen: dict[str, str] = {}
    for module in (job_commands, stage_commands, daemon_commands):
        commands = [obj for obj in vars(module).values() if isinstance(obj, click.Command)]
        under_groups = {sub for group in commands if isinstance(group, click.Group) for sub in group.commands.values()}
        defined = set(commands) - under_groups
        assert defined == set(module.COMMANDS), module.__name__     # none left out of COMMANDS
        for command in module.COMMANDS:
            assert command.name is not None and command.name not in seen, (command.name, seen)
            seen[command.name] = module.__name__
            assert cli.commands[command.name] is command
    assert set(cli.commands) == set(seen) | {"completion"}
