"""Live progress: a bar redrawn within each epoch on a terminal, whole lines otherwise.

The renderer is tested on its own (no Ray), fed the library's events; one in-process fit,
shown as the command shows it, writes to a pseudo-terminal on the shared local Ray, and the
piped case is the shared ``fitted`` run. The channel that carries the stream is tested for
the one thing the driver asks of it besides progress: the controller's handle, for Ctrl-C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pty
import re
import termios
import threading
import time

import pytest

from raytrain_mnist.console import Renderer, TrialsTable, resolve_mode
from raytrain_mnist.driver.events import EpochCommitted, Note, Phase, StepProgress, Stopping

_EPOCH = re.compile(r"^epoch +\d+/\d+ ", re.M)
_METRICS = {
    "train_loss": 0.5,
    "val_loss": 0.25,
    "val_accuracy": 0.9,
    "images_per_s": 1000.0,
    "epoch_time_s": 1.5,
}


def _epoch(epoch: int, epochs: int = 2) -> EpochCommitted:
    return EpochCommitted({"epoch": epoch, **_METRICS}, epochs)


def _steps(renderer: Renderer, epoch: int, n: int = 3) -> None:
    for i in range(1, n + 1):
        item = {
            "progress": "step",
            "epoch": epoch,
            "images": 100 * i,
            "total": 300,
            "seconds": 0.1 * i,
            "loss": 1.0 / i,
        }
        renderer(StepProgress(item, 2))  # drawn now: the bar has no refresh thread


_LINE = "epoch   1/2  train_loss 0.5000  val_loss 0.2500  val_acc  90.00%      1000 img/s     1.5 s"


def test_lines_mode_writes_whole_lines_only():
    out, err = io.StringIO(), io.StringIO()
    renderer = Renderer("auto", out, err)
    assert renderer.mode == "lines" and resolve_mode("auto", out) == "lines"
    renderer(Phase("data loaded", 3.14))
    renderer(Note("starting run 'x'"))
    _steps(renderer, 1, 2)
    renderer(_epoch(1))
    renderer(Stopping())
    renderer.close()
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert text == f"    3.1 s  data loaded\nstarting run 'x'\n{_LINE}\n", text
    assert err.getvalue() == (
        "\nCtrl-C: stopping the workers; the last committed checkpoint is kept\n"
    )


@pytest.mark.parametrize("sink", ["fit", "tune"])
def test_what_a_raylet_says_reaches_a_pipe_without_escapes(monkeypatch, sink):
    """Ray's listener thread prints a raylet's message to the driver (here the warning a
    loaded machine gets: workers slow to start) on sys.stdout, coloured unless told not to."""
    from ray._private.worker import print_to_stdstream

    monkeypatch.setenv("RAY_COLOR_PREFIX", "")
    monkeypatch.delenv("RAY_COLOR_PREFIX")  # unset here, restored after
    out = io.StringIO()
    if sink == "fit":
        Renderer("auto", out)
    else:
        TrialsTable("auto", ["lr"], 2, "val_accuracy", out)
    warning = "WARNING: 4 PYTHON worker processes have been started on node: n"
    with contextlib.redirect_stdout(out):
        print_to_stdstream({"lines": [warning], "pid": "raylet", "is_err": False}, False)
    assert out.getvalue() == f"(raylet) {warning}\n"


def test_off_mode_prints_epoch_lines_only():
    out = io.StringIO()
    renderer = Renderer("off", out)
    renderer(Phase("data loaded", 1.0))
    _steps(renderer, 1, 1)
    renderer(_epoch(1))
    assert out.getvalue() == f"{_LINE}\n"


def test_bar_mode_redraws_then_clears_before_the_epoch_line():
    out = io.StringIO()
    renderer = Renderer("bar", out)
    _steps(renderer, 1)
    renderer(_epoch(1))
    _steps(renderer, 1, 1)  # a late update for a committed epoch draws nothing
    renderer.close()
    text = out.getvalue()
    before, line, after = text.partition(f"{_LINE}\n")
    assert line and after == ""
    assert "\r" in before and "img/s" in before and "ETA" in before and "loss" in before
    assert "epoch   1/2" in before
    assert [n for n in (100, 200, 300) if f"{n:>7}/300 img" in before] == [100, 200, 300]


def test_trials_table_lines_and_bar():
    out = io.StringIO()
    table = TrialsTable("lines", ["lr"], 2, "val_accuracy", out)
    table.start("a", {"lr": 0.1}, "trial a started: lr=0.1")
    table.result("a", {"epoch": 1, "val_accuracy": 0.9, "val_loss": 0.3})
    table.end("a", "finished", "trial a finished")
    assert out.getvalue() == "trial a started: lr=0.1\ntrial a finished\n"

    out = io.StringIO()
    table = TrialsTable("bar", ["lr"], 2, "val_accuracy", out)
    table.start("a", {"lr": 0.1}, "")
    time.sleep(0.3)
    table.result("a", {"epoch": 1, "val_accuracy": 0.9, "val_loss": 0.3})
    time.sleep(0.3)
    table.end("a", "finished", "")
    table.close()
    text = out.getvalue()
    assert "\r" in text and "90.00%" in text and "finished" in text


def test_piped_fit_prints_phase_lines_and_no_carriage_return(fitted):
    out = fitted["out"]
    drawn = [line for line in out.split("\n") if "\r" in line or "\x1b" in line]
    assert not drawn, "\n".join(map(repr, drawn))
    first_epoch = _EPOCH.search(out).start()
    phases = re.findall(r"^ +\d+\.\d s  (.+)$", out[:first_epoch], re.M)
    assert "workers starting" in phases and "first step" in phases, out[:first_epoch]


def test_fit_on_a_terminal_redraws_a_bar_during_an_epoch(fitted, tmp_path, monkeypatch):
    """The shared run's settings, one worker, as the command shows them on a
    pseudo-terminal."""
    from raytrain_mnist.config import RunSettings
    from raytrain_mnist.fit import fit_and_show

    monkeypatch.setenv("TERM", "xterm")
    cfg = fitted["cfg"]
    cfg = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, epochs=2),
        run=RunSettings.from_flags(
            **{**cfg.run.to_dict(), "num_workers": 1, "name": "tty", "storage_path": str(tmp_path)}
        ),
    )
    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.ONLCR  # no "\r" added to each "\n": every one seen is the bar's
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    received = bytearray()

    def drain():
        with contextlib.suppress(OSError):
            while chunk := os.read(master, 65536):
                received.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with open(slave, "w", buffering=1, closefd=True) as terminal:
        with contextlib.redirect_stdout(terminal):
            result = fit_and_show(cfg)
    reader.join(10)
    os.close(master)
    text = received.decode(errors="replace")
    assert result.status == "finished"
    during = text[: text.index("epoch   1/2  train_loss")]
    assert re.search("\r[^\n]", during) and "img/s" in during, during[-2000:]
    assert "first step" in during


class _Controller:
    """Stands in for the Train controller: it announces itself as the controller's callback
    does, and records the abort that stops the run."""

    def __init__(self, channel) -> None:
        from raytrain_mnist.driver.monitor import announce_controller

        announce_controller(channel)
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def was_aborted(self) -> bool:
        return self.aborted


def test_a_stop_reaches_the_controller_through_a_channel_that_never_imports_its_class(
    ray_local,
):
    """The channel keeps the controller's handle pickled: unpickling it would import the
    class's module in the channel's process (for the real controller, Ray Train, pandas and
    Ray Data: seconds of CPU in every run). The driver unpickles it and aborts the run."""
    from raytrain_mnist.driver.monitor import abort_run, start_channel
    from tests.conftest import imported

    ray = ray_local
    channel = start_channel()
    controller = ray.remote(num_cpus=0)(_Controller).remote(channel)
    try:
        abort_run(channel, is_running=lambda: True)
        assert ray.get(controller.was_aborted.remote(), timeout=60)
        assert not ray.get(channel.__ray_call__.remote(imported, __name__), timeout=60)
    finally:  # the shared Ray outlives this test
        ray.kill(controller)
        ray.kill(channel)
