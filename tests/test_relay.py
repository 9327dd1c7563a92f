"""driver.relay: a blocking call on a helper thread, Ctrl-C and a watched reason to stop
relayed to the caller's stop callback, the call's own result or exception handed back."""

from __future__ import annotations

import _thread
import contextvars
import threading

import pytest

from raytrain_mnist.driver.relay import INTERRUPTED, relay

_WHO = contextvars.ContextVar("who", default="nobody")


def _never(reason, running):
    raise AssertionError(f"stopped: {reason}")


def test_the_calls_result_and_context_come_back():
    token = _WHO.set("caller")
    try:
        outcome = relay(lambda: (_WHO.get(), threading.current_thread().name), _never, name="job")
    finally:
        _WHO.reset(token)
    assert outcome.value == ("caller", "job") and outcome.stopped is None and outcome.finished


def test_the_calls_exception_is_raised_on_the_waiting_thread():
    def fails():
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        relay(fails, _never, name="job")


def test_ctrl_c_calls_stop_once_and_waits_for_the_call_to_end():
    started, release, stops = threading.Event(), threading.Event(), []

    def call():
        started.set()
        assert release.wait(60)
        raise RuntimeError("the actor died")  # what an aborted run raises

    def interrupt():
        assert started.wait(60)
        _thread.interrupt_main()  # Ctrl-C, as the main thread receives it

    threading.Thread(target=interrupt, daemon=True).start()

    def stop(why, running):
        stops.append((why, running()))  # Ctrl-C ended the wait, not the call
        release.set()

    outcome = relay(call, stop, name="job", poll_s=0.05)
    assert stops == [(INTERRUPTED, True)] and outcome.stopped == INTERRUPTED and outcome.finished
    assert isinstance(outcome.error, RuntimeError) and outcome.value is None


def test_a_watched_reason_stops_the_call_and_a_bounded_wait_says_it_is_still_running():
    lost, stops, release = threading.Event(), [], threading.Event()
    threading.Timer(0.2, lost.set).start()
    outcome = relay(
        lambda: release.wait(60),
        lambda why, running: stops.append(why),
        name="job",
        watch=lambda: "the claim was lost" if lost.is_set() else None,
        stop_wait_s=0.1,
        poll_s=0.05,
    )
    release.set()
    assert stops == ["the claim was lost"] and outcome.stopped == "the claim was lost"
    assert not outcome.finished and outcome.value is None
