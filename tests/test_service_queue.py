"""The service queue's long polls, in this process (no Ray: the queue is a plain class that
Ray runs as a threaded actor). A requester's state question and rank 0's cancel question
wait for news instead of being asked many times a second, and never take the threads that
the workers and the controller need."""

from __future__ import annotations

import threading

from raytrain_mnist.config import TrainConfig
from raytrain_mnist.driver.service.queue import (
    MAX_WAITERS,
    RUNNING,
    WAITING,
    ServiceQueue,
)
from tests.conftest import wait_for


def _queue(tmp_path) -> tuple[ServiceQueue, str]:
    queue = ServiceQueue({"name": "svc", "storage_roots": [str(tmp_path)]})
    request = {"train": TrainConfig(epochs=1).to_dict(), "storage": str(tmp_path), "name": "r",
               "resume_from": None, "progress": False, "compile": False,
               "cuda_graphs": "auto"}  # fmt: skip
    return queue, queue.submit(request, keep=2)["id"]


def _in_thread(call) -> tuple[threading.Thread, list]:
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(call()), daemon=True)
    thread.start()
    return thread, answer


def test_a_state_long_poll_answers_when_the_state_changes(tmp_path):
    queue, request_id = _queue(tmp_path)
    known = queue.state(request_id)
    assert known["state"] == WAITING and known["place"] == 1
    thread, answer = _in_thread(lambda: queue.state(request_id, known, wait_s=5.0))
    wait_for(lambda: queue._waiters == 1 or None, "the long poll to wait")
    assert not answer  # nothing changed yet
    queue.take(0.0)  # rank 0 takes it: running
    thread.join(timeout=4.0)
    assert answer and answer[0]["state"] == RUNNING and answer[0]["place"] is None


def test_a_cancel_wakes_rank_0s_question_at_once(tmp_path):
    queue, request_id = _queue(tmp_path)
    queue.take(0.0)
    assert queue.cancelled(request_id) is False
    thread, answer = _in_thread(lambda: queue.cancelled(request_id, wait_s=5.0))
    wait_for(lambda: queue._waiters == 1 or None, "the question to wait")
    queue.cancel(request_id, "cancelled (interrupted)")
    thread.join(timeout=4.0)
    assert answer == [True]


def test_long_polls_past_their_share_of_threads_answer_at_once(tmp_path):
    """With MAX_WAITERS long polls waiting, one more answers without waiting: the actor's
    other threads stay free for rank 0's take and put and the controller's filing."""
    queue, request_id = _queue(tmp_path)
    known = queue.state(request_id)
    waiting = [_in_thread(lambda: queue.state(request_id, known, wait_s=5.0))[0]
               for _ in range(MAX_WAITERS)]  # fmt: skip
    wait_for(lambda: queue._waiters == MAX_WAITERS or None, "every long poll to wait")
    assert queue.state(request_id, known, wait_s=5.0) == known
    assert all(t.is_alive() for t in waiting)  # it came back before any of them
    queue.cancel(request_id)
    for t in waiting:
        t.join(timeout=4.0)
    assert queue._waiters == 0
