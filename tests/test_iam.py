"""docs/iam/worker-policy.json, held by an IAM user, against an S3 server that enforces IAM:
an ``s3://`` run end to end through the CLI, every command holding only the policy (fit,
with ``--json``, and a newcomer's first hour after it: runs, runs show, predict, export;
"already finished", other settings refused, ``--fresh`` keeping the old run, a second command
refused while it runs, Ctrl-C, resume, evaluate); nothing outside the runs prefix is
reachable; a policy without an unconditioned ``s3:ListBucket`` on the bucket fails the run in
one line.

The server is moto (``python -m moto.server``) on 127.0.0.1, in its own process, started with
``INITIAL_NO_AUTH_ACTION_COUNT=3``: the first three requests (create an admin user, give it
``*``, make its key) pass unauthenticated, every later one is checked the way moto checks
IAM (moto/core/authorization.py, moto/iam/access_control.py). What that enforcement covers,
and where it parts from AWS (moto 5.2):

* Signatures and keys are checked: an unknown key is refused (``InvalidAccessKeyId``).
* Object requests are authorized as ``s3:GetObject`` (GET and HEAD), ``s3:PutObject`` (PUT,
  multipart, copy), ``s3:DeleteObject``, ``s3:AbortMultipartUpload``,
  ``s3:ListMultipartUploadParts`` against ``arn:aws:s3:::BUCKET/KEY``; ListObjects(V2) as
  ``s3:ListBucket`` against the bucket: as on AWS.
* **HeadBucket differs.** AWS authorizes HeadBucket with ``s3:ListBucket`` on the bucket
  (there is no ``s3:HeadBucket`` permission); moto checks an action it calls
  ``s3:HeadBucket``, which no real policy grants, so exactly the file would be refused
  HeadBucket whatever it says. The user therefore holds the file plus ``s3:HeadBucket`` on
  each statement where AWS would let HeadBucket through: an ``Allow`` of ``s3:ListBucket``
  on the bucket without a ``Condition`` (:func:`as_moto_checks_it`; nothing else is added).
* **Conditions are not evaluated** on S3 requests: moto passes no request context (no
  ``s3:prefix``), and a condition with no value to test passes. A prefix-conditioned
  ``s3:ListBucket`` therefore lists the whole bucket in moto (on AWS only the prefix), and
  only the rule above makes it fail HeadBucket, as on AWS.
* **DeleteObjects differs.** AWS authorizes a multi-object delete (``POST ?delete``, how
  pyarrow deletes a directory: ``--fresh`` moving a run aside) key by key, as
  ``s3:DeleteObject`` on each object. moto first checks ``s3:DeleteObject`` on the *bucket*
  (``arn:aws:s3:::BUCKET``), refusing every key when that is denied, then each key against
  the bucket's policy only. The user therefore also holds ``s3:DeleteObject`` on each bucket
  whose objects a statement lets it delete (:func:`as_moto_checks_it`): on AWS that grants
  nothing (the action applies to objects only); in moto it lets the batch through, and then
  no key of it is checked against the user's policy.

So the prefix confinement of object reads, writes and single deletes is enforced by moto
itself (of multi-object deletes, not: the rule above); that the fixed policy lets HeadBucket
through, and that the old prefix-conditioned one does not, rests on the HeadBucket rule above
(AWS's documented rule for HeadBucket, apache/arrow#49949).

Where the planted policies fail: Ray Train makes the run directory and every checkpoint
directory with pyarrow's ``create_dir`` (HeadBucket first). ``fit`` makes the storage
directory with the same call when it claims the run (runs/storage.py ``check_writable``), so
the run stops there, in one line, before Ray starts; without that check the Train controller
dies on the same HeadBucket and the line says only ``ActorDiedError``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.conftest import (
    MARKER_VAR,
    REPO,
    aws_env,
    free_ports,
    kill_marked,
    marked,
    no_process_left,
    run_cli_here,
    signal_all,
    tiny_run_flags,
)

POLICY = REPO / "docs" / "iam" / "worker-policy.json"
PLACEHOLDER = "REPLACE_ME-bucket"


def _actions(statement: dict) -> list[str]:
    actions = statement["Action"]
    return [actions] if isinstance(actions, str) else list(actions)


def _prefix(policy: dict) -> str:
    """The runs prefix the policy's object statement is confined to."""
    for statement in policy["Statement"]:
        resources = statement["Resource"]
        for resource in [resources] if isinstance(resources, str) else resources:
            found = re.fullmatch(rf"arn:aws:s3:::{PLACEHOLDER}/(.+)/\*", resource)
            if found:
                return found[1]
    raise AssertionError("no object statement under a prefix")


