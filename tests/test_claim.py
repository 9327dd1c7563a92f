"""One command at a time per run (driver/runs/claim.py), against the real things: a moto S3
server on loopback for the lease (a rival in its own PID namespace and with a skewed clock,
a store that drops requests, rivals whose writes land between a command's read and its
write, a real ``fit`` whose lease is taken), and the kernel's locks for a local run directory
(a second process, SIGKILL, what ``/proc`` says of the lock)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pyarrow.fs
import pytest

from raytrain_mnist.driver.runs import Run
from raytrain_mnist.driver.runs.claim import LEASE_TTL_S, LOCK_FILE, Lease, host_id
from raytrain_mnist.errors import UserError
from tests.conftest import (
    MARKER_VAR,
    REPO,
    kill_marked,
    no_process_left,
    run_cli_here,
    tiny_run_flags,
)


def _lease_path(run: Run) -> str:
    return f"{run.files.base.rpartition('/')[0]}/.{run.name}.lease"


def _read_lease(run: Run) -> dict | None:
    try:
        with run.files.filesystem.open_input_stream(_lease_path(run)) as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None


def _write_lease(run: Run, record: dict) -> bytes:
    payload = json.dumps(record).encode()
    with run.files.filesystem.open_output_stream(_lease_path(run)) as f:
        f.write(payload)
    return payload


def _in_own_pid_namespace() -> list[str]:
    """The words that start a command in a PID namespace of its own, as a container on this
    host would be (same hostname, same boot id, another process table)."""
    words = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    if shutil.which("unshare") is None or subprocess.run([*words, "true"]).returncode != 0:
        pytest.skip("unshare cannot make a PID namespace here")
    return words


# A claim from another process, whose clock is off by SKEW_S (its argv: storage, name,
# skew, then "hold" to hold the run until stdin closes).
CLAIMER = """
import json, os, sys, time
real = time.time
time.time = lambda: real() + float(sys.argv[3])
from raytrain_mnist.driver.runs import Run
from raytrain_mnist.driver.runs.claim import host_id
from raytrain_mnist.errors import UserError
started = time.monotonic()
try:
    with Run(sys.argv[1], sys.argv[2]).claim():
        print(json.dumps({"claimed": time.monotonic() - started, "host_id": host_id()}),
              flush=True)
        if sys.argv[4:] == ["hold"]:
            sys.stdin.read()
except UserError as exc:
    print(json.dumps({"refused": str(exc), "after_s": time.monotonic() - started}))
