"""The service queue's state machine, in this process (no Ray: the queue is a plain class
that Ray runs as a threaded actor): every transition of a request, the worker groups'
restarts and the poison bound, drain against cancel, lease expiry, the bound on waiting
requests, the workers' token, and the long polls that never take the threads the workers
need. Requests are real ones: their runs are claimed as ``fit --service`` claims them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from raytrain_mnist.config import TrainConfig
from raytrain_mnist.driver.runs import Run
from raytrain_mnist.driver.service import queue as queue_module
from raytrain_mnist.driver.service.queue import (
    CANCELLED,
    FAILED,
    FINISHED,
    MAX_REQUEST_FAILURES,
    MAX_WAITERS,
    RUNNING,
    WAITING,
    NotAWorker,
    ServiceQueue,
)
from raytrain_mnist.driver.service.request import write_claim
from raytrain_mnist.service_request import ServiceRequest
from tests.conftest import wait_for

TOKEN = "the-workers-secret"
JOB = "01000000"


class Service:
    """A queue as a service starts it (``groups`` of two workers, 600 training images),
    and the runs its requests train, claimed as ``fit --service`` claims them."""

    def __init__(self, root: Path, groups: int = 1, max_failures: int = 2) -> None:
        self.root = root
        self.dead: set[str] | None = set()  # what the GCS says of requesters
        info = {
            "name": "svc",
            "groups": groups,
            "num_workers": 2,
            "max_failures": max_failures,
            "data": {"train_size": 600},
            "storage_roots": [str(root.resolve())],
        }
        self.queue = ServiceQueue(info, TOKEN, lambda jobs: self.dead)
        self._claims = contextlib.ExitStack()
        self._claimed: set[str] = set()
        for g in range(groups):
            self.queue.group_started(TOKEN, g, 0.0, 2, "cpu")

    def request(self, name: str, **changes) -> dict:
        """A request for run ``name``, its claim held and its token written into it."""
        run = Run(str(self.root), name)
        if name not in self._claimed:
            self._claims.enter_context(run.claim())
            self._claimed.add(name)
        write_claim(run.files, f"claim-{name}")
        request = ServiceRequest(
            TrainConfig(epochs=1, batch_size=32),
            str(self.root),
            name,
            keep=2,
            claim=f"claim-{name}",
        )
        return {**request.to_dict(), **changes}

    def submit(self, name: str, **changes) -> str:
        answer = self.queue.submit(self.request(name, **changes), JOB)
        assert "id" in answer, answer
        return answer["id"]

    def state(self, request_id: str) -> str:
        return self.queue.state(request_id)["state"]


@pytest.fixture
def service(tmp_path) -> Iterator[Service]:
    made = Service(tmp_path)
    with made._claims:
        yield made


# --------------------------------------------------------------------------- transitions


def test_a_request_waits_runs_and_finishes(service):
    queue = service.queue
    first, second = service.submit("a"), service.submit("b")
    assert queue.state(second)["place"] == 2 and queue.info()["queue"] == 2
    handed = queue.take(TOKEN, 0, 0.0)
    assert handed["id"] == first and handed["name"] == "a" and handed["resume_from"] is None
    assert ServiceRequest.from_dict(handed).train == TrainConfig(epochs=1, batch_size=32)
    assert service.state(first) == RUNNING and queue.state(second)["place"] == 1
    assert queue.info()["in_flight"] == ["a"] and queue.info()["free_groups"] == 0
    queue.done(TOKEN, 0, first, FINISHED)
    assert service.state(first) == FINISHED
    info = queue.info()
    assert info["served"] == 1 and info["group_states"][0]["served"] == 1
    assert info["free_groups"] == 1 and info["in_flight"] == []
    _, items = queue.drain(first)
    assert [i.get("state") for i in items] == [RUNNING, FINISHED]


def test_a_failed_request_says_why_and_the_next_one_is_taken(service):
    queue = service.queue
    first, second = service.submit("a"), service.submit("b")
    queue.take(TOKEN, 0, 0.0)
    queue.done(TOKEN, 0, first, FAILED, "training diverged: the loss is nan")
    assert queue.state(first) == {
        "state": FAILED,
        "place": None,
        "epoch": 0,
        "error": "training diverged: the loss is nan",
    }
    assert queue.take(TOKEN, 0, 0.0)["id"] == second


def test_a_waiting_request_cancelled_never_runs(service):
    queue = service.queue
    first, second = service.submit("a"), service.submit("b")
    queue.cancel(first, "cancelled (interrupted)")
    assert queue.state(first)["error"] == "cancelled (interrupted)"
    assert service.state(first) == CANCELLED and queue.info()["queue"] == 1
    assert queue.take(TOKEN, 0, 0.0)["id"] == second


def test_a_running_request_cancelled_ends_with_its_reason(service):
    queue = service.queue
    request_id = service.submit("a")
    queue.take(TOKEN, 0, 0.0)
    assert queue.cancelled(TOKEN, request_id) is False
    queue.cancel(request_id, "cancelled (interrupted)")
    assert queue.cancelled(TOKEN, request_id) is True
    assert service.state(request_id) == RUNNING  # until the workers stop at the same step
    queue.done(TOKEN, 0, request_id, CANCELLED)
    assert queue.state(request_id)["error"] == "cancelled (interrupted)"
    assert service.state(request_id) == CANCELLED


def test_the_same_run_is_not_queued_twice(service):
    service.submit("a")
    again = service.queue.submit(service.request("a"), JOB)
    assert again == {"refused": "run 'a' is already queued or training"}


# --------------------------------------------------------------------------- restarts


def test_a_restarted_group_is_handed_its_request_again_from_the_checkpoint_filed_last(
    service,
):
    queue = service.queue
    request_id = service.submit("a")
    queue.take(TOKEN, 0, 0.0)
    checkpoint = service.root / "a" / "checkpoint_000001"
    checkpoint.mkdir()
    queue.filed(TOKEN, request_id, str(checkpoint))
    queue.group_failed(TOKEN, 0, "RayActorError: a worker died")
    queue.group_started(TOKEN, 0, 1.0, 2, "cpu")  # Ray Train restarted the group
    again = queue.take(TOKEN, 0, 0.0)
    assert again["id"] == request_id and again["resume_from"] == str(checkpoint.resolve())
    info = queue.info()
    assert info["restarts"] == 1 and info["failed"] is None
    assert service.state(request_id) == RUNNING


def test_a_filed_checkpoint_outside_its_run_is_refused(service):
    queue = service.queue
    request_id = service.submit("a")
    queue.take(TOKEN, 0, 0.0)
    (service.root / "b").mkdir()
    for path in ("/etc", str(service.root / "b" / "checkpoint_1"), f"{service.root}/a/../b/c"):
        with pytest.raises(ValueError, match="is not a checkpoint of run 'a'"):
            queue.filed(TOKEN, request_id, path)
    queue.group_started(TOKEN, 0, 1.0, 2, "cpu")
    assert queue.take(TOKEN, 0, 0.0)["resume_from"] is None


def test_a_poison_request_fails_alone_and_the_service_keeps_its_budget(tmp_path):
    """A request that fails its group MAX_REQUEST_FAILURES times fails with one line;
    the group takes the next request, and none of it was charged to the service."""
    service = Service(tmp_path, max_failures=0)
    with service._claims:
        queue = service.queue
        poison, good = service.submit("poison"), service.submit("good")
        for attempt in range(MAX_REQUEST_FAILURES):
            assert queue.take(TOKEN, 0, 0.0)["id"] == poison
            queue.group_failed(TOKEN, 0, "RuntimeError: boom")
            queue.group_started(TOKEN, 0, float(attempt + 1), 2, "cpu")
        state = queue.state(poison)
        assert state["state"] == FAILED
        assert state["error"] == (
            f"the request failed its worker group {MAX_REQUEST_FAILURES} times; "
            "the last time: RuntimeError: boom"
        )
        assert queue.take(TOKEN, 0, 0.0)["id"] == good
        assert queue.info()["failed"] is None and queue.info()["stopping"] is None


def test_restarts_with_no_request_to_blame_spend_the_services_budget(tmp_path):
    service = Service(tmp_path, max_failures=1)
    with service._claims:
        queue = service.queue
        queue.group_started(TOKEN, 0, 1.0, 2, "cpu")
        assert queue.info()["failed"] is None
        queue.group_failed(TOKEN, 0, "OSError: no space left on device")
        queue.group_started(TOKEN, 0, 2.0, 2, "cpu")
        failed = queue.info()["failed"]
        assert "failed 2 times with no request to blame (--max-failures 1)" in failed
        assert failed.endswith("the last time: OSError: no space left on device")
        assert queue.take(TOKEN, 0, 0.0) == "stop"
        assert queue.submit(service.request("late"), JOB) == {
            "refused": "service 'svc' is stopping"
        }


def test_two_groups_train_two_requests_at_once_and_a_restart_touches_one(tmp_path):
    service = Service(tmp_path, groups=2)
    with service._claims:
        queue = service.queue
        assert queue.info()["free_groups"] == 2 and queue.info()["ready"]
        a, b, c = service.submit("a"), service.submit("b"), service.submit("c")
        assert queue.take(TOKEN, 0, 0.0)["id"] == a
        assert queue.take(TOKEN, 1, 0.0)["id"] == b
        info = queue.info()
        assert info["free_groups"] == 0 and info["in_flight"] == ["a", "b"]
        assert [g["request"] for g in info["group_states"]] == ["a", "b"]
        queue.group_started(TOKEN, 1, 1.0, 2, "cpu")  # group 1 restarted under b
        assert queue.take(TOKEN, 1, 0.0)["id"] == b
        queue.done(TOKEN, 0, a, FINISHED)
        assert queue.take(TOKEN, 0, 0.0)["id"] == c  # the first free group
        groups = queue.info()["group_states"]
        assert [(g["restarts"], g["served"]) for g in groups] == [(0, 1), (1, 0)]


# --------------------------------------------------------------------------- stopping


def test_a_drain_serves_what_waits_then_stops(service):
    queue = service.queue
    first, second = service.submit("a"), service.submit("b")
    queue.take(TOKEN, 0, 0.0)
    queue.stop("drain")
    assert queue.submit(service.request("c"), JOB) == {"refused": "service 'svc' is stopping"}
    queue.done(TOKEN, 0, first, FINISHED)
    assert queue.take(TOKEN, 0, 0.0)["id"] == second
    queue.done(TOKEN, 0, second, FINISHED)
    assert queue.take(TOKEN, 0, 0.0) == "stop"


def test_a_cancel_after_a_drain_ends_the_requests_in_flight_and_waiting(service):
    queue = service.queue
    first, second = service.submit("a"), service.submit("b")
    queue.take(TOKEN, 0, 0.0)
    queue.stop("drain")
    queue.stop("cancel")
    assert queue.info()["stopping"] == "cancel"
    queue.stop("drain")  # a drain never undoes a cancel
    assert queue.info()["stopping"] == "cancel"
    assert queue.cancelled(TOKEN, first) is True
    assert queue.state(second) == {
        "state": CANCELLED,
        "place": None,
        "epoch": 0,
        "error": "the service stopped",
    }
    assert queue.take(TOKEN, 0, 0.0) == "stop"  # its group restarted as the service stops
    assert service.state(first) == CANCELLED


def test_a_request_the_stop_ended_ends_once_its_last_epoch_is_filed(service):
    """`service stop` mid-request: the workers end it at once, but the epoch they reported
    last is filed by the controller afterwards; the requester hears of the end only once
    every group has ended, so its summary holds that epoch."""
    queue = service.queue
    request_id = service.submit("a")
    queue.take(TOKEN, 0, 0.0)
    queue.stop("cancel")
    queue.done(TOKEN, 0, request_id, CANCELLED)
    assert service.state(request_id) == RUNNING and queue.info()["served"] == 1
    queue.put(TOKEN, request_id, {"epoch": 2})  # the controller's last commit
    queue.closed(TOKEN)
    assert queue.state(request_id) == {
        "state": CANCELLED,
        "place": None,
        "epoch": 2,
        "error": "the service stopped",
    }
    _, items = queue.drain(request_id)
    assert [i.get("epoch") for i in items][-2:] == [2, None]  # the epoch, then the end


# --------------------------------------------------------------------------- requesters


def test_a_silent_request_is_cancelled_once_its_requester_is_gone(service, monkeypatch):
    monkeypatch.setattr(queue_module, "REQUEST_LEASE_S", 0.0)
    queue = service.queue
    request_id = service.submit("a")
    queue.take(TOKEN, 0, 0.0)
    queue._jobs_asked = float("-inf")
    assert queue.cancelled(TOKEN, request_id) is False  # silent, but its job is alive
    service.dead = {JOB}
    queue._jobs_asked = float("-inf")
    assert queue.cancelled(TOKEN, request_id) is True
    queue.done(TOKEN, 0, request_id, CANCELLED)
    assert "its requester went silent" in queue.state(request_id)["error"]


def test_a_silent_request_is_cancelled_when_the_gcs_cannot_be_asked(service, monkeypatch):
    monkeypatch.setattr(queue_module, "REQUEST_LEASE_S", 0.0)
    request_id = service.submit("a")
    service.dead = None
    service.queue._jobs_asked = float("-inf")
    assert service.queue.take(TOKEN, 0, 0.0) is None  # cancelled while it waited
    assert service.state(request_id) == CANCELLED


@pytest.mark.parametrize("requester", [None, 7, "ffffffff"])
def test_a_requester_the_gcs_does_not_know_is_refused(service, requester):
    service.dead = {"ffffffff"}  # what the GCS answers of an id it does not know
    answer = service.queue.submit(service.request("a"), requester)
    assert answer["refused"].endswith("is no live Ray job on this cluster"), answer


def test_the_queue_refuses_past_its_bound(service, monkeypatch):
    monkeypatch.setattr(queue_module, "MAX_WAITING", 3)
    for name in "abc":
        service.submit(name)
    assert service.queue.submit(service.request("d"), JOB) == {
        "refused": "service svc is full: 3 requests waiting"
    }


@pytest.mark.parametrize(
    "call",
    [
        lambda q, t: q.take(t, 0, 0.0),
        lambda q, t: q.put(t, "x", {"epoch": 1}),
        lambda q, t: q.filed(t, "x", "/etc"),
        lambda q, t: q.done(t, 0, "x", FINISHED),
        lambda q, t: q.run_of(t, "x"),
        lambda q, t: q.cancelled(t, "x"),
        lambda q, t: q.group_started(t, 0, 0.0, 1, "cpu"),
        lambda q, t: q.group_failed(t, 0, "forged"),
    ],
)
@pytest.mark.parametrize("token", ["", "guess", None, TOKEN.upper(), "é" * 18, b"x"])
def test_the_workers_methods_answer_only_the_services_workers(service, call, token):
    service.submit("a")
    with pytest.raises(NotAWorker):
        call(service.queue, token)
    assert service.queue.info()["queue"] == 1


def test_a_queue_started_without_a_token_answers_no_worker(tmp_path):
    queue = ServiceQueue({"name": "svc", "storage_roots": [str(tmp_path)]})
    with pytest.raises(NotAWorker):
        queue.take("", 0, 0.0)


def test_info_answers_while_the_queue_is_busy(service):
    """``service status`` never waits for the lock: the GCS slow to answer a lease
    question, or a flood of calls, holds it."""
    service.submit("a")
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with service.queue._cond:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    held.wait(5)
    try:
        assert service.queue.info()["queue"] == 1
    finally:
        release.set()
        thread.join(5)


# --------------------------------------------------------------------------- long polls


def _in_thread(call) -> tuple[threading.Thread, list]:
    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(call()), daemon=True)
    thread.start()
    return thread, answer


def test_a_state_long_poll_answers_when_the_state_changes(service):
    queue = service.queue
    request_id = service.submit("a")
    known = queue.state(request_id)
    assert known["state"] == WAITING and known["place"] == 1
    thread, answer = _in_thread(lambda: queue.state(request_id, known, wait_s=5.0))
    wait_for(lambda: queue._waiters == 1 or None, "the long poll to wait")
    assert not answer  # nothing changed yet
    queue.take(TOKEN, 0, 0.0)  # rank 0 takes it: running
    thread.join(timeout=4.0)
    assert answer and answer[0]["state"] == RUNNING and answer[0]["place"] is None


def test_a_cancel_wakes_rank_0s_question_at_once(service):
    queue = service.queue
    request_id = service.submit("a")
    queue.take(TOKEN, 0, 0.0)
    thread, answer = _in_thread(lambda: queue.cancelled(TOKEN, request_id, wait_s=5.0))
    wait_for(lambda: queue._waiters == 1 or None, "the question to wait")
    queue.cancel(request_id, "cancelled (interrupted)")
    thread.join(timeout=4.0)
    assert answer == [True]


def test_long_polls_past_their_share_of_threads_answer_at_once(service):
    """With MAX_WAITERS long polls waiting, one more answers without waiting: the actor's
    other threads stay free for rank 0's take and put and the controller's filing."""
    queue = service.queue
    request_id = service.submit("a")
    known = queue.state(request_id)
    waiting = [
        _in_thread(lambda: queue.state(request_id, known, wait_s=5.0))[0]
        for _ in range(MAX_WAITERS)
    ]
    wait_for(lambda: queue._waiters == MAX_WAITERS or None, "every long poll to wait")
    assert queue.state(request_id, known, wait_s=5.0) == known
    assert all(t.is_alive() for t in waiting)  # it came back before any of them
    queue.cancel(request_id)
    for t in waiting:
        t.join(timeout=4.0)
    assert queue._waiters == 0


def test_a_stream_keeps_what_is_not_acknowledged(service):
    queue = service.queue
    request_id = service.submit("a")
    queue.take(TOKEN, 0, 0.0)
    for epoch in (1, 2):
        queue.put(TOKEN, request_id, {"epoch": epoch})
    dropped, items = queue.drain(request_id, 0)
    assert dropped == 0 and [i.get("epoch") for i in items] == [None, 1, 2]
    dropped, items = queue.drain(request_id, 2)
    assert dropped == 2 and [i.get("epoch") for i in items] == [2]
    assert queue.drain(request_id, 99)[0] == 3  # never past what it held
    assert queue.state(request_id)["epoch"] == 2


def test_status_shows_one_row_per_field_and_json_has_no_nan(service):
    """A stored field holding a line feed or an escape never forges a row of `service
    status`, and `--json` gets None where a number is not finite."""
    from raytrain_mnist.service import finite, format_status

    info = {**service.queue.info(), "name": "svc\nserved:       999", "logs": "\x1b[2Jx"}
    shown = format_status(info).splitlines()
    assert [line.split(":")[0] for line in shown].count("served") == 1
    assert "\x1b" not in format_status(info) and "^[[2Jx" in format_status(info)
    assert finite({"a": [float("nan"), 1.5], "b": float("inf")}) == {"a": [None, 1.5], "b": None}


def test_a_name_whose_service_still_runs_here_is_not_started_again(tmp_path, monkeypatch):
    """The registry entry of a running service (its process alive) refuses a second start
    of the name; an entry whose process is gone, or was reused, is a stale one."""
    import json
    import os

    import psutil

    from raytrain_mnist.driver.service.queue import registry_file
    from raytrain_mnist.driver.service.running import _check_not_registered
    from raytrain_mnist.errors import UserError

    monkeypatch.setenv("RAYTRAIN_MNIST_CACHE", str(tmp_path))
    entry = registry_file("svc")
    entry.parent.mkdir(parents=True)
    parent = psutil.Process(os.getppid())
    record = {"address": "127.0.0.1:1\n", "pid": parent.pid, "pid_started": parent.create_time()}
    entry.write_text(json.dumps(record))
    with pytest.raises(UserError, match="a service named 'svc' already runs on this machine"):
        _check_not_registered("svc")
    entry.write_text(json.dumps({**record, "pid_started": record["pid_started"] - 1}))
    _check_not_registered("svc")  # that pid is another process now
    _check_not_registered("other")


@pytest.mark.parametrize("name", ["../../etc", "a b", "", ".hidden", "x" * 201])
def test_the_library_refuses_a_service_name_in_the_words_of_the_command(name):
    """``ServiceSpec`` (the library call's way in) checks the name as ``service start
    --name`` does: it names the registry file and the queue actor."""
    from raytrain_mnist.driver.service.running import ServiceSpec
    from raytrain_mnist.errors import EXIT_USAGE, UserError

    with pytest.raises(UserError, match="is not a valid service name: use letters") as bad:
        ServiceSpec(name)
    assert bad.value.exit_code == EXIT_USAGE
    assert ServiceSpec("svc-2.a_b").name == "svc-2.a_b"


# --------------------------------------------------------------------------- the driver's watch


class _Watch:
    """The service driver's watch of its groups (``running._watch_groups``) on a thread,
    reading this queue's record; what it says, collected."""

    def __init__(self, queue: ServiceQueue) -> None:
        from raytrain_mnist.driver.service.running import _watch_groups

        self.said: list[str] = []
        self.looks = 0
        self.stopping = threading.Event()

        def info() -> dict:
            self.looks += 1
            return queue.info()

        emit = lambda event: self.said.append(event.text)  # noqa: E731
        self.thread = threading.Thread(
            target=_watch_groups, args=(info, emit, None, self.stopping), daemon=True
        )
        self.thread.start()

    def until_said(self, text: str) -> None:
        wait_for(lambda: True if any(text in s for s in self.said) else None, text, 10, 0.02)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "the watch outlived its stop"


def test_the_watch_says_ready_then_each_restart_and_ends_at_its_stop(tmp_path):
    """Ready once every group is, then each restart with the request it resumes; ended
    with the service, it asks the queue nothing more (a look after the service's Ray shut
    down would have Ray's auto-init join another Ray)."""
    service = Service(tmp_path, groups=2)
    watch = _Watch(service.queue)
    watch.until_said("ready: 2 group(s) of 2 worker(s) on cpu, waiting")
    request_id = service.submit("r")
    assert service.queue.take(TOKEN, 1, 0)["id"] == request_id
    service.queue.group_started(TOKEN, 1, 1.0, 2, "cpu")  # group 1's worker was lost
    watch.until_said("group 1 restarted (restart 1); request 'r' resumes from its last filed")
    watch.stop()
    assert len(watch.said) == 2 and watch.said[0].startswith("ready"), watch.said


def test_a_service_stopped_before_its_groups_are_ready_is_never_said_ready(tmp_path):
    queue = ServiceQueue({"name": "svc", "groups": 2, "storage_roots": [str(tmp_path)]}, TOKEN)
    queue.group_started(TOKEN, 0, 0.0, 2, "cpu")
    watch = _Watch(queue)
    wait_for(lambda: True if watch.looks else None, "the watch's first look", 10, 0.02)
    watch.stopping.set()  # Ctrl-C while group 1 still starts
    queue.group_started(TOKEN, 1, 0.0, 2, "cpu")
    watch.stop()
    assert watch.said == [], watch.said
