"""`python -m raytrain_mnist.submit` against a real Ray head with token authentication.

One head for the module: `ray start --head --block` on free ports, dashboard on 127.0.0.1,
token auth on with a token file in a temporary directory (never ~/.ray/auth_token), its
session under that directory too (so no other Ray on this machine finds it). Every process
of that head carries a marker in its environment; the fixture kills whatever carries the
marker (`ray start --block`, its node, the job drivers), and nothing else: no `ray stop`,
which would stop every Ray on the machine. One test joins a node offering `job_driver` to
the head for its own length (where a job's driver runs: tests/test_job_placement.py's
question, asked here rather than of a Ray cluster of its own).
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from raytrain_mnist import submit
from raytrain_mnist.driver import jobs
from raytrain_mnist.errors import EXIT_INTERRUPTED, UserError
from raytrain_mnist.nn import checkpoint as ckpt
from raytrain_mnist.nn.model import ConvNet
from raytrain_mnist.serving.settings import TOKEN_ENV, TokenHash

from .conftest import MARKER_VAR, REPO, free_ports, kill_marked, tiny_run_flags, write_tiny_mnist

RAY = str(Path(sys.executable).with_name("ray"))


def run_submit(*args: str, env: dict, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "raytrain_mnist.submit", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        **kw,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode not in (0, None), proc
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("raytrain-mnist"), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def client_env(head, **extra) -> dict:
    """A client's environment: no token unless given, no address, a HOME without a token."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "RAY_AUTH_MODE",
            "RAY_AUTH_TOKEN",
            "RAY_AUTH_TOKEN_PATH",
            "RAY_ADDRESS",
            "RAY_API_SERVER_ADDRESS",
        )
    }
    env["HOME"] = str(head["home"])
    env.update(extra)
    return env


# --------------------------------------------------------------------------- the head


@pytest.fixture(scope="module")
def head(sample_digits):
    root = Path(tempfile.mkdtemp(prefix="rtsub", dir="/tmp"))  # short: Ray's socket paths
    marker = uuid.uuid4().hex
    token = secrets.token_hex(32)
    (root / "token").write_text(token)
    (root / "home").mkdir()
    gcs, dashboard, client, agent, metrics = free_ports(5)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN")
    }
    env.update(
        {
            MARKER_VAR: marker,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(root / "token"),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
            # Single-node mode keeps --node-ip-address=127.0.0.1 (Ray swaps a loopback node IP
            # for the machine's address otherwise) and with it every server on loopback.
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        }
    )
    log = open(root / "ray_start.log", "w")
    proc = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            f"--ray-client-server-port={client}",
            f"--dashboard-agent-listen-port={agent}",
            f"--metrics-export-port={metrics}",
            "--num-cpus=2",
            "--num-gpus=0",
            f"--temp-dir={root / 'ray'}",
            "--disable-usage-stats",
            "--include-dashboard=true",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_for_jobs_api(url, token, proc, root / "ray_start.log")
        deadline = time.monotonic() + 90
        while not (head_node := [n for n in _nodes(url, token) if n.get("is_head_node")]):
            assert time.monotonic() < deadline, _nodes(url, token)  # the state API lists it
            time.sleep(0.5)
        yield {
            "env": env,
            "node_id": head_node[0]["node_id"],
            "url": url,
            "gcs": f"127.0.0.1:{gcs}",
            "token": token,
            "token_path": root / "token",
            "root": root,
            "home": root / "home",
            "data": write_tiny_mnist(root / "data", sample_digits),
        }
    finally:
        kill_marked(marker)  # `ray start`, its node, the job drivers: ours, and only ours
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def _wait_for_jobs_api(url: str, token: str, proc, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(
        f"{url}/api/jobs/", headers={"Authorization": f"Bearer {token}"}
    )
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"ray start --head exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the Jobs API at {url} did not come up in {timeout} s:\n{log.read_text()[-3000:]}")


def fit_args(head, tmp_path, name: str, *extra: str) -> list[str]:
    runs = tmp_path / "runs"
    return [
        "--",
        "fit",
        *tiny_run_flags(head["data"], runs, name, *extra, cpus_per_worker=1, epochs=1),
    ]


# --------------------------------------------------------------------------- tests on the head