"""
HOURS_6 = 6 * 3600


def _claimer(storage: str, name: str, skew_s: float, *extra: str, prefix=()):
    return subprocess.Popen(
        [*prefix, sys.executable, "-c", CLAIMER, storage, name, str(skew_s), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )


# --------------------------------------------------------------------------- clocks, hosts


def test_a_rival_in_another_pid_namespace_with_a_skewed_clock_is_refused_while_the_owner_renews(
    s3,
):
    """The rival's clock runs six hours ahead (the owner's lease looks six hours old to it)
    and the owner's pid does not exist in its process table (same hostname): both misled the
    old lease into taking over. It is refused as soon as it sees a renewal."""
    storage, ns = s3(), _in_own_pid_namespace()
    owner = Run(storage, "r")
    with owner.claim():
        mine = _read_lease(owner)["token"]
        rival = _claimer(storage, "r", HOURS_6, prefix=ns)
        out, _ = rival.communicate(timeout=120)
        seen = json.loads(out)
        assert "renewed while this command watched" in seen.get("refused", ""), seen
        assert "'r' is already running" in seen["refused"]
        # Refused on a renewal (one every 3 s), never after watching out the TTL: the bound
        # is the TTL itself, whatever the load, not a guess at how fast a loaded store is.
        assert seen["after_s"] < LEASE_TTL_S
        assert _read_lease(owner)["token"] == mine
    assert _read_lease(owner) is None  # released
    # Free now: the same rival claims at once, and its host is not ours.
    rival = _claimer(storage, "r", HOURS_6, prefix=ns)
    seen = json.loads(rival.communicate(timeout=120)[0])
    assert seen["claimed"] < LEASE_TTL_S and seen["host_id"] != host_id(), seen


def test_a_lease_stamped_hours_ago_is_honoured_while_renewed_and_taken_over_once_it_stops(
    s3,
):
    """An owner in another PID namespace whose clock is six hours behind: its lease says it
    was renewed six hours ago, and is still honoured while it is renewed. Once the owner is
    killed, a rival takes over after watching the lease unchanged for the TTL on its own
    monotonic clock, and not before."""
    storage, ns = s3(), _in_own_pid_namespace()
    run = Run(storage, "r")
    owner = _claimer(storage, "r", -HOURS_6, "hold", prefix=ns)
    try:
        assert "claimed" in json.loads(owner.stdout.readline())
        record = _read_lease(run)
        assert record["renewed"] < time.time() - HOURS_6 + 60  # stamped by its clock
        assert record["host_id"] != host_id()
        with pytest.raises(UserError, match="renewed while this command watched"):
            Lease(run.files).acquire("run")
    finally:
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait()
    # Dead now: its lease stays as it was; a rival watching it for ttl_s takes it over.
    lease = Lease(run.files, ttl_s=4.0)
    started = time.monotonic()
    lease.acquire("run")
    try:
        assert time.monotonic() - started >= 4.0
        assert _read_lease(run)["token"] == lease.token
    finally:
        lease.release()
    assert _read_lease(run) is None


# --------------------------------------------------------------------------- a flaky store


class Flaky(pyarrow.fs.FileSystemHandler):
    """A pyarrow file system handler over the real S3 file system (for ``PyFileSystem``) that raises ECONNRESET on the next ``reads`` opens for reading and
    ``writes`` opens for writing, as a store that drops connections does. ``quiet`` is set
    when every armed failure has been raised, ``recovered`` by the first write after."""

    def __init__(self, fs) -> None:
        self.fs = fs
        self.reads = self.writes = self.raised = 0
        self.quiet, self.recovered = threading.Event(), threading.Event()
        self._lock = threading.Lock()

    def arm(self, reads: int = 0, writes: int = 0) -> None:
        with self._lock:
            self.reads, self.writes = reads, writes
            self.quiet.clear()
            self.recovered.clear()

    def _fail(self, kind: str) -> None:
        with self._lock:
            left = getattr(self, kind)
            if left <= 0:
                if kind == "writes" and self.quiet.is_set():
                    self.recovered.set()
                return
            setattr(self, kind, left - 1)
            self.raised += 1
            if self.reads == 0 and self.writes == 0:
                self.quiet.set()
        raise ConnectionResetError(errno.ECONNRESET, "injected: connection reset by peer")

    def open_input_stream(self, path):
        self._fail("reads")
        return self.fs.open_input_stream(path)

    def open_output_stream(self, path, metadata):
        self._fail("writes")
        return self.fs.open_output_stream(path, metadata=metadata)

    # The rest as the real file system does it.
    def get_type_name(self):
        return "flaky"

    def equals(self, other):
        return self is other

    def normalize_path(self, path):
        return self.fs.normalize_path(path)

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("not here")

    def delete_file(self, path):
        self.fs.delete_file(path)

    def move(self, src, dest):
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_file(self, path):
        return self.fs.open_input_file(path)

    def open_append_stream(self, path, metadata):
        return self.fs.open_append_stream(path, metadata=metadata)


def _flaky(run: Run) -> tuple[Flaky, pyarrow.fs.PyFileSystem]:
    handler = Flaky(run.files.filesystem)
    return handler, pyarrow.fs.PyFileSystem(handler)


def test_transient_store_errors_neither_lose_the_lease_nor_end_its_heartbeat(s3):
    run = Run(s3(), "r")
    run.files.check_writable()
    flaky, fs = _flaky(run)
    lost = threading.Event()
    lease = Lease(run.files, lambda reason: lost.set(), ttl_s=6.0, beat_s=0.2, filesystem=fs)
    flaky.arm(reads=2, writes=2)  # taking it: each call is retried
    lease.acquire("run")
    try:
        assert flaky.raised == 4 and _read_lease(run)["token"] == lease.token
        for reads, writes in [(0, 5), (5, 0), (3, 3)]:  # renewing it: the beat goes on
            flaky.arm(reads=reads, writes=writes)
            assert flaky.quiet.wait(30) and flaky.recovered.wait(30), flaky.__dict__
        assert flaky.raised == 4 + 5 + 5 + 6
        assert not lost.is_set()
        assert _read_lease(run)["token"] == lease.token
        with pytest.raises(UserError, match="'r' is already running"):
            Lease(run.files).acquire("run")  # a rival is still refused
    finally:
        lease.release()
    assert lease.beats >= 1 + 3  # taken, then renewed after each streak of errors
    assert _read_lease(run) is None  # released through the flaky store too


def test_renewals_failing_for_most_of_the_ttl_lose_the_lease_in_one_line(s3):
    run = Run(s3(), "r")
    run.files.check_writable()
    flaky, fs = _flaky(run)
    reasons: list[str] = []
    lost = threading.Event()

    def on_lost(reason: str) -> None:
        reasons.append(reason)
        lost.set()

    lease = Lease(run.files, on_lost, ttl_s=3.0, beat_s=0.2, filesystem=fs)
    lease.acquire("run")
    try:
        flaky.arm(writes=10**9)
        assert lost.wait(60)
        lost_at = time.monotonic()
        # Two thirds of the TTL after the last renewal that succeeded began: before a rival
        # may take it over. Measured from that renewal, not from the arming: their distance
        # grows with the store's round trips, which a loaded machine makes long.
        assert lost_at - lease.renewed_at >= lease.give_up_s
        assert lease.give_up_s == 2.0 and flaky.raised >= 3
        [reason] = reasons
        assert "could not renew the lease on run 'r'" in reason and "injected" in reason
        assert "\n" not in reason
    finally:
        flaky.arm()
        lease.release()


def test_a_lease_taken_by_another_token_is_lost_and_release_leaves_it(s3):
    run = Run(s3(), "r")
    reasons: list[str] = []
    lost = threading.Event()

    def on_lost(reason: str) -> None:
        reasons.append(reason)
        lost.set()

    run.files.check_writable()
    lease = Lease(run.files, on_lost, ttl_s=3.0, beat_s=0.2)
    lease.acquire("run")
    theirs = _write_lease(run, {"token": "rival", "pid": 4242, "host": "elsewhere"})
    assert lost.wait(30)
    assert reasons == [
        f"the lease on run 'r' ({lease.uri}) was taken by another command (pid 4242 on elsewhere)"
    ]
    lease.release()
    with run.files.filesystem.open_input_stream(_lease_path(run)) as f:
        assert f.read() == theirs  # not deleted, not rewritten


def test_release_deletes_only_its_own_lease(s3):
    """Released before its heartbeat has seen the other token: still left alone."""
    run = Run(s3(), "r")
    run.files.check_writable()
    lease = Lease(run.files, ttl_s=600.0)  # renews every minute: not before the release
    lease.acquire("run")
    theirs = _write_lease(run, {"token": "rival", "pid": 4242, "host": "elsewhere"})
    lease.release()
    with run.files.filesystem.open_input_stream(_lease_path(run)) as f:
        assert f.read() == theirs


# --------------------------------------------------------------------------- writes that race


class Landing:
    """What the :func:`landing` fixture yields. ``before(key)``, when set, runs in the moto
    server's thread just before a write of the object ``key`` lands (a PutObject, or the
    CompleteMultipartUpload that ends pyarrow's writes), before the store checks the write's
    conditions: another command's request can be put exactly there, or this one held back;
    a response (status, headers, body) it returns is the answer, and the write is not applied.
    ``answer(key, outcome)``, when set, sees how the store answered such a write (its HTTP
    status, or the code of the error it refused it with) and, for a write it applied, may
    return another response (status, headers, body) for the client to get instead. With
    ``ignore_conditions`` set the store drops ``If-Match`` and ``If-None-Match`` from every
    request, as an S3-compatible store without conditional writes may. ``deleting(key,
    headers)``, when set, sees each DeleteObject first and may answer it instead."""

    def __init__(self) -> None:
        self.before: Callable[[str], tuple | None] | None = None
        self.answer: Callable[[str, int | str], tuple | None] | None = None
        self.ignore_conditions = False
        self.deleting: Callable[[str, dict], tuple | None] | None = None


@pytest.fixture
def landing(s3, monkeypatch) -> Landing:
    """Hooks into the moto server of :func:`s3` (it runs in this process): the store itself
    still decides every write, its conditions included."""
    from moto.s3.responses import S3Response

    hooks, original = Landing(), S3Response._key_response

    def key_response(self, request, full_url):
        if hooks.ignore_conditions:
            from werkzeug.datastructures import Headers

            self.headers = Headers(self.headers)  # what moto reads the conditions from
            for name in ("If-Match", "If-None-Match"):
                self.headers.remove(name)
        query = parse_qs(urlparse(full_url).query, keep_blank_values=True)
        lands = (request.method == "PUT" and not {"uploadId", "partNumber"} & set(query)) or (
            request.method == "POST" and "uploadId" in query
        )
        if request.method == "DELETE" and hooks.deleting is not None:
            answer = hooks.deleting(self.parse_key_name(), dict(self.headers))
            if answer is not None:
                return answer
        if lands and hooks.before is not None:
            refused = hooks.before(self.parse_key_name())
            if refused is not None:
                return refused
        try:
            response = original(self, request, full_url)
        except Exception as exc:  # moto raises what it refuses: PreconditionFailed, NoSuchKey
            if lands and hooks.answer is not None:
                hooks.answer(self.parse_key_name(), getattr(exc, "code", type(exc).__name__))
            raise
        if lands and hooks.answer is not None:
            response = hooks.answer(self.parse_key_name(), response[0]) or response
        return response

    monkeypatch.setattr(S3Response, "_key_response", key_response)
    return hooks


def _key(run: Run) -> tuple[str, str]:
    """The lease's bucket and key."""
    bucket, _, key = _lease_path(run).partition("/")
    return bucket, key


