"""What the driver shows while a run starts and trains: the renderer of a run's events.

The library (:func:`raytrain_mnist.driver.fitting.fit`) tells its caller what happens as
:mod:`~raytrain_mnist.driver.events`: start-up phases, notes, rank 0's steps within an
epoch (``worker.feed.ProgressFeed``, carried by ``driver.monitor``), each committed epoch. The
command hands them to a :class:`Renderer`, which turns them into output in one of four
modes (``--progress``):

* ``bar``: start-up phases as lines with elapsed seconds, then a progress bar within each
  epoch (images done, img/s, ETA, running loss), redrawn in place and cleared before the
  epoch's line. Drawn by rich.
* ``lines``: the phase lines and the epoch lines, and nothing is ever redrawn: no carriage
  return reaches a log file.
* ``off``: the epoch lines only.
* ``auto``: ``bar`` on a terminal, ``lines`` otherwise (pipes, CI, ``nohup``).

The tune command uses :class:`TrialsTable` for its trials.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

from raytrain_mnist._cli import terminated
from raytrain_mnist.driver.events import (
    EpochCommitted,
    Event,
    Phase,
    StepProgress,
    Stopping,
    TrialEnded,
    TrialReported,
    TrialStarted,
    format_value,
)

MODES = ("auto", "bar", "lines", "off")


def is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM", "") not in ("dumb",)
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def resolve_mode(mode: str, stream: TextIO) -> str:
    """``auto`` made concrete for ``stream``."""
    if mode != "auto":
        return mode
    return "bar" if is_terminal(stream) else "lines"


def _ray_prints_plain_unless_on(stream: TextIO) -> None:
    """Off a terminal, what Ray prints on this process's stdout comes without escapes too: a
    raylet's message to the driver (workers slow to start on a loaded machine, a worker
    killed for memory) is printed by Ray's listener thread with a colour prefix, whatever
    ``log_to_driver`` says. A value the user set wins."""
    if not is_terminal(stream):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    minutes, seconds = divmod(seconds, 60)
    return (
        f"{minutes}:{seconds:02d}"
        if minutes < 60
        else f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}"
    )


class Renderer:
    """A run's events as phase lines, epoch bars and epoch lines on ``stream`` (default:
    ``sys.stdout`` as it is when the renderer is made); a stop on ``err`` (default:
    ``sys.stderr`` as it is then). Pass it as the run's sink: ``fit(cfg, renderer)``.
    Called from one thread at a time."""

    def __init__(self, mode: str, stream: TextIO | None = None, err: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.mode = resolve_mode(mode, self.stream)
        _ray_prints_plain_unless_on(self.stream)
        self._bar = None  # rich Progress while an epoch is drawn
        self._task = None
        self._bar_epoch = 0
        self._done_epoch = 0  # epochs whose line was printed: late updates for them are dropped

    @property
    def redraws(self) -> bool:
        return self.mode == "bar"

    @property
    def poll_s(self) -> float:
        """How often the driver should collect the run's progress: a bar wants its updates
        promptly."""
        return 0.25 if self.redraws else 0.5

    def __call__(self, event: Event) -> None:
        if isinstance(event, StepProgress):
            self.step(event.item, event.epochs)
        elif isinstance(event, EpochCommitted):
            self.epoch(event.epoch, event.text)
        elif isinstance(event, Phase):
            self.phase(event.text, event.elapsed_s)
        elif isinstance(event, Stopping):
            # After the terminal's "^C". The bar (on stdout) is left as it is: the run's
            # last lines and its summary follow.
            text = event.text
            if terminated() and text.startswith("Ctrl-C:"):  # the same stop, by SIGTERM
                text = "SIGTERM:" + text.removeprefix("Ctrl-C:")
            print(f"\n{text}", file=self.err, flush=True)
        else:  # a Note, or any other event: its line
            self.line(event.text)

    def phase(self, text: str, elapsed_s: float) -> None:
        """A start-up phase: ``   3.1 s  text`` (not with ``--progress off``)."""
        if self.mode != "off":
            self.line(f"{elapsed_s:7.1f} s  {text}")

    def line(self, text: str) -> None:
        """A whole line, after clearing the bar if one is drawn."""
        self._close_bar()
        print(text, file=self.stream, flush=True)

    def epoch(self, epoch: int, text: str) -> None:
        """An epoch committed: its line replaces its bar."""
        self._done_epoch = max(self._done_epoch, epoch)
        self.line(text)

    def step(self, item: dict[str, Any], epochs: int) -> None:
        """Rank 0's progress within an epoch (``epoch``, ``images``, ``total``, ``seconds``,
        ``loss``) of a run of ``epochs``: redraws the bar; nothing in the other modes."""
        epoch = item.get("epoch", 0)
        if not self.redraws or epoch <= self._done_epoch:
            return
        if self._bar is None or epoch != self._bar_epoch:
            self._open_bar(epoch, epochs, item["total"])
        rate = item["images"] / item["seconds"] if item.get("seconds") else 0.0
        eta = (item["total"] - item["images"]) / rate if rate else 0.0
        self._bar.update(
            self._task,
            completed=item["images"],
            total=item["total"],
            rate=rate,
            eta=_duration(eta),
            loss=item["loss"],
        )
        self._bar.refresh()

    def close(self) -> None:
        self._close_bar()

    def _open_bar(self, epoch: int, epochs: int, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        self._close_bar()
        console = Console(file=self.stream, force_terminal=True, highlight=False)
        width = len(str(epochs))
        self._bar = Progress(
            TextColumn(f"epoch {epoch:>{max(3, width)}}/{epochs}"),
            BarColumn(bar_width=24),
            TextColumn("{task.completed:>7,.0f}/{task.total:,.0f} img"),
            TextColumn("{task.fields[rate]:>7,.0f} img/s"),
            TextColumn("ETA {task.fields[eta]}"),
            TextColumn("loss {task.fields[loss]:.4f}"),
            # Drawn when an update arrives (a few a second), never by a timer thread: the
            # driver shares the machine with the workers it is drawing.
            console=console,
            transient=True,
            auto_refresh=False,
            # Lines go through line(), which clears the bar first; rich must not swap
            # sys.stdout under other threads.
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self._task = self._bar.add_task("train", total=total, rate=0.0, eta="?", loss=0.0)
        self._bar_epoch = epoch
        self._bar.start()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class TrialsTable:
    """A search's events (``driver.searching.search``): on a terminal (``bar``) a table of
    the trials redrawn in place as they start, report and end; otherwise (``lines``) one
    line when a trial starts and one when it ends; ``off`` prints the end lines only. Other
    events (the search starting, its space) are their line in every mode. Pass it as the
    search's sink, and close it when the search returns."""

    def __init__(
        self, mode: str, searched: list[str], epochs: int, metric: str, stream: TextIO | None = None
    ) -> None:
        self._stream = stream
        self.mode = resolve_mode(mode, self.stream)
        _ray_prints_plain_unless_on(self.stream)
        self.searched, self.epochs, self.metric = searched, epochs, metric
        self.rows: dict[str, dict[str, Any]] = {}  # trial id -> its row, in start order
        self._live = None

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def __call__(self, event: Event) -> None:
        if isinstance(event, TrialStarted):
            self.start(event.trial_id, event.config, event.text)
        elif isinstance(event, TrialReported):
            self.result(event.trial_id, event.result)
        elif isinstance(event, TrialEnded):
            self.end(event.trial_id, event.how, event.text)
        elif self._live is not None:
            self._live.console.print(event.text, markup=False, highlight=False)
        else:
            self._print(event.text)

    def start(self, trial_id: str, values: dict[str, Any], text: str) -> None:
        self.rows[trial_id] = {"values": values, "status": "running", "epoch": 0, "result": {}}
        if self.mode == "lines":
            self._print(text)
        self._redraw()

    def result(self, trial_id: str, result: dict[str, Any]) -> None:
        row = self.rows.setdefault(
            trial_id, {"values": {}, "status": "running", "epoch": 0, "result": {}}
        )
        row["epoch"], row["result"] = result.get("epoch", row["epoch"]), result
        self._redraw()

    def end(self, trial_id: str, status: str, text: str) -> None:
        if trial_id in self.rows:
            self.rows[trial_id]["status"] = status
        if self.mode == "bar":
            self._redraw()
        else:
            self._print(text)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()  # the last table stays on screen
            self._live = None

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _table(self):
        from rich.table import Table

        table = Table(box=None, pad_edge=False, header_style="bold")
        for column in ["trial", *self.searched, "status", "epoch", "val_acc", "val_loss"]:
            table.add_column(column, justify="left" if column in ("trial", "status") else "right")
        for trial_id, row in self.rows.items():
            result = row["result"]
            acc, loss = result.get("val_accuracy"), result.get("val_loss")
            table.add_row(
                trial_id,
                *(_value(row["values"].get(n)) for n in self.searched),
                row["status"],
                f"{row['epoch']}/{self.epochs}",
                "" if acc is None else f"{100 * acc:.2f}%",
                "" if loss is None else f"{loss:.4f}",
            )
        return table

    def _redraw(self) -> None:
        if self.mode != "bar":
            return
        if self._live is None:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream, force_terminal=True, highlight=False)
            self._live = Live(
                self._table(),
                console=console,
                refresh_per_second=4,
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._live.start()
        else:
            self._live.update(self._table())


def _value(value: Any) -> str:
    return "" if value is None else format_value(value)