def the_policy(bucket: str) -> dict:
    """Exactly docs/iam/worker-policy.json, for ``bucket``."""
    return json.loads(POLICY.read_text().replace(PLACEHOLDER, bucket))


def as_moto_checks_it(policy: dict) -> dict:
    """``policy`` plus moto's name for HeadBucket wherever AWS would allow HeadBucket: in
    every Allow statement of ``s3:ListBucket`` on a bucket with no Condition; and moto's
    resource for DeleteObjects, the bucket, of every Allow of ``s3:DeleteObject`` on a
    bucket's objects (module docstring)."""
    policy = copy.deepcopy(policy)
    buckets = []
    for statement in policy["Statement"]:
        actions = _actions(statement)
        unconditioned = "Condition" not in statement
        if statement["Effect"] == "Allow" and "s3:ListBucket" in actions and unconditioned:
            statement["Action"] = [*actions, "s3:HeadBucket"]
        if statement["Effect"] == "Allow" and "s3:DeleteObject" in actions and unconditioned:
            resources = statement["Resource"]
            for resource in [resources] if isinstance(resources, str) else resources:
                if (bucket := resource.partition("/")[0]) != resource:
                    buckets.append(bucket)
    if buckets:
        policy["Statement"].append(
            {"Effect": "Allow", "Action": "s3:DeleteObject", "Resource": sorted(set(buckets))}
        )
    return policy


def _client(url: str, service: str, key: tuple[str, str]):
    import boto3

    return boto3.client(
        service,
        endpoint_url=url,
        aws_access_key_id=key[0],
        aws_secret_access_key=key[1],
        region_name="us-east-1",
    )


class IamS3:
    """The server, an admin, one bucket, and IAM users made on demand."""

    def __init__(self, url: str, admin: tuple[str, str]) -> None:
        self.url, self.admin = url, admin
        self.bucket = f"runs-{uuid.uuid4().hex[:8]}"
        self.client("s3", admin).create_bucket(Bucket=self.bucket)

    def client(self, service: str, key: tuple[str, str]):
        return _client(self.url, service, key)

    def user(self, policy: dict) -> tuple[str, str]:
        """A new IAM user that holds ``policy`` (inline) and nothing else; its key."""
        iam = self.client("iam", self.admin)
        name = f"worker-{uuid.uuid4().hex[:8]}"
        iam.create_user(UserName=name)
        iam.put_user_policy(
            UserName=name, PolicyName="runs-prefix", PolicyDocument=json.dumps(policy)
        )
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return key["AccessKeyId"], key["SecretAccessKey"]

    def env(self, key: tuple[str, str]) -> dict[str, str]:
        """The environment of a command that holds ``key`` (as a node's instance profile
        would give it), the endpoint the way conftest's ``s3`` passes it (:func:`aws_env`)."""
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith("AWS_")},
            **aws_env(self.url, key),
            "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }


@pytest.fixture(scope="module")
def iam_s3(tmp_path_factory):
    pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:  # /moto-api/ is not an S3 or IAM action: it spends none of the three
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=5).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(log.read_text()) from None
                time.sleep(0.2)
        iam = _client(url, "iam", ("testing", "testing"))
        iam.create_user(UserName="admin")  # the three unauthenticated requests
        iam.put_user_policy(
            UserName="admin",
            PolicyName="everything",
            PolicyDocument=json.dumps(
                {
                    "Version": "2012-10-17",
                    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
                }
            ),
        )
        key = iam.create_access_key(UserName="admin")["AccessKey"]
        yield IamS3(url, (key["AccessKeyId"], key["SecretAccessKey"]))
    finally:
        server.kill()
        server.wait(timeout=30)


def _storage(iam_s3: IamS3) -> str:
    return f"s3://{iam_s3.bucket}/{_prefix(json.loads(POLICY.read_text()))}"


def _fit_args(iam_s3: IamS3, tiny_mnist, name: str, epochs: int) -> list[str]:
    storage = _storage(iam_s3)
    return tiny_run_flags(
        tiny_mnist, storage, name, epochs=epochs, cpus_per_worker=1, batch_size=64
    )


# --------------------------------------------------------------------------- what is enforced