def test_a_rival_lease_written_just_before_a_renewal_lands_is_kept_and_the_renewal_loses(
    s3, landing
):
    """The lost update seen for real in moto's log: the heartbeat had the lease as its own,
    the rival's PUT landed, then the heartbeat's PUT overwrote it, and both commands held the
    run for a beat. Now the renewal names the version it replaces: the store refuses it, the
    renewing command loses the claim in one line, and the rival's lease stays, byte for byte."""
    run = Run(s3(), "r")
    run.files.check_writable()
    bucket, key = _key(run)
    reasons: list[str] = []
    lost = threading.Event()

    def on_lost(reason: str) -> None:
        reasons.append(reason)
        lost.set()

    lease = Lease(run.files, on_lost, ttl_s=6.0, beat_s=0.2)
    lease.acquire("run")
    theirs = json.dumps({"token": "rival", "pid": 4242, "host": "elsewhere"}).encode()
    fired, written = threading.Event(), threading.Event()

    def rival_first(landing_key: str) -> None:
        if landing_key == key and not fired.is_set():
            fired.set()  # the rival's own PUT comes through here too
            s3.client.put_object(Bucket=bucket, Key=key, Body=theirs)
            written.set()

    landing.before = rival_first
    try:
        assert written.wait(30)  # held the next renewal's write until the rival's landed
        assert lost.wait(30)
        assert reasons == [
            f"the lease on run 'r' ({lease.uri}) was taken by another command "
            "(pid 4242 on elsewhere)"
        ]
        assert lease.store.conditional
    finally:
        landing.before = None
        lease.release()
    assert s3.client.get_object(Bucket=bucket, Key=key)["Body"].read() == theirs


