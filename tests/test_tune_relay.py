"""compat.tune_trial_relays_without_deadlock, on Ray Tune's own trial session class: the
trial's main thread relays the Train run's last report while the trial function's closing
result already fills the one-slot result queue (the hang seen 2026-12-05 in the S3 ASHA
test). With Ray's own methods the relay waits forever on that queue."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

from raytrain_mnist import compat


class _InterActorQueue:
    def __init__(self, items: list) -> None:
        self.items = items

    def get(self, block: bool, timeout: float):
        return self.items.pop(0)


def test_the_last_train_report_is_relayed_while_the_trials_closing_result_waits():
    from ray.train._internal.session import _TrainSession

    compat.tune_trial_relays_without_deadlock()
    session = object.__new__(_TrainSession)
    session.result_queue = queue.Queue(1)
    session.result_queue.put("closing")  # the function returned: Tune's RESULT_DUPLICATE
    session._inter_actor_queue = _InterActorQueue(["last epoch"])
    session.continue_lock, session.stop_event = threading.Lock(), threading.Event()
    session.continue_lock.acquire()  # as while the Train run trains: Ray's relay releases it
    # Ray's report() persists and then hands its result to _report_training_result.
    session.report = lambda metrics: session._report_training_result(
        SimpleNamespace(checkpoint=None, metrics=metrics)
    )
    got = []
    relay = threading.Thread(
        target=lambda: got.append(session._get_result_from_queues(block=True)), daemon=True
    )
    relay.start()
    relay.join(timeout=10)
    assert not relay.is_alive(), "the relay waits on the full result queue"
    assert got[0].metrics == "last epoch"  # the Train run's report first, then the closing one
    assert session.result_queue.get_nowait() == "closing"
    # Another thread's report (the trial function's own) still goes through the queue.
    session.result_queue, session.continue_lock = queue.Queue(1), threading.Lock()
    session._report_training_result(SimpleNamespace(checkpoint=None, metrics="own"))
    assert session.result_queue.get_nowait().metrics == "own"