def test_the_server_enforces_iam(iam_s3):
    """Without this, every test below could pass against a server that allows everything."""
    from botocore.exceptions import ClientError

    stranger = iam_s3.client("s3", ("AKIAEXAMPLEEXAMPLE00", "not-a-secret"))
    with pytest.raises(ClientError, match="InvalidAccessKeyId"):
        stranger.list_objects_v2(Bucket=iam_s3.bucket)
    unrelated = {"Effect": "Allow", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::x/*"}
    nobody = iam_s3.client("s3", iam_s3.user({"Version": "2012-10-17", "Statement": [unrelated]}))
    with pytest.raises(ClientError, match="AccessDenied"):
        nobody.put_object(Bucket=iam_s3.bucket, Key="raytrain-mnist/x", Body=b"x")


def test_the_worker_policy_reaches_the_runs_prefix_and_nothing_else(iam_s3):
    from botocore.exceptions import ClientError

    prefix = _prefix(json.loads(POLICY.read_text()))
    admin = iam_s3.client("s3", iam_s3.admin)
    admin.put_object(Bucket=iam_s3.bucket, Key="elsewhere/secret", Body=b"secret")
    admin.create_bucket(Bucket=f"{iam_s3.bucket}-other")
    s3 = iam_s3.client("s3", iam_s3.user(as_moto_checks_it(the_policy(iam_s3.bucket))))

    s3.head_bucket(Bucket=iam_s3.bucket)  # what pyarrow's create_dir sends first
    s3.put_object(Bucket=iam_s3.bucket, Key=f"{prefix}/probe", Body=b"ok")
    assert s3.get_object(Bucket=iam_s3.bucket, Key=f"{prefix}/probe")["Body"].read() == b"ok"
    s3.delete_object(Bucket=iam_s3.bucket, Key=f"{prefix}/probe")
    denied = [
        lambda: s3.put_object(Bucket=iam_s3.bucket, Key="elsewhere/x", Body=b"x"),
        lambda: s3.put_object(Bucket=iam_s3.bucket, Key=f"{prefix}-evil/x", Body=b"x"),
        lambda: s3.put_object(Bucket=iam_s3.bucket, Key="top-level", Body=b"x"),
        lambda: s3.get_object(Bucket=iam_s3.bucket, Key="elsewhere/secret"),
        lambda: s3.delete_object(Bucket=iam_s3.bucket, Key="elsewhere/secret"),
        lambda: s3.put_object(Bucket=f"{iam_s3.bucket}-other", Key=f"{prefix}/x", Body=b"x"),
        lambda: s3.list_objects_v2(Bucket=f"{iam_s3.bucket}-other"),
        lambda: s3.head_bucket(Bucket=f"{iam_s3.bucket}-other"),
        lambda: s3.create_bucket(Bucket=f"{iam_s3.bucket}-new"),
        lambda: s3.delete_bucket(Bucket=iam_s3.bucket),
        lambda: s3.list_buckets(),
    ]
    for call in denied:
        with pytest.raises(ClientError) as info:
            call()
        assert info.value.response["Error"]["Code"] in ("AccessDenied", "403"), info.value
    # The one thing beyond the prefix: key *names* of the whole bucket can be listed (what
    # an unconditioned s3:ListBucket means on AWS too): hence a dedicated runs bucket.
    listed = s3.list_objects_v2(Bucket=iam_s3.bucket)["Contents"]
    assert "elsewhere/secret" in {o["Key"] for o in listed}
    assert admin.get_object(Bucket=iam_s3.bucket, Key="elsewhere/secret")["Body"].read()


# --------------------------------------------------------------------------- fit end to end


def _cli(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m raytrain_mnist ...`` in exactly ``env`` (conftest's ``run_cli`` would put
    this process's environment under it)."""
    return subprocess.run(
        [sys.executable, "-m", "raytrain_mnist", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env=env,
    )


def _read_until(process: subprocess.Popen, start: str, seen: list[str]) -> None:
    """Lines of ``process`` onto ``seen`` up to the first that starts with ``start``."""
    for line in process.stdout:
        seen.append(line)
        if line.startswith(start):
            return
    raise AssertionError(f"no line {start!r}:\n{''.join(seen)}")


def _train_workers(marker: str) -> list[int]:
    """The Ray Train workers (by their process title) of the command carrying ``marker``."""
    pids = []
    for pid in marked(marker):
        with contextlib.suppress(OSError):
            if b"RayTrainWorker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.append(pid)
    return pids


@pytest.mark.timeout(1800)  # three fits, three refusals, a walk-through, an evaluation: long
def test_an_s3_run_is_claimed_refused_kept_stopped_resumed_and_evaluated_under_the_policy(
    iam_s3, tiny_mnist, sample_digits, tmp_path, monkeypatch
):
    """Through the real CLI, every command holding only the worker policy: everything a
    local run guarantees, and every byte Ray Train and the run records write and read goes
    through the policy. The first fit is also a newcomer's first hour on S3 (``--json``,
    then runs, runs show, predict and export reading the run from the bucket): one s3 fit
    for both."""
    env = iam_s3.env(iam_s3.user(as_moto_checks_it(the_policy(iam_s3.bucket))))
    admin = iam_s3.client("s3", iam_s3.admin)
    prefix, storage = _prefix(json.loads(POLICY.read_text())), _storage(iam_s3)

    def summary_of(name: str) -> dict:
        key = f"{prefix}/{name}/summary.json"
        return json.loads(admin.get_object(Bucket=iam_s3.bucket, Key=key)["Body"].read())

    first = _cli(env, "fit", *_fit_args(iam_s3, tiny_mnist, "s3run", 2), "--json")
    assert first.returncode == 0, first.stdout + first.stderr
    summary = summary_of("s3run")
    assert summary["status"] == "finished" and summary["epochs_completed"] == 2, summary
    assert summary["best_checkpoint"].startswith(f"{storage}/s3run/checkpoint_"), summary
    _the_first_hour(first, storage, env, sample_digits, tmp_path, monkeypatch)

    again = _cli(env, "fit", *_fit_args(iam_s3, tiny_mnist, "s3run", 2))
    assert again.returncode == 0 and "already finished" in again.stdout, again
    assert "starting run" not in again.stdout

    other = _cli(env, "fit", *_fit_args(iam_s3, tiny_mnist, "s3run", 2), "--lr", "0.05")
    assert other.returncode == 2 and "other settings" in other.stderr, other
    assert summary_of("s3run") == summary

    # --fresh keeps the old run and trains anew; after its first epoch its worker is held
    # (SIGSTOP) so that the run is still running, however long what follows takes: a second
    # command is refused, Ctrl-C stops it (the worker is let go once the command has taken
    # the Ctrl-C), then the printed command resumes it. Four epochs: the worker is at most
    # a controller poll past the first epoch's line when it is held.
    marker = uuid.uuid4().hex
    epochs = 4
    fresh = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "raytrain_mnist",
            "fit",
            "--fresh",
            *_fit_args(iam_s3, tiny_mnist, "s3run", epochs),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**env, "PYTHONUNBUFFERED": "1", MARKER_VAR: marker},
    )
    workers: list[int] = []
    try:
        seen: list[str] = []
        _read_until(fresh, f"epoch   1/{epochs}", seen)
        workers = _train_workers(marker)
        assert len(workers) == 1, workers
        signal_all(workers, signal.SIGSTOP)
        clash = _cli(env, "fit", *_fit_args(iam_s3, tiny_mnist, "s3run", epochs), timeout=120)
        assert clash.returncode == 1 and "'s3run' is already running" in clash.stderr, clash
        fresh.send_signal(signal.SIGINT)
        _read_until(fresh, "Ctrl-C: stopping the workers", seen)
        signal_all(workers, signal.SIGCONT)
        out, _ = fresh.communicate(timeout=600)  # generous: a loaded machine stops slowly
        out = "".join(seen) + out
        assert fresh.returncode == 130, out
        no_process_left(marker)  # the Ray the command started went with it
        assert summary_of("s3run.previous-1") == summary
        resume = out.split("resume with: ")[1].splitlines()[0]
        resumed = subprocess.run(
            shlex.split(resume),
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=900,
            env={**env, MARKER_VAR: marker},
        )
    finally:
        signal_all(workers, signal.SIGCONT)
        kill_marked(marker)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    final = summary_of("s3run")
    assert final["status"] == "finished" and final["resumed_from_epoch"] >= 1, final
    assert [h["epoch"] for h in final["history"]] == list(range(1, epochs + 1))
    assert final["best_checkpoint"].startswith(f"{storage}/s3run/checkpoint_"), final

    report = _cli(
        env,
        "evaluate",
        f"{storage}/s3run",
        "--data-dir",
        str(tiny_mnist),
        "--out",
        str(tmp_path / "eval"),
    )
    assert report.returncode == 0, report.stderr
    evaluation = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    assert evaluation["accuracy"] == final["best_val_accuracy"]
    assert evaluation["checkpoint"] == final["best_checkpoint"]

    keys = {
        o["Key"]
        for page in admin.get_paginator("list_objects_v2").paginate(Bucket=iam_s3.bucket)
        for o in page.get("Contents", [])
    }
    assert any(k.startswith(f"{prefix}/s3run/checkpoint_") for k in keys), keys
    assert all(k.startswith(f"{prefix}/") or k.startswith("elsewhere/") for k in keys), keys


def _the_first_hour(fit, storage: str, env: dict, sample_digits, tmp_path, monkeypatch) -> None:
    """``fit --json`` into s3:// (``fit``, the command's result), then runs, runs show,
    predict on PNG files of test digits and export, each through the real CLI, reading the
    run from the bucket, holding what ``env`` holds. fit ran in a process of its own (it
    starts its Ray); the rest start none, so they run in this one (``run_cli_here``: the same
    entry point, stdout and stderr apart)."""
    from PIL import Image

    summary = json.loads(fit.stdout)  # stdout holds the one object, nothing else
    assert summary["status"] == "finished" and summary["name"] == "s3run"
    assert summary["run_dir"] == f"{storage}/s3run"
    assert "epoch   1/2" in fit.stderr  # the run's lines went to stderr

    for key in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)  # this process holds the worker policy too
    runs = json.loads(run_cli_here("runs", "--storage-path", storage, "--json").stdout)
    (entry,) = runs["runs"]
    assert (entry["name"], entry["status"], entry["epochs_done"]) == ("s3run", "finished", 2)
    assert entry["best_val_accuracy"] == summary["best_val_accuracy"]
    show = run_cli_here("runs", "show", "s3run", "--storage-path", storage)
    assert show.returncode == 0, show.stderr
    assert f"best checkpoint: {summary['best_checkpoint']}" in show.stdout
    assert "fit" in show.stdout.split("train again with:")[1]

    images, _ = sample_digits
    pngs = []
    for i in range(8):  # the tiny set's first test digits, dark on light, 112x112
        path = tmp_path / f"digit{i}.png"
        Image.fromarray(255 - images[2048 + i]).resize((112, 112)).save(path)
        pngs.append(str(path))
    predict = run_cli_here("predict", f"{storage}/s3run", *pngs, "--json")
    assert predict.returncode == 0, predict.stderr
    predicted = json.loads(predict.stdout)["predictions"]
    assert [p["source"] for p in predicted] == pngs
    assert all(0 <= p["label"] <= 9 for p in predicted)

    output = tmp_path / "first.pt2"
    export = run_cli_here(
        "export", f"{storage}/s3run", "--format", "pt2", "--output", str(output), "--json"
    )
    assert export.returncode == 0, export.stderr
    assert json.loads(export.stdout)["output"] == str(output)
    assert Path(f"{output}.json").is_file()
    _check_program(output, pngs, predicted)


def _check_program(path: Path, pngs: list[str], predicted: list[dict]) -> None:
    """The exported program labels the PNGs as predict did."""
    import numpy as np
    import torch

    from raytrain_mnist.nn.model import normalize
    from raytrain_mnist.serving.images import png_to_mnist

    pixels = np.stack([png_to_mnist(Path(p).read_bytes()) for p in pngs])
    program = torch.export.load(str(path)).module()
    with torch.no_grad():
        logits = program(normalize(torch.from_numpy(pixels)))
    assert logits.argmax(1).tolist() == [p["label"] for p in predicted]


def _without_list_bucket(policy: dict) -> dict:
    policy = copy.deepcopy(policy)
    for statement in policy["Statement"]:
        statement["Action"] = [a for a in _actions(statement) if a != "s3:ListBucket"]
    policy["Statement"] = [s for s in policy["Statement"] if s["Action"]]
    return policy


def _list_bucket_under_the_prefix_only(policy: dict) -> dict:
    """The policy this file had before: listing allowed only with ``s3:prefix`` under the
    runs prefix, which no HeadBucket carries."""
    prefix = _prefix(json.loads(POLICY.read_text()))
    bucket_arn = next(s["Resource"] for s in policy["Statement"] if "s3:ListBucket" in _actions(s))
    policy = _without_list_bucket(policy)
    policy["Statement"].append(
        {
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": bucket_arn,
            "Condition": {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}},
        }
    )
    return policy


@pytest.mark.parametrize("plant", [_without_list_bucket, _list_bucket_under_the_prefix_only])
def test_without_list_bucket_on_the_bucket_the_run_fails_in_one_line(iam_s3, tiny_mnist, plant):
    policy = the_policy(iam_s3.bucket)
    planted = plant(policy)
    assert planted != policy
    env = iam_s3.env(iam_s3.user(as_moto_checks_it(planted)))
    name = f"planted-{plant.__name__.strip('_')}"
    marker = uuid.uuid4().hex
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "raytrain_mnist",
                "fit",
                *_fit_args(iam_s3, tiny_mnist, name, 2),
            ],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
            env={**env, MARKER_VAR: marker},
        )
    finally:
        kill_marked(marker)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "HeadBucket" in lines[0] and "ACCESS_DENIED" in lines[0], lines[0]
    assert f"{_storage(iam_s3)}/{name}" in lines[0], lines[0]