def test_two_commands_taking_a_missing_lease_at_once_exactly_one_wins(s3, landing):
    """Both read "no lease"; the first write lands, and the second only after the first
    command has taken the run (later than any read-back could look). The store refuses the
    second: it is refused in one line, and the first command's lease is the one there."""
    run = Run(s3(), "r")
    run.files.check_writable()
    bucket, key = _key(run)
    both_wrote = threading.Barrier(2, timeout=30)  # each write comes after its own read
    first_took, arrived, lock = threading.Event(), [], threading.Lock()

    def one_after_the_other(landing_key: str) -> None:
        with lock:
            if landing_key != key or len(arrived) == 2:
                return
            arrived.append(landing_key)
            second = len(arrived) == 2
        both_wrote.wait()  # neither lands before both have read the store
        if second:
            assert first_took.wait(30)

    landing.before = one_after_the_other
    leases = [Lease(run.files, ttl_s=6.0, beat_s=0.2) for _ in range(2)]
    outcomes: dict[int, str] = {}

    def take(i: int) -> None:
        try:
            leases[i].acquire("run")
            outcomes[i] = "took it"
        except UserError as exc:
            outcomes[i] = str(exc)
        finally:
            first_took.set()

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    landing.before = None
    try:
        assert sorted(outcomes.values()) == [
            "run 'r' was claimed by another command at the same moment; wait for it, or "
            "pick another --name",
            "took it",
        ], outcomes
        [winner] = [leases[i] for i, said in outcomes.items() if said == "took it"]
        assert _read_lease(run)["token"] == winner.token
    finally:
        for lease in leases:
            lease.release()
    assert _read_lease(run) is None


