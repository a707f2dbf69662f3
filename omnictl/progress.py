"""Step progress bars for a terminal, drawn with rich: ``draw: ━━━━━╸━━━━ 6/12 3.1 steps/s 0:00:02``.

Where it runs: in the omnictl CLI's main thread, only when it follows a job on a terminal
(:class:`omnictl.render.EventPrinter` with ``live=True`` imports this module then, so plain runs and
``import omnictl`` never load rich). Nothing here writes to the terminal or starts a thread: a
:class:`StepBar` renders its line to a string, which the printer writes over the previous one.
"""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
from rich.text import Text

MIN_WIDTH = 64       # the bar, "123/1000", "12.3 steps/s" and "0:00:12" fit in this, beside a stage name


class RateColumn(ProgressColumn):
    """Steps per second, as rich estimates it from the updates (its moving window)."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("? steps/s" if speed is None else f"{speed:.1f} steps/s", style="progress.data.speed")


class StepBar:
    """One stage's step progress: a bar, done/total, the rate and the time left, as one line."""

    def __init__(self, stage: str, width: int) -> None:
        # (A terminal that says it has no width, or a very narrow one, gets MIN_WIDTH: one line, always.)
        self._console = Console(file=io.StringIO(), force_terminal=True, width=max(width, MIN_WIDTH), highlight=False)
        # Never started: no live display and no refresh thread; it only keeps the task and its rate.
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                                  RateColumn(), TimeRemainingColumn(), console=self._console, auto_refresh=False)
        self._task = self._progress.add_task(f"{stage}:", total=None)

    def line(self, done: int, total: int | None) -> str:
        """The bar after ``done`` of ``total`` steps (ANSI styled, no newline)."""
        self._progress.update(self._task, completed=done, total=total)
        out = io.StringIO()
        self._console.file = out
        self._console.print(self._progress.make_tasks_table(self._progress.tasks), end="")
        return out.getvalue().split("\n", 1)[0]