def test_token_is_required_and_checked_and_addresses_fail_fast(head):
    # No token at all: 401, one line.
    proc = run_submit("--address", head["url"], "list", env=client_env(head))
    assert_one_line_error(proc, "requires a token", "401")
    # A wrong token (RAY_AUTH_TOKEN without RAY_AUTH_MODE: the client turns token mode on).
    proc = run_submit(
        "--address", head["url"], "list", env=client_env(head, RAY_AUTH_TOKEN="0" * 64)
    )
    assert_one_line_error(proc, "refused the token", "403")
    # No cluster at the address: one line, in seconds.
    (closed,) = free_ports(1)
    started = time.monotonic()
    proc = run_submit("--address", f"http://127.0.0.1:{closed}", "list", env=client_env(head))
    assert_one_line_error(proc, "no Ray dashboard answers")
    assert time.monotonic() - started < 20
    # The right token through RAY_AUTH_TOKEN_PATH, with the address from RAY_ADDRESS.
    proc = run_submit(
        "list",
        env=client_env(head, RAY_AUTH_TOKEN_PATH=str(head["token_path"]), RAY_ADDRESS=head["url"]),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("job ")


def test_bf16_fit_job_is_followed_to_success_and_ctrl_c_detaches(head, tmp_path):
    token_env = client_env(head, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=head["token"])
    # The plain Ray CLI form, documented in docs/cluster.md, submitted without waiting: the same
    # working-dir upload and entry point, asked only for its help (one fit job is enough).
    plain = subprocess.run(
        [
            RAY,
            "job",
            "submit",
            "--address",
            head["url"],
            "--working-dir",
            str(REPO),
            "--no-wait",
            "--",
            "python",
            "-m",
            "raytrain_mnist.fit",
            "--help",
        ],
        env=token_env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert plain.returncode == 0, plain.stderr + plain.stdout
    plain_id = re.search(r"(raysubmit_\w+)", plain.stdout + plain.stderr).group(1)

    # Our client, following its job to the end.
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        followed = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "raytrain_mnist.submit",
                "--address",
                head["url"],
                *fit_args(
                    head, tmp_path, "followed", "--epochs", "3", "--lr", "0.05", "--amp", "bf16"
                ),
            ],
            env=client_env(
                head, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(head["token_path"])
            ),
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
        )
    deadline = time.monotonic() + 120
    while not (submitted := re.search(r"submitted (raysubmit_\w+)", err.read_text())):
        assert followed.poll() is None and time.monotonic() < deadline, err.read_text()
        time.sleep(0.2)
    job_id = submitted.group(1)

    # Meanwhile, Ctrl-C on a second client following the same job, with no terminal: it
    # detaches, says how to stop the job, and the job goes on.
    detach = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "raytrain_mnist.submit",
            "--address",
            head["url"],
            "logs",
            "--follow",
            job_id,
        ],
        env=token_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
    )
    assert detach.stderr.readline().startswith(f"following job {job_id}")
    time.sleep(1)
    detach.send_signal(signal.SIGINT)
    _, detach_err = detach.communicate(timeout=30)
    assert detach.returncode == EXIT_INTERRUPTED, detach_err
    assert "detached" in detach_err and f"stop {job_id}" in detach_err, detach_err
    assert "Traceback" not in detach_err

    assert followed.wait(timeout=240) == 0, err.read_text()[-3000:] + out.read_text()[-3000:]
    assert "val_accuracy" in out.read_text()  # the job's own output, streamed
    assert f"job {job_id} succeeded" in err.read_text()
    # All of it, once: followed to the job's end (its status, not Ray's slower end of the
    # stream), then the rest of the log.
    logs = run_submit("--address", head["url"], "logs", job_id, env=token_env)
    assert logs.returncode == 0 and logs.stdout == out.read_text(), logs.stderr
    summary = json.loads((tmp_path / "runs" / "followed" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["val_total"] == 203
    # bf16 autocast on CPU trains: the loss falls, the accuracy is far above chance (0.1).
    assert summary["config"]["train"]["amp"] == "bf16"
    losses = [h["train_loss"] for h in summary["history"]]
    assert losses[-1] < losses[0] and summary["val_accuracy"] > 0.5, summary["history"]

    # The plain job finished too; following it now returns its outcome and output at once.
    proc = run_submit(
        "--address", head["url"], "logs", "--follow", plain_id, env=token_env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    assert "--num-workers" in proc.stdout, proc.stdout[-2000:]

    proc = run_submit("--address", head["url"], "status", job_id, env=token_env)
    assert proc.returncode == 0 and f"{job_id}: SUCCEEDED" in proc.stdout, proc.stderr
    # What the job ran in, as the head unpacked it: the allow-list and nothing else.
    uploaded = _uploaded_files(head, job_id)
    assert {"pyproject.toml", "README.md", "raytrain_mnist/fit.py"} <= uploaded, uploaded
    assert all(
        name in jobs.UPLOAD_FILES
        or (name.startswith("raytrain_mnist/") and name.endswith(jobs.PACKAGE_SUFFIXES))
        for name in uploaded
    ), sorted(uploaded)
    proc = run_submit("--address", head["url"], "list", env=token_env)
    assert proc.returncode == 0 and job_id in proc.stdout and plain_id in proc.stdout
    proc = run_submit("--address", head["url"], "status", "raysubmit_nope", env=token_env)
    assert_one_line_error(proc, "no job 'raysubmit_nope'")


def _get(url: str, token: str, path: str) -> str:
    """What the head's dashboard at ``url`` answers at ``path``, as it sends it."""
    request = urllib.request.Request(f"{url}{path}", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read().decode()


def _jobs_api(head, path: str) -> str:
    """What the Jobs API answers at ``path``, as it sends it."""
    return _get(head["url"], head["token"], path)


def _working_dir(head, job_id: str) -> Path:
    """A job's working directory, unpacked on the head."""
    info = json.loads(_jobs_api(head, f"/api/jobs/{job_id}"))
    uri = info["runtime_env"]["working_dir"]  # gcs://_ray_pkg_<hash>.zip
    package = uri.removeprefix("gcs://").removesuffix(".zip")
    found = (head["root"] / "ray").glob(f"session_*/runtime_resources/*/{package}")
    (folder,) = {path.resolve() for path in found}  # session_latest links to the session
    return folder


def _uploaded_files(head, job_id: str) -> set[str]:
    """The files of a job's working directory on the head (Python's __pycache__ aside)."""
    folder = _working_dir(head, job_id)
    return {
        path.relative_to(folder).as_posix()
        for path in folder.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


#: A job that prints, and fails with, a terminal's window-title sequence (OSC) and a CSI one.
_HOSTILE = "\x1b]0;pwned\x07\x1b[2J"
_SUBMIT_RAW = """
import json, sys
from ray.job_submission import JobSubmissionClient

env = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
print(JobSubmissionClient(sys.argv[1]).submit_job(entrypoint=sys.argv[2], runtime_env=env))
"""
#: A serve token for the tests (never a real one).
SERVE_TOKEN = "serve-test-token-" + "Qw7z" * 6


def test_text_from_the_cluster_is_printed_with_control_characters_shown(head):
    env = client_env(head, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(head["token_path"]))
    entry = f"echo 'hostile {_HOSTILE}'; echo 'last {_HOSTILE}' >&2; exit 3"
    submitted = subprocess.run(
        [sys.executable, "-c", _SUBMIT_RAW, head["url"], entry],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().splitlines()[-1]
    shown = "^[]0;pwned^G^[[2J"
    followed = run_submit("--address", head["url"], "logs", "--follow", job_id, env=env)
    assert followed.returncode == 1, followed.stderr
    for proc in (
        followed,
        run_submit("--address", head["url"], "logs", job_id, env=env),
        run_submit("--address", head["url"], "status", job_id, env=env),
        run_submit("--address", head["url"], "list", env=env),
    ):
        assert "\x1b" not in proc.stdout + proc.stderr and "\x07" not in proc.stdout + proc.stderr
        assert shown in proc.stdout + proc.stderr, proc
    assert f"hostile {shown}" in followed.stdout
    # The failed job's cause is the last line of Ray's job message, which carries the logs
    # Ray had collected when the job ended (sometimes only its first line): shown, not obeyed.
    cause = followed.stderr.splitlines()[-1]
    assert cause.startswith(f"raytrain-mnist: error: job {job_id} failed (exit code 3)"), cause
    assert "\x1b" not in cause and "\x07" not in cause


@pytest.mark.parametrize(
    "text, shown",
    [
        ("\x1b]0;pwned\x07", "^[]0;pwned^G"),  # OSC: set the window title
        ("\x1b[2J\x1b[31mred", "^[[2J^[[31mred"),  # CSI: clear the screen, colours
        ("\x9b2J", "\\x9b2J"),  # the one-byte CSI of the C1 set
        ("ok\rfake", "ok^Mfake"),  # a carriage return overwrites the line
        ("\x00\x08\x7f", "^@^H^?"),
        ("abc\u202edef", "abc\\u202edef"),  # a right-to-left override reorders the line
        ("two\nlines\tand a tab", "two\nlines\tand a tab"),
        ("plain text, üñí", "plain text, üñí"),
    ],
)
def test_printable_shows_control_characters(text, shown):
    assert submit.printable(text) == shown
    assert "\n" not in submit.printable("a\nb\tc", lines=False)


class _Job:
    def __init__(self, **fields):
        self.__dict__.update(fields)


class _HostileClient:
    """The Jobs API's answers, as a compromised job or cluster could make them."""

    def list_jobs(self):
        return [
            _Job(
                submission_id="raysubmit_1",
                job_id=None,
                status="SUCCEEDED",
                start_time=0,
                entrypoint=f"python -m x {_HOSTILE}\nraysubmit_2 SUCCEEDED fake row",
            )
        ]

    def get_job_info(self, job_id):
        return _Job(status="FAILED", message=f"exit code 3\nlast {_HOSTILE}")

    def get_job_status(self, job_id):
        from ray.job_submission import JobStatus

        return JobStatus.FAILED

    def get_job_logs(self, job_id):
        return f"log {_HOSTILE}\n"


def test_list_status_logs_and_outcome_escape_what_the_cluster_says(capsys):
    client = _HostileClient()
    submit.list_jobs(client, "http://h:8265")
    submit.status(client, "http://h:8265", "raysubmit_1")
    submit.logs(client, "http://h:8265", "raysubmit_1", keep_following=False)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    rows = out.splitlines()
    assert rows[1].endswith("python -m x ^[]0;pwned^G^[[2J^Jraysubmit_2 SUCCEEDED fake row")
    assert len(rows) == 4 and rows[2] == "raysubmit_1: FAILED  last ^[]0;pwned^G^[[2J"
    assert rows[3] == "log ^[]0;pwned^G^[[2J"
    with pytest.raises(UserError) as info:
        submit.outcome(client, "http://h:8265", "raysubmit_1", "FAILED")
    # The error holds the cluster's text as it is; the CLI prints every error escaped.
    assert submit.printable(str(info.value)) == (
        "job raysubmit_1 failed (exit code 3): last ^[]0;pwned^G^[[2J"
    )


def test_failed_job_exits_non_zero_and_bad_flags_never_reach_the_cluster(head, tmp_path):
    env = client_env(head, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(head["token_path"]))
    # Fails on the cluster: the data directory is empty there.
    proc = run_submit(
        "--address",
        head["url"],
        *fit_args(head, tmp_path, "broken")[:-2],
        "--data-dir",
        str(tmp_path / "empty"),
        "--name",
        "broken",
        env=env,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 3, proc.stderr  # submitted, following, the outcome
    assert re.fullmatch(
        r"raytrain-mnist: error: job raysubmit_\w+ failed \(exit code 2\): "
        r"--data-dir .*empty is not a directory.*",
        lines[-1],
    ), proc.stderr

    # Refused here, before any upload: exit 2 and fit's own message.
    proc = run_submit(
        "--address", head["url"], *fit_args(head, tmp_path, "zero", "--epochs", "0"), env=env
    )
    assert_one_line_error(proc, "--epochs must be an integer >= 1")
    assert proc.returncode == 2

    # --no-wait prints the job id alone on stdout, then status/stop act on it.
    proc = run_submit(
        "--address",
        head["url"],
        "--no-wait",
        *fit_args(head, tmp_path, "stopped", "--epochs", "50"),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    assert re.fullmatch(r"raysubmit_\w+", job_id), proc.stdout
    assert "(driver on the head)" in proc.stderr  # no node of this cluster offers job_driver
    proc = run_submit("--address", head["url"], "stop", job_id, env=env)
    assert proc.returncode == 0 and "STOPPED" in proc.stderr, proc.stderr
    # list --json: one object on stdout, the table on stderr.
    proc = run_submit("--address", head["url"], "list", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    listed = {job["job_id"]: job for job in json.loads(proc.stdout)["jobs"]}
    assert (
        listed[job_id]["status"] == "STOPPED"
        and "raytrain_mnist.fit" in (listed[job_id]["entrypoint"])
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", listed[job_id]["started"])
    assert job_id in proc.stderr  # the table
    proc = run_submit("--address", head["url"], "logs", "--follow", job_id, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines() == [
        f"following job {job_id} (Ctrl-C: stop it or detach)",
        f"raytrain-mnist: error: job {job_id} was stopped",
    ], proc.stderr


def test_a_submitted_serve_checks_a_token_that_no_part_of_the_cluster_holds(head, tmp_path):
    """`submit -- serve --auth-token-file F`: the job's serve answers the right token and
    refuses others, and the token is nowhere on the cluster, while it serves or once the job
    has ended: not in what the Jobs API shows of the job, not in the GCS's store (the job's
    package, which Ray keeps after the job, and Serve's checkpoints of its application), not
    in any file under the head's Ray directory (its unpacked packages, logs, session). The
    cluster gets the token's salted hash; runtime_env's env_vars would have shown the token."""
    env = client_env(head, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(head["token_path"]))
    token = secrets.token_urlsafe(32)  # this test's own: any copy found is a leak
    token_file = tmp_path / "my-token"
    token_file.write_text(f"{token}\n")
    checkpoint = tmp_path / "checkpoint_000000"
    checkpoint.mkdir()
    ckpt.save(checkpoint, {"model": ConvNet().state_dict(), "epoch": 0})
    (port,) = free_ports(1)
    proc = run_submit(
        *("--address", head["url"], "--no-wait", "--", "serve", str(checkpoint)),
        *("--port", str(port), "--auth-token-file", str(token_file)),
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    try:
        _wait_for_log_line(head, job_id, "serving ")
        predict = f"http://127.0.0.1:{port}/predict"
        wrong = token[:-1] + ("A" if token[-1] != "A" else "B")
        assert [_predict(predict, bearer) for bearer in (token, wrong, None)] == [200, 401, 401]
        info = json.loads(_jobs_api(head, f"/api/jobs/{job_id}"))
        assert info["entrypoint"].endswith(f"--auth-token-hash {jobs.SERVE_TOKEN_HASH_FILE}")
        assert set(info["runtime_env"]) == {"working_dir"}
        package = info["runtime_env"]["working_dir"]  # gcs://_ray_pkg_<hash>.zip
        carried = (_working_dir(head, job_id) / jobs.SERVE_TOKEN_HASH_FILE).read_text()
        assert TokenHash.parse(carried, "the carried file").accepts(token.encode())
        serving = _copies_of(head, token)
        assert serving["serve"] and package in serving["keys"], serving  # what was read
        assert serving["holding"] == [], serving
    finally:
        stopped = run_submit("--address", head["url"], "stop", job_id, env=env)
    assert stopped.returncode == 0 and "STOPPED" in stopped.stderr, stopped.stderr
    ended = _copies_of(head, token)
    assert package in ended["keys"] and ended["holding"] == [], ended  # Ray keeps the package
    for shown in (
        proc.stdout + proc.stderr + stopped.stderr,
        _jobs_api(head, f"/api/jobs/{job_id}"),
        _jobs_api(head, "/api/jobs/"),
        _jobs_api(head, f"/api/jobs/{job_id}/logs"),
        run_submit("--address", head["url"], "list", env=env).stdout,
    ):
        assert token not in shown

    # What runtime_env.env_vars would have exposed: the Jobs API shows them to every caller.
    probe = secrets.token_hex(16)
    submitted = subprocess.run(
        [sys.executable, "-c", _SUBMIT_RAW, head["url"], "true"]
        + [json.dumps({"env_vars": {"PROBE": probe}})],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stderr
    raw_job = submitted.stdout.strip().splitlines()[-1]
    assert probe in _jobs_api(head, f"/api/jobs/{raw_job}")
    assert probe in _jobs_api(head, "/api/jobs/")


def _wait_for_log_line(head, job_id: str, line_start: str, timeout: float = 240) -> None:
    """Until a line of the job's log starts with ``line_start``; fails if the job ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = json.loads(_jobs_api(head, f"/api/jobs/{job_id}/logs"))["logs"]
        if any(line.startswith(line_start) for line in logs.splitlines()):
            return
        status = json.loads(_jobs_api(head, f"/api/jobs/{job_id}"))["status"]
        if status in ("STOPPED", "SUCCEEDED", "FAILED"):
            pytest.fail(f"job {job_id} ended {status} before {line_start!r}:\n{logs[-3000:]}")
        time.sleep(0.5)
    pytest.fail(f"job {job_id} printed no {line_start!r} in {timeout} s")


def _predict(url: str, bearer: str | None) -> int:
    """The status of a one-image POST /predict, with ``bearer`` as its token."""
    body = json.dumps({"images": [[[0] * 28] * 28]}).encode()
    headers = {"Content-Type": "application/json"}
    if bearer is not None:
        headers["Authorization"] = f"Bearer {bearer}"
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, data=body, headers=headers), timeout=30
        ) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


#: Every value of the GCS's internal store (every namespace Ray 2.60 writes; a key that none
#: of them holds is reported, so a new namespace cannot hide a copy) and every file under a
#: folder, zips opened: which hold the token read from stdin. Ray's GcsClient reads the store
#: without starting a driver (ray.init would add one to the cluster it inspects).
_SCAN = """
import io, json, os, sys, zipfile
import ray
from ray._raylet import GcsClient

token = sys.stdin.read().strip().encode()
namespaces = [None, b"serve", b"job", b"dashboard", b"session", b"cluster", b"fun",
    b"tracing", b"ray_pdb", b"healthcheck", b"usage_stats",
    ray._raylet.GCS_AUTOSCALER_STATE_NAMESPACE.encode()]

def holds(data, where):
    if token in data:
        return True
    if zipfile.is_zipfile(io.BytesIO(data)):  # a zip's end record anywhere in its tail
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as zipped:
                return any(token in zipped.read(name) for name in zipped.namelist())
        except zipfile.BadZipFile:
            unopened.append(where)
    return False

gcs = GcsClient(address=sys.argv[1])
keys, unread, holding, serve, unopened = gcs.internal_kv_keys(b"", None), [], [], [], []
text = lambda key: key.decode("utf-8", "backslashreplace")  # some keys are binary ids
for key in keys:
    values = {ns: gcs.internal_kv_get(key, ns) for ns in namespaces}
    values = {ns: value for ns, value in values.items() if value is not None}
    unread += [] if values else [text(key)]
    serve += [text(key)] if b"serve" in values else []
    for ns, value in values.items():
        where = f"gcs {ns} {text(key)}"
        holding += [where] if holds(value, where) else []
for folder, _, names in os.walk(sys.argv[2]):
    for name in names:
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not os.path.islink(path):
            with open(path, "rb") as f:
                holding += [path] if holds(f.read(), path) else []
print(json.dumps({"keys": [text(k) for k in keys], "unread": unread, "serve": serve,
    "holding": holding, "unopened": unopened}))
"""


def _copies_of(head, token: str) -> dict:
    """Where the token lies on ``head``'s cluster: ``holding``, the GCS's values and the files
    under the head's directory that hold it; ``keys``, the store's keys read (``serve``: of
    Serve's namespace)."""
    scan = subprocess.run(
        [sys.executable, "-c", _SCAN, head["gcs"], str(head["root"])],
        input=token,
        env=client_env(head, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(head["token_path"])),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert scan.returncode == 0, scan.stderr
    found = json.loads(scan.stdout.strip().splitlines()[-1])
    assert found["unread"] == [], f"keys in a namespace the scan does not read: {found}"
    # What ends like a zip but does not open as one was read as bytes only: a file under the
    # head's directory whose tail holds a zip's end record but is none (a log or a binary; one
    # such file broke the scan in the 2026-12-05 05:44 suite, its name not shown). Ray's
    # packages, in its store or as the .zip files it fetches, must open.
    assert not [u for u in found["unopened"] if u.startswith("gcs ") or u.endswith(".zip")], found
    return found


# --------------------------------------------------------------------------- a driver node


def _nodes(url: str, token: str) -> list[dict]:
    """The cluster's nodes, as the state API of its dashboard at ``url`` lists them."""
    return json.loads(_get(url, token, "/api/v0/nodes?limit=100&detail=1"))["data"]["result"][
        "result"
    ]


def _alive_nodes(head) -> dict[str, dict]:
    """The cluster's live nodes by id."""
    return {n["node_id"]: n for n in _nodes(head["url"], head["token"]) if n["state"] == "ALIVE"}


#: A node that joins the head at argv[1] with one CPU and one argv[4] (`job_driver`), on
#: loopback as the head is, until SIGTERM: `ray start` refuses to join in the single-node
#: mode that keeps a node on loopback; Ray's own test clusters start a node this way
#: (ray.cluster_utils).
_DRIVER_NODE = """
import signal, sys, threading
from ray._private.node import Node
from ray._private.parameter import RayParams

params = RayParams(gcs_address=sys.argv[1], node_ip_address="127.0.0.1", num_cpus=1,
    num_gpus=0, resources={sys.argv[4]: 1}, dashboard_agent_listen_port=int(sys.argv[2]),
    metrics_export_port=int(sys.argv[3]), include_log_monitor=False, node_manager_port=0,
    min_worker_port=0, max_worker_port=0)
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
node = Node(params, head=False, shutdown_at_exit=False, spawn_reaper=False)
print("joined", node.unique_id, flush=True)
stop.wait()
node.kill_all_processes(check_alive=False, allow_graceful=True)
"""


def _place(head, *flags: str, env: dict | None = None, seen: list | None = None) -> str:
    """Submit `evaluate` of a missing run with ``flags``; the node its driver ran on (and
    the job's record from the Jobs API appended to ``seen``)."""
    proc = run_submit(
        *("--address", head["url"], "--no-wait", *flags, "--", "evaluate", "/nonexistent/run"),
        env={
            **client_env(head, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(head["token_path"])),
            **(env or {}),
        },
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = proc.stdout.strip()
    deadline = time.monotonic() + 120
    while (info := json.loads(_jobs_api(head, f"/api/jobs/{job_id}")))["status"] not in (
        "SUCCEEDED",
        "FAILED",
        "STOPPED",
    ):
        assert time.monotonic() < deadline, info
        time.sleep(0.5)
    if seen is not None:
        seen.append(info)
    # It ran (evaluate refused the missing run), and the Jobs API says where.
    assert info["driver_exit_code"] not in (None, 0), info
    where = (
        "the head" if info["driver_node_id"] == head["node_id"] else "a node offering job_driver"
    )
    assert f"(driver on {where})" in proc.stderr, proc.stderr
    return info["driver_node_id"]


def test_the_driver_runs_on_a_driver_node_unless_told_otherwise_and_env_reaches_it(
    head, monkeypatch
):
    """On a cluster with a node that offers `job_driver` (cluster.yaml's ray.driver.cpu),
    `submit` runs the job's driver there unless told otherwise (`--driver-resource none`:
    the head); `--env` reaches the job's runtime environment. The node joins this module's
    head for this test (as a driver node joins a cluster) and leaves it before the test
    ends, so every other test here sees a cluster without one (their drivers: the head). The
    job is a real submit of `evaluate` of a run that does not exist (it fails in seconds;
    where its driver ran is the point): the Jobs API records the driver's node."""
    monkeypatch.delenv("RAYTRAIN_MNIST_DRIVER_RESOURCE", raising=False)
    node_marker = uuid.uuid4().hex
    agent, metrics = free_ports(2)
    env = {**head["env"], MARKER_VAR: node_marker}  # its own marker: this node alone
    log = head["root"] / "driver_node.log"
    with open(log, "wb") as out:
        node = subprocess.Popen(
            [sys.executable, "-c", _DRIVER_NODE, head["gcs"], str(agent), str(metrics)]
            + [jobs.DRIVER_RESOURCE],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 120
        while not (
            driver := [
                node_id
                for node_id, n in _alive_nodes(head).items()
                if (n.get("resources_total") or {}).get(jobs.DRIVER_RESOURCE)
            ]
        ):
            assert node.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        (driver_node,) = driver
        # By default: the cluster offers job_driver, so the driver goes there, not to the head.
        assert _place(head) == driver_node
        # Asked for by name, the same; this job also carries `--env`, which reaches the
        # job's runtime environment.
        seen: list = []
        env_flags = ("--env", "NCCL_DEBUG=INFO", "--env", "PROBE=a=b")
        assert _place(head, "--driver-resource", jobs.DRIVER_RESOURCE, *env_flags, seen=seen) == (
            driver_node
        )
        (info,) = seen
        assert info["runtime_env"]["env_vars"] == {"NCCL_DEBUG": "INFO", "PROBE": "a=b"}
        # Told otherwise: Ray's own placement, the head.
        assert _place(head, "--driver-resource", "none") == head["node_id"]
        assert _place(head, env={"RAYTRAIN_MNIST_DRIVER_RESOURCE": "none"}) == head["node_id"]
    finally:
        # The node leaves as `ray stop` would stop it (SIGTERM: its raylet leaves the GCS),
        # and the test waits until the cluster no longer lists it: later jobs go to the head.
        node.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 120
        while any(
            (n.get("resources_total") or {}).get(jobs.DRIVER_RESOURCE)
            for n in _alive_nodes(head).values()
        ):
            assert time.monotonic() < deadline, "the driver node is still listed as alive"
            time.sleep(0.5)
        kill_marked(node_marker)
        node.wait(timeout=30)


# --------------------------------------------------------------------------- no cluster needed


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "nothing to do"),
        (["status"], "needs a JOB_ID"),
        (["list", "x"], "list takes no JOB_ID"),
        (["status", "x", "--", "fit"], "not both"),
        (["--follow", "--", "fit"], "--follow goes with logs"),
        (["--env", "A=1", "list"], "--env go with submitting a command"),
        (["--json", "--", "fit"], "--json goes with list"),
        (["--", "evaluate-all"], "is not a command to submit"),
        (["--", "fit", "--batch-size", "100", "--num-workers", "3"], "use a multiple of 3"),
        (["--", "fit", "--no-such-flag"], "unrecognized arguments"),
        (["--", "fit", "--seed", str(2**64)], "--seed must be at most"),
        (["--", "fit", "--address", "http://10.0.0.1:8265"], "submit jobs to a dashboard URL"),
        (["--address", "http://127.0.0.1:99999", "list"], "is not a dashboard URL"),
        (["--address", "http://:8265", "list"], "is not a dashboard URL"),
        (["--address", "http://me:pw@127.0.0.1:8265", "list"], "no credentials"),
        (["--address", "ftp://127.0.0.1:8265", "list"], "is neither a dashboard URL"),
        (["--address", "127.0.0.1", "list"], "is neither a dashboard URL"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv, message, capsys):
    try:
        code = submit.cli(argv)
    except SystemExit as exc:  # argparse's errors (ours and fit's)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert ":pw@" not in err


@pytest.mark.parametrize(
    "command",
    [
        ["fit", "--typo"],
        ["tune", "--typo"],
        ["evaluate", "runs/some-run", "--typo"],
        ["serve", "runs/some-run", "--typo"],
    ],
    ids=lambda c: c[0],
)
def test_every_commands_flags_are_refused_before_any_cluster_is_contacted(command):
    """Each command's own parse checks its words here: a typo never reaches the address
    (a closed port on loopback, which would be a connection error), let alone an upload."""
    (closed,) = free_ports(1)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
    }
    proc = run_submit("--address", f"http://127.0.0.1:{closed}", "--", *command, env=env)
    assert proc.returncode == 2, proc.stderr
    assert_one_line_error(proc, f"raytrain-mnist {command[0]}", "unrecognized arguments: --typo")
    assert "no Ray dashboard answers" not in proc.stderr
    assert proc.stdout == ""


SECRET = "wJalrXUtnFEMIK7MDENG"


@pytest.mark.parametrize(
    "command",
    [
        ["fit", "--storage-path", f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs"],
        ["tune", "--storage-path", f"s3://bucket/runs?access_key=AKIAEXAMPLE&secret_key={SECRET}"],
        ["fit", "--mlflow-uri", f"https://user:{SECRET}@mlflow.example"],
        ["evaluate", f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs/r"],
        ["serve", f"gs://bucket/runs/r?access_token={SECRET}"],
    ],
    ids=lambda c: c[0] + c[1][:4],
)
def test_credentials_in_a_uri_are_refused_before_any_cluster_is_contacted(command):
    """Refused here, so the secret never reaches the job table; not echoed either."""
    (closed,) = free_ports(1)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
    }
    proc = run_submit("--address", f"http://127.0.0.1:{closed}", "--", *command, env=env)
    assert proc.returncode == 2, proc.stderr
    assert_one_line_error(proc, "carries credentials; pass them through the environment")
    assert "no Ray dashboard answers" not in proc.stderr and proc.stdout == ""
    assert SECRET not in proc.stderr and "AKIAEXAMPLE" not in proc.stderr


@pytest.mark.parametrize(
    "flags",
    [["--auth-token", SERVE_TOKEN], [f"--auth-token={SERVE_TOKEN}"], ["--auth-token", "short"]],
    ids=["flag", "equals", "invalid"],
)
def test_a_serve_token_on_the_command_line_is_refused_before_anything_is_uploaded(
    flags, monkeypatch, capsys
):
    """The entrypoint is in the job table: a token there is refused here, in one line, exit 2,
    before any cluster is contacted (a closed port would be a connection error)."""
    monkeypatch.setenv(TOKEN_ENV, SERVE_TOKEN)  # refused even with a token to carry
    (closed,) = free_ports(1)
    argv = ["--address", f"http://127.0.0.1:{closed}", "--", "serve", "runs/r", "--host", "::"]
    code = submit.cli([*argv, *flags])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    if flags[-1] != "short":
        assert "--auth-token would be stored in the cluster's job table" in err, err
        assert f"${TOKEN_ENV} or pass --auth-token-file FILE" in err
    assert SERVE_TOKEN not in err and "no Ray dashboard answers" not in err


def test_only_a_serve_tokens_salted_hash_travels_in_the_working_directory(
    tmp_path, monkeypatch, capsys
):
    """From $RAYTRAIN_MNIST_SERVE_TOKEN, --auth-token-file or --auth-token-hash (a path here,
    however spelled), the entrypoint reads the staged hash file: the token's salted hash,
    mode 0600, salted anew each time (so neither it nor the package's content hash is the
    same for one token twice); serve reads it there and checks the token against it."""
    from raytrain_mnist.serve import parse_command

    address = ["--address", "http://127.0.0.1:1", "--"]
    entry = f"--auth-token-hash {jobs.SERVE_TOKEN_HASH_FILE}"
    monkeypatch.setenv(TOKEN_ENV, SERVE_TOKEN)
    options = submit.parse([*address, "serve", "runs/r", "--host", "0.0.0.0"])
    assert options.entrypoint == (f"python -m raytrain_mnist.serve runs/r --host 0.0.0.0 {entry}")
    assert options.serve_token_hash.accepts(SERVE_TOKEN.encode())
    assert SERVE_TOKEN not in repr(options)
    assert submit.parse([*address, "fit"]).serve_token_hash is None
    monkeypatch.delenv(TOKEN_ENV)
    assert submit.parse([*address, "serve", "runs/r"]).serve_token_hash is None  # loopback
    local = tmp_path / "my-token"
    local.write_text(f"{SERVE_TOKEN[::-1]}\n")
    hashed = tmp_path / "my-token.sha256"
    hashed.write_text(TokenHash.of(SERVE_TOKEN[::-1]).line() + "\n")
    for flags in (
        ["--auth-token-file", str(local)],
        [f"--auth-token-file={local}"],
        ["--auth-token-hash", str(hashed)],
        [f"--auth-token-hash={hashed}"],
    ):
        options = submit.parse([*address, "serve", *flags, "runs/r", "--replicas", "2"])
        assert options.entrypoint == (f"python -m raytrain_mnist.serve runs/r --replicas 2 {entry}")
        assert options.serve_token_hash.accepts(SERVE_TOKEN[::-1].encode())
    code = submit.cli([*address, "serve", "runs/r", "--auth-token-file", str(tmp_path / "none")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot read it (No such file or directory)" in err, err

    with (
        jobs.staged_upload(serve_token_hash=TokenHash.of(SERVE_TOKEN)) as env,
        jobs.staged_upload(serve_token_hash=TokenHash.of(SERVE_TOKEN)) as again,
    ):
        staged = Path(env["working_dir"], jobs.SERVE_TOKEN_HASH_FILE)
        assert stat.S_IMODE(staged.stat().st_mode) == 0o600
        line = staged.read_text()
        assert SERVE_TOKEN not in line and line.count("\n") == 1
        assert line != Path(again["working_dir"], jobs.SERVE_TOKEN_HASH_FILE).read_text()
        monkeypatch.chdir(env["working_dir"])  # where the job runs
        served = parse_command(options.entrypoint.split()[3:]).token_hash
        assert served.accepts(SERVE_TOKEN.encode())
        assert not served.accepts(SERVE_TOKEN[::-1].encode())
    with jobs.staged_upload() as env:
        assert not Path(env["working_dir"], jobs.SERVE_TOKEN_HASH_FILE).exists()


def test_parse_checks_and_returns_the_options():
    options = submit.COMMAND.parse(
        [
            "--address",
            "http://127.0.0.1:1",
            "--no-wait",
            "--",
            "evaluate",
            "runs/r",
            "--num-workers",
            "2",
        ]
    )
    assert options == submit.SubmitOptions(
        action=None,
        job_id=None,
        follow=False,
        no_wait=True,
        address="http://127.0.0.1:1",
        entrypoint="python -m raytrain_mnist.evaluate runs/r --num-workers 2",
    )
    options = submit.parse(["logs", "raysubmit_1", "-f", "--address", "http://h:8265/"])
    assert (options.action, options.job_id, options.follow, options.entrypoint) == (
        "logs",
        "raysubmit_1",
        True,
        None,
    )
    assert options.address == "http://h:8265"
    with pytest.raises(SystemExit) as exc:
        submit.parse(["--", "evaluate", "runs/r", "--num-workers", "zero"])
    assert exc.value.code == 2


def test_entrypoint_and_the_staged_working_directory():
    assert (
        submit.entrypoint(["fit", "--num-workers", "4", "--use-gpu", "--name", "run.2_b"])
        == "python -m raytrain_mnist.fit --num-workers 4 --use-gpu --name run.2_b"
    )
    with jobs.staged_upload() as env:
        assert set(env) == {"working_dir"}
        staged = Path(env["working_dir"])
        files = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
        assert files == jobs.upload_files(REPO)
        assert {"pyproject.toml", "README.md", "raytrain_mnist/fit.py"} <= set(files)
        assert "raytrain_mnist/serving/static/index.html" in files  # the package's data
        assert not any(f.startswith(("tests/", "docs/", ".")) for f in files)
    assert not staged.exists()  # gone once submitted


#: Planted in a checkout: none of it may travel with a job.
_SECRETS = [
    ".envrc",
    ".netrc",
    ".env",
    "id_rsa",
    "id_ed25519.pub",
    ".ssh/id_ed25519",
    ".aws/credentials",
    ".config/gcloud/application_default_credentials.json",
    ".docker/config.json",
    ".kube/config",
    "credentials.json",
    "service-account.json",
    "terraform.tfstate",
    "data/MNIST/raw/train-images-idx3-ubyte",
    "runs/r/checkpoint_0/state.pt",
    "tests/test_x.py",
    ".git/config",
    ".venv/bin/python",
    "raytrain_mnist/.envrc",  # inside the package too
    "raytrain_mnist/.hidden/x.py",
    "raytrain_mnist/secrets.txt",
    "raytrain_mnist/id_rsa",
    "raytrain_mnist/__pycache__/fit.cpython-311.pyc",
    "raytrain_mnist/driver/__pycache__/x.py",
]


def test_the_upload_is_an_allow_list(tmp_path):
    """A checkout with secrets planted everywhere, links into them included: the staged
    working directory holds the package, pyproject.toml and README.md, nothing else."""
    checkout = tmp_path / "checkout"
    kept = [
        "README.md",
        "pyproject.toml",
        "raytrain_mnist/__init__.py",
        "raytrain_mnist/driver/runs/claim.py",
        "raytrain_mnist/fit.py",
        "raytrain_mnist/serving/static/index.html",
    ]
    for name in kept + _SECRETS:
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        (checkout / name).write_text(f"SECRET {name}" if name in _SECRETS else "x = 1\n")
    (checkout / "raytrain_mnist" / "leak.py").symlink_to(checkout / "id_rsa")
    (checkout / "raytrain_mnist" / "keys").symlink_to(checkout / ".ssh")
    (checkout / "raytrain_mnist" / "linked.html").symlink_to(checkout / ".netrc")
    assert jobs.upload_files(checkout) == kept
    with jobs.staged_upload(checkout) as env:
        staged = Path(env["working_dir"])
        assert not any(p.is_symlink() for p in staged.rglob("*"))
        files = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
        assert files == kept
        assert all("SECRET" not in (staged / f).read_text() for f in files)
    # An installed package (no pyproject.toml beside it) travels alone.
    (checkout / "pyproject.toml").unlink()
    assert jobs.upload_files(checkout) == [f for f in kept if f.startswith("raytrain_mnist/")]


def test_the_staged_directory_runs_the_job_command():
    """What the cluster runs, `python -m raytrain_mnist.<command>` in the job's working
    directory, imports the staged copy and works from it alone."""
    probe = (
        "import raytrain_mnist, runpy, sys; print(raytrain_mnist.__file__, flush=True); "
        "sys.argv = ['fit', '--help']; runpy.run_module('raytrain_mnist.fit', run_name='__main__')"
    )
    with jobs.staged_upload() as env:
        proc = subprocess.run(
            [sys.executable, "-c", probe],
            cwd=env["working_dir"],
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[0] == str(
            Path(env["working_dir"], "raytrain_mnist", "__init__.py")
        )
        assert "--storage-path" in proc.stdout


def test_one_exclude_list_for_submit_rayignore_and_cluster_yaml():
    import yaml

    rayignore = [
        line.strip()
        for line in (REPO / ".rayignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    rsync = yaml.safe_load((REPO / "cluster.yaml").read_text())["rsync_exclude"]
    assert rayignore == jobs.EXCLUDES
    assert rsync == jobs.EXCLUDES
    for required in (".env", "*.pem", "*.key", ".aws/", "/mlruns/", "*.pt", "evaluation_*/"):
        assert required in jobs.EXCLUDES, required


def test_the_upload_leaves_secrets_and_bulk_out(tmp_path):
    """What Ray itself packs from a checkout with the list (and, apart, with .rayignore)."""
    import zipfile

    from ray._private.runtime_env.packaging import create_package

    kept = [
        "pyproject.toml",
        "raytrain_mnist/fit.py",
        "raytrain_mnist/driver/runs/claim.py",  # a package named like the runs directory
        "docs/iam/worker.json",
        "notebooks/quickstart.ipynb",
        "tests/data_test.py",
    ]
    left_out = [
        ".env",
        ".env.local",
        "deploy.pem",
        "tls/server.key",
        ".aws/credentials",
        "data/MNIST/raw/t10k-images-idx3-ubyte",
        "runs/r/checkpoint_0/state.pt",
        "mlruns/0/meta.yaml",
        "model.pt",
        "evaluation_ckpt/evaluation.json",
        ".git/config",
        ".venv/bin/python",
        "raytrain_mnist/__pycache__/fit.pyc",
    ]
    for name in kept + left_out:
        (tmp_path / "checkout" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "checkout" / name).write_text("x")
    for how, excludes in (("list", jobs.EXCLUDES), ("rayignore", [])):
        if how == "rayignore":
            (tmp_path / "checkout" / ".rayignore").write_text((REPO / ".rayignore").read_text())
        package = tmp_path / f"{how}.zip"
        create_package(
            str(tmp_path / "checkout"), package, include_gitignore=True, excludes=excludes
        )
        names = set(zipfile.ZipFile(package).namelist())
        assert set(kept) <= names, (how, set(kept) - names)
        assert not names & set(left_out), (how, names & set(left_out))


def test_address_order(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    assert jobs.dashboard_url(None) == "http://127.0.0.1:8265"
    monkeypatch.setenv("RAY_ADDRESS", "http://b:8265")
    assert jobs.dashboard_url(None) == "http://b:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://a:8265/")
    assert jobs.dashboard_url(None) == "http://a:8265"
    assert jobs.dashboard_url("http://flag:8265") == "http://flag:8265"


class _FakeClient:
    def __init__(self):
        self.stopped = []

    def stop_job(self, job_id):
        self.stopped.append(job_id)

    def get_job_status(self, job_id):
        from ray.job_submission import JobStatus

        return JobStatus.STOPPED if self.stopped else JobStatus.RUNNING


class _Stdin(io.StringIO):
    def __init__(self, text, tty):
        super().__init__(text)
        self.tty = tty

    def isatty(self):
        return self.tty


def test_ctrl_c_asks_on_a_terminal_and_detaches_elsewhere(monkeypatch, capsys):
    client = _FakeClient()
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert (
        submit.interrupted(client, "http://h:8265", "raysubmit_1", _Stdin("", True))
        == EXIT_INTERRUPTED
    )
    assert client.stopped == ["raysubmit_1"]
    assert "STOPPED" in capsys.readouterr().err

    client = _FakeClient()
    monkeypatch.setattr("builtins.input", lambda prompt: "")
    assert (
        submit.interrupted(client, "http://h:8265", "raysubmit_2", _Stdin("", True))
        == EXIT_INTERRUPTED
    )
    assert client.stopped == [] and "detached" in capsys.readouterr().err

    monkeypatch.setattr("builtins.input", lambda prompt: pytest.fail("asked without a tty"))
    assert (
        submit.interrupted(client, "http://h:8265", "raysubmit_3", _Stdin("y\n", False))
        == EXIT_INTERRUPTED
    )
    err = capsys.readouterr().err
    assert client.stopped == [] and "submit --address http://h:8265 stop raysubmit_3" in err


def test_token_sources(monkeypatch, tmp_path):
    """Checked before anything is sent; a configured token turns token mode on."""
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(UserError, match="RAY_AUTH_TOKEN_PATH=.* is not a file"):
        jobs.use_token_if_given()
    (tmp_path / "token").write_text("t")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    jobs.use_token_if_given()
    assert os.environ["RAY_AUTH_MODE"] == "token"

    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    with pytest.raises(UserError, match="RAY_AUTH_MODE=token but no token"):
        jobs.use_token_if_given()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t")
    jobs.use_token_if_given()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"  # an explicit mode is respected


# --------------------------------------------------------------------------- where the token goes


@pytest.mark.parametrize(
    "url, private",
    [
        ("http://127.0.0.1:8265", True),
        ("http://localhost:8265", True),
        ("http://[::1]:8265", True),
        ("http://127.0.0.2:8265", True),
        ("https://head.example:8443", True),
        ("127.0.0.1:6379", True),
        ("http://10.0.0.1:8265", False),
        ("http://head.example:8265", False),
        ("http://127.0.0.1.example:8265", False),
        ("10.0.0.1:6379", False),
        ("auto", False),
    ],
)
def test_which_addresses_get_the_token_unasked(url, private):
    assert jobs.private_channel(url) is private


def _local_outward_address() -> str | None:
    """An address of this machine that is not loopback: what another host on its network
    would connect to. Nothing sent there leaves the machine."""
    import ipaddress
    import socket

    import psutil

    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


@pytest.fixture
def outward_server():
    """A tiny HTTP server on a non-loopback address of this machine that answers every
    request 401, as a token-protected dashboard does to a client without a token, and
    records each request's Authorization header."""
    import http.server
    import threading

    address = _local_outward_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to listen on")
    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            seen.append(self.headers.get("Authorization"))
            body = b'{"error": "Unauthorized"}'
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((address, 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"url": f"http://{address}:{server.server_address[1]}", "seen": seen}
    finally:
        server.shutdown()
        server.server_close()


def test_the_token_does_not_go_to_another_host_over_plain_http_unless_asked(
    outward_server, tmp_path
):
    token = "tok-" + uuid.uuid4().hex
    (tmp_path / "home").mkdir()
    env = client_env({"home": tmp_path / "home"}, RAY_AUTH_TOKEN=token)
    url, seen = outward_server["url"], outward_server["seen"]

    # A token is configured, the mode is not: kept back, with a warning, once.
    proc = run_submit("--address", url, "list", env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert seen, "the client never reached the server"
    assert all(header is None or token not in header for header in seen), seen
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and f"not sending the Ray token to {url}" in warnings[0], proc.stderr
    assert "requires a token (HTTP 401)" in proc.stderr

    # Asked for explicitly: sent, and the warning says it went over plain http.
    seen.clear()
    proc = run_submit("--address", url, "list", env={**env, "RAY_AUTH_MODE": "token"})
    assert f"Bearer {token}" in seen, seen
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "over plain http" in warnings[0], proc.stderr
    assert token not in proc.stderr + proc.stdout