def test_a_renewal_that_landed_but_whose_answer_was_lost_is_not_taken_for_a_rival(s3, landing):
    """The store applies a renewal and the answer is lost (here: a 500 instead of it); the
    client sends it again over the version it knew, and the store refuses that. The lease
    there is this command's own: it renews on, and a rival is still refused."""
    run = Run(s3(), "r")
    run.files.check_writable()
    bucket, key = _key(run)
    lost = threading.Event()
    lease = Lease(run.files, lambda reason: lost.set(), ttl_s=6.0, beat_s=0.2)
    lease.acquire("run")
    dropped, renewed = threading.Event(), threading.Event()
    outcomes: list[int | str] = []  # of the writes of the lease after the lost answer
    error = b"<Error><Code>InternalError</Code><Message>answer lost</Message></Error>"

    def lose_one_answer(landing_key: str, outcome: int | str):
        if landing_key != key:
            return None
        if not dropped.is_set():
            dropped.set()
            return 500, {"Content-Type": "application/xml"}, error
        outcomes.append(outcome)
        if outcomes.count(200) >= 2:  # renewed twice since
            renewed.set()
        return None

    landing.answer = lose_one_answer
    try:
        assert dropped.wait(30) and renewed.wait(30)
        # The same write sent again, refused by the store: the version it names is gone.
        assert outcomes[0] == "PreconditionFailed", outcomes
        assert not lost.is_set()
        assert _read_lease(run)["token"] == lease.token
        with pytest.raises(UserError, match="'r' is already running"):
            Lease(run.files).acquire("run")
    finally:
        landing.answer = None
        lease.release()
    assert _read_lease(run) is None


def test_store_errors_on_the_conditional_path_are_retried_and_never_lose_the_lease(s3, landing):
    """The store answers writes of the lease with 503 (not applied), while the lease is
    taken and then while it is renewed: both retry as they do through pyarrow, the
    heartbeat goes on, and no 503 is mistaken for a rival."""
    run = Run(s3(), "r")
    run.files.check_writable()
    _, key = _key(run)
    refusals, lock = [0], threading.Lock()
    quiet, lost = threading.Event(), threading.Event()
    slow_down = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"

    def refuse(landing_key: str):
        with lock:
            if landing_key != key or refusals[0] == 0:
                return None
            refusals[0] -= 1
            if refusals[0] == 0:
                quiet.set()
        return 503, {"Content-Type": "application/xml"}, slow_down

    def arm(n: int) -> None:
        with lock:
            refusals[0] = n
            quiet.clear()

    landing.before = refuse
    # The client backs off between its attempts (up to 3 s a call): the TTL leaves room.
    lease = Lease(run.files, lambda reason: lost.set(), ttl_s=30.0, beat_s=0.2)
    arm(4)  # more than the client's own three attempts: the lease's retries go on
    lease.acquire("run")
    try:
        assert quiet.is_set() and _read_lease(run)["token"] == lease.token
        arm(4)
        assert quiet.wait(30)
        beats = lease.beats
        deadline = time.monotonic() + 30
        while lease.beats < beats + 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lease.beats >= beats + 2 and not lost.is_set()
        assert _read_lease(run)["token"] == lease.token
    finally:
        landing.before = None
        lease.release()
    assert _read_lease(run) is None


def test_a_store_that_ignores_the_conditions_is_found_out_when_the_lease_is_taken(
    s3, landing, caplog
):
    """Once the lease is written, two writes the store must refuse are sent over it; a store
    that applies them gets the lease of a store without conditional writes (said once): read
    back, read before each renewal, so a rival's lease is still seen within a beat."""
    run = Run(s3(), "r")
    run.files.check_writable()
    landing.ignore_conditions = True
    lost = threading.Event()
    lease = Lease(run.files, lambda reason: lost.set(), ttl_s=6.0, beat_s=0.2)
    assert lease.store.conditional
    lease.acquire("run")
    try:
        assert not lease.store.conditional
        assert [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()] == [
            f"{run.files.root} ignores conditional writes: the lease {lease.uri} is read back "
            "and read before each renewal instead"
        ]
        assert _read_lease(run)["token"] == lease.token
        _write_lease(run, {"token": "rival", "pid": 4242, "host": "elsewhere"})
        assert lost.wait(30)
    finally:
        lease.release()
    assert _read_lease(run)["token"] == "rival"


