"""Run a blocking call on a helper thread so that Ctrl-C still reaches the main thread.

``trainer.fit()`` and ``tune.run()`` block for the whole run. Called on the main thread,
Ray installs its own SIGINT handler there (Train's exits the process without a word; Tune's
turns an early Ctrl-C into an analysis loaded from disk). Called off it, Ray installs none:
the main thread waits in :func:`relay`, turns Ctrl-C (or a reason to stop that ``watch``
reports, such as a lost claim) into one call of ``stop``, waits for the call to end, and
then hands back what the call returned or raised, as if it had run on the main thread::

    outcome = relay(trainer.fit, stop_the_run, name="trainer.fit", watch=lost_claim)
    if outcome.stopped is None:
        result = outcome.value

The caller owns what happens around it: ``stop`` decides how the run is stopped (abort
the controller, set Tune's stop flag); the thread never outlives :func:`relay` unless
``stop_wait_s`` ran out, and then :attr:`Relayed.finished` says so. A caller that shuts
Ray down afterwards must know the call has ended: a thread still inside ``ray.get`` when
``ray.shutdown()`` runs makes Ray's core worker end the process (exit 1).

The wait is on an event the thread sets as it ends, never on ``Thread.join``: in Python
3.11 a Ctrl-C that interrupts ``join`` marks the thread as ended while it still runs
(``is_alive()`` is False from then on, and every later ``join`` returns at once).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

#: What :attr:`Relayed.stopped` holds after Ctrl-C (``watch`` gives its own reason).
INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class Relayed(Generic[T]):
    """How a relayed call ended."""

    #: What the call returned (None when it raised, was stopped before returning, or is
    #: still running).
    value: T | None
    #: None: it ran to its end untouched. Else why ``stop`` was called:
    #: :data:`INTERRUPTED` (Ctrl-C) or the reason ``watch`` returned.
    stopped: str | None = None
    #: False only when ``stop_wait_s`` ran out with the call still running.
    finished: bool = True
    #: What the call raised after it was stopped (never raised then: a stopped run may
    #: end in an error of its own making, e.g. Ray's "actor died" once it was aborted).
    error: BaseException | None = None


def relay(
    call: Callable[[], T],
    stop: Callable[[str, Callable[[], bool]], object],
    *,
    name: str,
    watch: Callable[[], str | None] | None = None,
    stop_wait_s: float | None = None,
    poll_s: float = 0.5,
) -> Relayed[T]:
    """``call()`` on a daemon thread named ``name`` (in a copy of the caller's context, so
    context variables reach it), waited for on this thread.

    Ctrl-C while waiting, or ``watch()`` returning a reason (asked every ``poll_s`` s),
    calls ``stop(reason, running)`` once, on this thread: ``reason`` is :data:`INTERRUPTED`
    for Ctrl-C, ``running()`` whether the call is still under way. Then this
    waits for the call again, up to ``stop_wait_s`` seconds (None: until it ends; a second
    Ctrl-C then propagates as :class:`KeyboardInterrupt`). What the call raised is raised
    here when it was not stopped; when it was, it comes back as :attr:`Relayed.error`.
    """
    run = _Call(call)
    began, done = run.began, run.done
    reason = None
    try:
        # Started inside: a Ctrl-C while Thread.start() waits for the thread is one too.
        threading.Thread(target=run, name=name, daemon=True).start()
        while not done.wait(poll_s):
            if watch is not None and (reason := watch()) is not None:
                break
    except KeyboardInterrupt:
        if not began.wait(5):  # it came before the thread existed: there is nothing to stop
            raise
        reason = INTERRUPTED
    if reason is None:
        if run.error is not None:
            raise run.error
        return Relayed(run.value)
    stop(reason, lambda: not done.is_set())
    if stop_wait_s is None:
        while not done.wait(poll_s):
            pass
    else:
        done.wait(stop_wait_s)
    return Relayed(run.value, stopped=reason, finished=done.is_set(), error=run.error)


def on_a_thread(call: Callable[[], T], *, name: str) -> Callable[[], T]:
    """``call()`` started now on a daemon thread named ``name`` (in a copy of the caller's
    context); returns the function that waits for it to end, then returns what it returned
    or raises what it raised. The wait is on an event, as in :func:`relay`."""
    run = _Call(call)
    threading.Thread(target=run, name=name, daemon=True).start()

    def wait() -> T:
        run.done.wait()
        if run.error is not None:
            raise run.error
        return run.value  # type: ignore[return-value]

    return wait


class _Call(Generic[T]):
    """``call()`` as a thread runs it (the thread's target), in a copy of the context of the
    thread that made this: when it began and ended, and what it returned or raised."""

    def __init__(self, call: Callable[[], T]) -> None:
        self._call, self._context = call, contextvars.copy_context()
        self.began, self.done = threading.Event(), threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None

    def __call__(self) -> None:
        self.began.set()
        try:
            self.value = self._context.run(self._call)
        except BaseException as exc:  # handed to the waiting thread as is
            self.error = exc
        finally:
            self.done.set()