def test_a_lease_taken_between_the_releases_read_and_its_delete_stays(s3, landing):
    """Release read the lease as its own; a rival's lands before the delete does. The
    delete names the version read: the store refuses it, and the rival's lease stays."""
    run = Run(s3(), "r")
    run.files.check_writable()
    bucket, key = _key(run)
    theirs = json.dumps({"token": "rival", "pid": 4242, "host": "elsewhere"}).encode()

    def rival_first(landing_key: str, headers: dict):
        if landing_key == key:
            landing.deleting = None
            s3.client.put_object(Bucket=bucket, Key=key, Body=theirs)
        return None

    lease = Lease(run.files, ttl_s=600.0)
    lease.acquire("run")
    landing.deleting = rival_first
    lease.release()
    assert landing.deleting is None  # the rival did write in between
    assert s3.client.get_object(Bucket=bucket, Key=key)["Body"].read() == theirs


@pytest.mark.parametrize("status", [501, 400])
def test_a_store_without_conditional_deletes_still_has_the_lease_deleted(s3, landing, status):
    """Release deletes its lease over the version it read; a store that answers that with
    501 (or 400) for the condition gets a plain delete, as before conditions existed."""
    run = Run(s3(), "r")
    run.files.check_writable()
    _, key = _key(run)
    conditional = []

    def no_conditions(landing_key: str, headers: dict):
        if landing_key == key and "If-Match" in headers:
            conditional.append(headers["If-Match"])
            return (
                status,
                {"Content-Type": "application/xml"},
                b"<Error><Code>NotImplemented</Code></Error>",
            )
        return None

    lease = Lease(run.files, ttl_s=600.0)
    lease.acquire("run")
    landing.deleting = no_conditions
    lease.release()
    assert len(conditional) == 1 and _read_lease(run) is None


def test_without_boto3_an_s3_lease_is_written_as_before_and_says_so(s3, monkeypatch, caplog):
    """No boto3 (the ``s3`` extra): the lease goes through pyarrow, unconditionally, read
    back after it is taken; one warning says what that costs."""
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 raises ImportError
    from raytrain_mnist.driver.runs import versioned

    monkeypatch.setattr(versioned, "_warned", set())
    run = Run(s3(), "r")
    run.files.check_writable()
    lease = Lease(run.files)
    assert not lease.store.conditional
    assert [r.getMessage() for r in caplog.records if "boto3" in r.getMessage()] == [
        f"boto3 is not installed: the lease on {run.files.root} is written without a "
        "conditional write, and two commands may both hold a run for a moment (pip install "
        "'raytrain-mnist[s3]')"
    ]
    lease.acquire("run")
    try:
        assert _read_lease(run)["token"] == lease.token
        with pytest.raises(UserError, match="'r' is already running"):
            Lease(run.files).acquire("run")
    finally:
        lease.release()
    assert _read_lease(run) is None


# --------------------------------------------------------------------------- a fit that loses it


def test_a_fit_whose_lease_is_taken_stops_in_one_line_and_keeps_its_checkpoint(
    s3,
    tiny_mnist,
    tmp_path,
):
    """A real fit on s3://: once its first epoch is committed, another command's token
    replaces its lease. The fit stops its workers as Ctrl-C does, says why in one line,
    writes nothing more into the run (it may be someone else's now) and leaves the
    other command's lease alone; the committed checkpoint stays."""
    import pyarrow.fs

    storage = s3()
    marker = uuid.uuid4().hex
    stderr = tmp_path / "stderr"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "raytrain_mnist", "fit", "--epochs", "100"),
                *tiny_run_flags(tiny_mnist, storage, "taken"),
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", MARKER_VAR: marker},
        )
    run = Run(storage, "taken")
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("epoch   1/100"):
                break
        else:
            raise AssertionError("".join(seen) + stderr.read_text())
        # Written once, whatever the fit's heartbeat is doing: its renewals name the version
        # they replace, so one in flight now is refused by the store, never lands over it.
        theirs = _write_lease(run, {"token": "rival", "pid": 4242, "host": "elsewhere"})
        out = "".join(seen) + proc.communicate(timeout=240)[0]
        err = stderr.read_text()
        assert proc.returncode == 130, out + err
        no_process_left(marker)  # the Ray the command started went with it
    finally:
        kill_marked(marker)
    said = [line for line in err.splitlines() if "the lease on run" in line]
    assert said == [
        f"the lease on run 'taken' ({storage}/.taken.lease) was taken by another command "
        "(pid 4242 on elsewhere): stopping the workers; the last committed checkpoint is kept"
    ], err
    assert "Traceback" not in err and "internal error" not in err
    assert "interrupted after" in err and "resume with: " in err
    assert run.summary() is None  # nothing written after the loss
    with run.files.filesystem.open_input_stream(_lease_path(run)) as f:
        assert f.read() == theirs
    checkpoint = run.latest_checkpoint()
    assert checkpoint is not None and checkpoint.startswith(f"{storage}/taken/checkpoint_")
    fs, path = pyarrow.fs.FileSystem.from_uri(f"{checkpoint}/state.pt")
    assert fs.get_file_info(path).type == pyarrow.fs.FileType.File


# --------------------------------------------------------------------------- local disks

HOLDER = """
import sys, time
from raytrain_mnist.driver.runs import Run
with Run(sys.argv[1], "r").claim() as run:
    run.write_json("run.json", {"x": 1})
    print("held", flush=True)
    time.sleep(600)
"""


def _names(pid: int, fd: str, path: Path) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}") == str(path)
    except OSError:  # closed meanwhile
        return False


def _tree(root: Path) -> dict:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_a_local_run_is_locked_on_a_file_open_for_writing_and_the_lock_dies_with_its_command(
    tmp_path,
):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert holder.stdout.readline() == "held\n"
        lock = tmp_path / "r" / LOCK_FILE
        [fd] = [fd for fd in os.listdir(f"/proc/{holder.pid}/fd") if _names(holder.pid, fd, lock)]
        info = Path(f"/proc/{holder.pid}/fdinfo/{fd}").read_text()
        # Opened for writing (NFSv4 and EFS refuse an exclusive lock on a read-only one),
        # and the kernel lists the flock on it.
        assert int(re.search(r"flags:\s+(\d+)", info)[1], 8) & os.O_ACCMODE == os.O_RDWR
        assert re.search(r"lock:.*FLOCK\s+ADVISORY\s+WRITE", info), info
        before = _tree(tmp_path)
        with pytest.raises(UserError, match=r"run 'r' is already running"):
            with Run(tmp_path, "r").claim():
                pass
        assert _tree(tmp_path) == before  # the refused command changed nothing
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        with Run(tmp_path, "r").claim() as run:  # the lock went with the killed command
            assert run.read_json("run.json") == {"x": 1}
            assert lock.is_file()
        assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["run.json"]
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_that_cannot_be_taken_is_one_line(tmp_path, tiny_mnist):
    (tmp_path / "r" / LOCK_FILE).mkdir(parents=True)
    with pytest.raises(UserError) as info:
        with Run(tmp_path, "r").claim():
            pass
    assert str(info.value) == f"cannot lock {tmp_path / 'r'}: Is a directory"
    result = run_cli_here(
        *("fit", "--storage-path", str(tmp_path), "--name", "r", "--dataset", "mnist"),
        *("--data-dir", str(tiny_mnist)),
    )
    assert result.returncode == 1, result
    assert result.stderr == f"raytrain-mnist: error: cannot lock {tmp_path / 'r'}: Is a directory\n"
    # A lock file that is a symbolic link is never followed (nor its target touched).
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    (tmp_path / "r" / LOCK_FILE).rmdir()
    (tmp_path / "r" / LOCK_FILE).symlink_to(outside)
    with pytest.raises(UserError, match=r"^cannot lock .*: Too many levels of symbolic links$"):
        with Run(tmp_path, "r").claim():
            pass
    assert outside.read_bytes() == b"keep"


def test_a_run_directory_that_is_a_planted_link_is_refused_in_one_line(tmp_path):
    """A run directory that is a symbolic link is never claimed through: nothing is made or
    locked where it points."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    storage = tmp_path / "runs"
    storage.mkdir()
    (storage / "r").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(
        UserError, match=r"r is a symbolic link; a run directory is never used"
    ) as info:
        with Run(storage, "r").claim():
            pass
    assert info.value.exit_code == 2 and "\n" not in str(info.value)
    assert list(elsewhere.iterdir()) == [] and (storage / "r").is_symlink()
