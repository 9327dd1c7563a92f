"""What a run's files say is checked before it is followed (issue 22, items 2, 8 and 10).

A run directory can be written by anyone who can write the storage (every worker node, on an
object store). These tests copy a real run (the shared ``fitted`` one), plant what such a
writer could plant, and check that ``fit`` and ``evaluate`` neither read nor write outside
the run: a directory *outside* it holds a valid checkpoint and a report-shaped file that must
stay untouched (same names, same bytes, and, where this file system keeps access times,
never read). Each plant is one line and a non-zero exit, or is ignored.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from raytrain_mnist.config import flags_of
from raytrain_mnist.driver.runs import (
    MAX_CHECKPOINT_BYTES,
    SNAPSHOT_FILE,
    CorruptSnapshot,
    Run,
    RunStorage,
    is_safe_name,
)
from raytrain_mnist.driver.runs import storage as storage_module
from raytrain_mnist.driver.runs.storage import atomic_write, local_copy
from raytrain_mnist.errors import UserError
from tests.conftest import REPO, run_cli_here, write_tiny_mnist

# --------------------------------------------------------------------------- helpers


def _one_line(result, code: int | None, *fragments: str) -> str:
    """One line on stderr holding ``fragments``, exit ``code`` (None: any but 0)."""
    err = result.stderr
    if code is None:
        assert result.returncode != 0, result.stdout + err
    else:
        assert result.returncode == code, result.stdout + err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _tree(root: Path) -> dict:
    """Every entry under ``root``, links as links (never followed), files with their bytes."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            key = str(path.relative_to(root))
            if path.is_symlink():
                out[key] = ("link", os.readlink(path))
            elif path.is_file():
                out[key] = path.read_bytes()
            else:
                out[key] = "dir"
    return out


class Outside:
    """A directory beside the run that nothing may read or write: its entries, their bytes,
    and (where the file system records reads) their access times are compared."""

    OLD = time.time() - 3 * 86400  # relatime records a read of a file not read for a day

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def seal(self) -> Outside:
        self.before = _tree(self.root)  # reads every file: the times are set afterwards
        for path in self.root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                os.utime(path, (self.OLD + 3600, self.OLD))
        self.times = self._times()
        probe = self.root.parent / f".atime-probe-{uuid.uuid4().hex}"
        probe.write_bytes(b"x")
        os.utime(probe, (self.OLD + 3600, self.OLD))
        probe.read_bytes()
        self.reads_recorded = probe.stat().st_atime != self.OLD + 3600
        probe.unlink()
        return self

    def _times(self) -> dict:
        return {
            str(p.relative_to(self.root)): (p.stat().st_atime, p.stat().st_mtime)
            for p in self.root.rglob("*")
            if p.is_file() and not p.is_symlink()
        }

    def assert_untouched(self) -> None:
        times = self._times()  # before reading anything again
        if self.reads_recorded:
            assert times == self.times, "a file outside the run was read or written"
        assert _tree(self.root) == self.before, "something outside the run changed"


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    """A copy of the shared fit's run, ``<tmp>/runs/copy``, without reports of other tests."""
    copy = tmp_path / "runs" / "copy"
    shutil.copytree(trained_run["run_dir"], copy, symlinks=True)
    for report in copy.glob("evaluation_*"):
        shutil.rmtree(report)
    return copy


@pytest.fixture
def outside(trained_run, tmp_path) -> Outside:
    """``<tmp>/outside``: a valid-looking checkpoint (the run's own best weights) and a
    report-shaped file, both never to be used."""
    place = Outside(tmp_path / "outside")
    shutil.copytree(trained_run["best_checkpoint"], place.root / "checkpoint_evil")
    (place.root / "evaluation.json").write_text('{"kept": true}\n')
    return place


def _snapshot(run_dir: Path) -> dict:
    return json.loads((run_dir / SNAPSHOT_FILE).read_text())


def _plant_snapshot(run_dir: Path, name: str) -> None:
    """The planted name as the latest checkpoint and the best kept one."""
    snapshot = _snapshot(run_dir)
    entry = {"checkpoint_dir_name": name, "metrics": {"epoch": 99, "val_accuracy": 1.0}}
    snapshot["latest_checkpoint_result"] = entry
    snapshot["checkpoint_results"] = [*snapshot["checkpoint_results"], entry]
    (run_dir / SNAPSHOT_FILE).write_text(json.dumps(snapshot))


def _fit_args(fitted, run_dir: Path) -> list[str]:
    """The shared fit's command, aimed at ``run_dir``: its identity matches, so a resume
    reads the snapshot."""
    cfg = fitted["cfg"]
    flags = flags_of(cfg.train, cfg.run, skip=("fresh", "name", "storage_path"))
    return ["fit", *flags, "--storage-path", str(run_dir.parent), "--name", run_dir.name]


def _interrupted(run_dir: Path) -> None:
    """As a run stopped before its end leaves it: no summary, so fit resumes it."""
    (run_dir / "summary.json").unlink()


# --------------------------------------------------------------------------- Ray's snapshot

PLANTED = {
    "dotdot": lambda run_dir, outside: "../../outside/checkpoint_evil",
    "etc": lambda run_dir, outside: "../../etc",
    "absolute": lambda run_dir, outside: str(outside.root / "checkpoint_evil"),
    "link": lambda run_dir, outside: (
        os.symlink(outside.root / "checkpoint_evil", run_dir / "checkpoint_link")
        or "checkpoint_link"
    ),
}


@pytest.mark.parametrize("plant", sorted(PLANTED))
def test_a_planted_snapshot_entry_is_never_followed(
    plant, fitted, run_copy, outside, tiny_mnist, tmp_path
):
    _plant_snapshot(run_copy, PLANTED[plant](run_copy, outside))
    outside.seal()
    snapshot_path = f"{run_copy}/{SNAPSHOT_FILE}"

    evaluated = run_cli_here("evaluate", str(run_copy), "--data-dir", str(tiny_mnist))
    _one_line(evaluated, 1, f"cannot read the checkpoints of {run_copy}", snapshot_path, "corrupt")
    assert not list(run_copy.glob("evaluation_*")) and not list(tmp_path.glob("evaluation_*"))

    _interrupted(run_copy)
    before = _tree(run_copy)
    resumed = run_cli_here(*_fit_args(fitted, run_copy))
    _one_line(resumed, 1, f"cannot resume: {snapshot_path} is corrupt", "pass --fresh")
    assert _tree(run_copy) == before
    outside.assert_untouched()


CORRUPT = {
    "not JSON": '{"latest_checkpoint_result": {"checkpoint_dir_n',
    "empty": "",
    "a list": "[]",
    "latest is a string": '{"latest_checkpoint_result": "checkpoint_000001"}',
    "entry without a name": '{"checkpoint_results": [{"metrics": {}}]}',
    "results not a list": '{"checkpoint_results": {"checkpoint_dir_name": "x"}}',
    "metrics not an object": (
        '{"latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_1", "metrics": 3}}'
    ),
    "a name with a query": (
        '{"latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_1?x=y", "metrics": {}}}'
    ),
    "a name list with a path": '{"validated_checkpoint_dir_names": ["a/b"]}',
}


@pytest.mark.parametrize("shape", sorted(CORRUPT))
def test_a_corrupt_snapshot_is_one_error_never_a_restart_at_epoch_0(
    shape, fitted, run_copy, tiny_mnist
):
    """Read as "no checkpoints", the resume would train again from epoch 0 over the run."""
    (run_copy / SNAPSHOT_FILE).write_text(CORRUPT[shape])
    _interrupted(run_copy)
    before = _tree(run_copy)
    started = time.monotonic()
    resumed = run_cli_here(*_fit_args(fitted, run_copy))
    line = _one_line(
        resumed,
        1,
        f"cannot resume: {run_copy}/{SNAPSHOT_FILE} is corrupt",
        "move it away or pass --fresh",
    )
    assert "epoch" not in resumed.stdout, resumed.stdout  # nothing trained
    assert time.monotonic() - started < 60, line  # refused before any Ray Train starts
    assert _tree(run_copy) == before


def test_the_checkpoints_ray_committed_are_still_found(run_copy, trained_run):
    """The checks pass Ray's own record as it writes it."""
    run = Run.at(run_copy)
    names = {Path(p).name for p, _ in run.checkpoints()}
    assert Path(trained_run["best_checkpoint"]).name in names
    assert run.best_checkpoint() == f"{run_copy}/{Path(trained_run['best_checkpoint']).name}"
    assert run.latest_checkpoint() == f"{run_copy}/{Path(trained_run['latest_checkpoint']).name}"


def test_a_summary_path_outside_the_run_is_not_relocated_through_a_link(run_copy, outside):
    """Without a snapshot, the summary's recorded checkpoint is taken by its name, inside
    the run, and not when that name is a link out of it."""
    (run_copy / SNAPSHOT_FILE).unlink()
    os.symlink(outside.root / "checkpoint_evil", run_copy / "checkpoint_evil")
    run = Run.at(run_copy)
    assert run.relocate(str(outside.root / "checkpoint_evil")) is None
    assert run.relocate(["not", "a", "path"]) is None
    assert run.relocate("/elsewhere/checkpoint_000001") == f"{run_copy}/checkpoint_000001"
    assert run.relocate("/elsewhere/checkpoint_1/../../x") is None


# --------------------------------------------------------------------------- best.json


@pytest.mark.parametrize("plant", ["dotdot", "link", "absolute"])
def test_a_planted_best_trial_is_never_followed(plant, trained_run, tmp_path, tiny_mnist):
    """A Tune experiment's best.json names its best trial: one folder under runs/."""
    place = Outside(tmp_path / "outside")
    shutil.copytree(trained_run["run_dir"], place.root / "trial", symlinks=True)  # valid
    experiment = tmp_path / "tune-x"
    (experiment / "runs").mkdir(parents=True)
    (experiment / "search.json").write_text(json.dumps({"dataset": "mnist"}))
    trial = {
        "dotdot": "../../outside/trial",
        "absolute": str(place.root / "trial"),
        "link": "t0",
    }[plant]
    if plant == "link":
        os.symlink(place.root / "trial", experiment / "runs" / "t0")
    (experiment / "best.json").write_text(
        json.dumps({"best_trial": trial, "metric": "val_accuracy", "mode": "max"})
    )
    place.seal()
    result = run_cli_here("evaluate", str(experiment), "--data-dir", str(tiny_mnist))
    if plant == "link":
        _one_line(result, 1, "(t0) leads outside the experiment")
    else:
        _one_line(result, 1, f"names best trial {trial!r}", "not one folder under runs/")
    place.assert_untouched()
    assert not list(experiment.rglob("evaluation*"))


def test_a_best_json_of_the_wrong_shape_is_one_line(trained_run, tmp_path):
    experiment = tmp_path / "tune-x"
    shutil.copytree(trained_run["run_dir"], experiment / "runs" / "t0")
    (experiment / "search.json").write_text(json.dumps({"dataset": "mnist"}))
    (experiment / "best.json").write_text(json.dumps({"best_trial": "t0", "metric": ["x"]}))
    result = run_cli_here("evaluate", str(experiment))
    _one_line(result, 1, "is not a search record of raytrain_mnist")


# --------------------------------------------------------------------------- the report


def _default_out(run_copy: Path) -> Path:
    return run_copy / f"evaluation_{Path(Run.at(run_copy).best_checkpoint()).name}"


@pytest.mark.parametrize("link", ["folder", "evaluation.json", "confusion_matrix.png"])
def test_evaluate_never_writes_through_a_planted_link(link, run_copy, outside, tiny_mnist):
    out = _default_out(run_copy)  # inside the run: anyone who writes the storage may plant
    if link == "folder":
        os.symlink(outside.root, out)
    else:
        out.mkdir()
        os.symlink(outside.root / "evaluation.json", out / link)
    outside.seal()
    args = ("evaluate", str(run_copy), "--data-dir", str(tiny_mnist), "--overwrite")
    result = run_cli_here(*args)
    path = out if link == "folder" else out / link
    _one_line(result, 2, f"{path} is a symbolic link", "pass --out DIR")
    outside.assert_untouched()
    assert path.is_symlink()


def test_the_report_is_replaced_whole_and_leaves_no_temporary_file(run_copy, tiny_mnist):
    out = _default_out(run_copy)
    first = run_cli_here("evaluate", str(run_copy), "--data-dir", str(tiny_mnist))
    assert first.returncode == 0, first.stderr
    report = (out / "evaluation.json").read_bytes()
    inode = (out / "evaluation.json").stat().st_ino
    again = run_cli_here("evaluate", str(run_copy), "--data-dir", str(tiny_mnist), "--overwrite")
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "confusion_matrix.png",
        "evaluation.json",
        "misclassified.png",
    ]  # no temporary file left
    assert (out / "evaluation.json").read_bytes() == report
    assert (out / "evaluation.json").stat().st_ino != inode  # a new file renamed into place


# --------------------------------------------------------------------------- data_dir


def test_a_recorded_data_dir_is_followed_only_to_the_runs_own_data(
    run_copy, tmp_path, sample_digits
):
    """summary.json's config.run.data_dir is where the run read MNIST: followed when no
    --data-dir is given, but only the fixed IDX names are read there, and the data must be
    the run's own (its fingerprint)."""
    images, labels = sample_digits
    other = write_tiny_mnist(tmp_path / "other", (images[::-1], labels[::-1]), 2048, 203)
    summary_path = run_copy / "summary.json"
    summary = json.loads(summary_path.read_text())

    def with_data_dir(value):
        planted = {**summary, "config": {**summary["config"]}}
        planted["config"]["run"] = {**summary["config"]["run"], "data_dir": value}
        summary_path.write_text(json.dumps(planted))
        return run_cli_here("evaluate", str(run_copy), "--out", str(tmp_path / "out"))

    _one_line(with_data_dir(str(other)), 2, "is not the data run 'copy' trained on")
    _one_line(with_data_dir("/etc"), None, "/etc")  # no MNIST there: nothing else is read
    for value in (["/etc"], {"x": 1}, 7):  # not a path: not followed
        _one_line(with_data_dir(value), None, "MNIST")
    summary_path.write_text(json.dumps({**summary, "config": "x", "data_source": 5}))
    result = run_cli_here("evaluate", str(run_copy), "--out", str(tmp_path / "out"))
    _one_line(result, None, "MNIST")
    assert not (tmp_path / "out").exists()
    # The run's own record, as fit wrote it, is followed.
    summary_path.write_text(json.dumps(summary))
    result = run_cli_here("evaluate", str(run_copy), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------- names, URIs


def test_recorded_names_are_single_safe_segments():
    for name in ("checkpoint_2026-01-01_00-00-00.000000", "f3a1c_00000", "mnist-2w-abc"):
        assert is_safe_name(name), name
    for name in ("", ".", "..", "../x", "a/b", "/etc", "a?b", "a#b", "a%2e", "a\\b", 5, None):
        assert not is_safe_name(name), name


def test_a_uri_recorded_in_a_run_stays_in_its_bucket_and_prefix():
    files = RunStorage("s3://bucket/runs", "r")
    assert files.contains("s3://bucket/runs/r/checkpoint_1")
    assert files.contains("s3://bucket/runs/r/checkpoint_1/")
    for path in (
        "s3://bucket/runs/r/../other/checkpoint_1",
        "s3://bucket/runs/r/./checkpoint_1",
        "s3://bucket/runs/r//checkpoint_1",
        "s3://bucket/runs/r/checkpoint_1?endpoint_override=evil.example",
        "s3://bucket/runs/r/checkpoint_1#x",
        "s3://other/runs/r/checkpoint_1",
        "s3://bucket/runs/rr/checkpoint_1",
        "gs://bucket/runs/r/checkpoint_1",
        "/bucket/runs/r/checkpoint_1",
    ):
        assert not files.contains(path), path


# --------------------------------------------------------------------------- object stores


def _upload(run_dir: Path, bucket: str, name: str) -> str:
    import pyarrow.fs

    target = f"s3://{bucket}/runs/{name}"
    fs, path = pyarrow.fs.FileSystem.from_uri(target)
    pyarrow.fs.copy_files(
        str(run_dir),
        path,
        source_filesystem=pyarrow.fs.LocalFileSystem(),
        destination_filesystem=fs,
    )
    return target


def test_a_checkpoint_download_is_bounded(s3, run_copy, tiny_mnist, tmp_path, monkeypatch):
    client, bucket = s3.client, s3.bucket()
    uri = _upload(run_copy, bucket, f"r-{uuid.uuid4().hex[:6]}")
    best = Path(Run.at(run_copy).best_checkpoint()).name
    size = sum(p.stat().st_size for p in (run_copy / best).rglob("*") if p.is_file())
    assert size < 2 * 2**20 < MAX_CHECKPOINT_BYTES  # what the bound's comment says

    out = tmp_path / "eval"
    result = run_cli_here("evaluate", uri, "--data-dir", str(tiny_mnist), "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "evaluation.json").read_text())["checkpoint"] == f"{uri}/{best}"

    monkeypatch.setattr(storage_module, "MAX_CHECKPOINT_BYTES", size - 1)
    result = run_cli_here(
        "evaluate", uri, "--data-dir", str(tiny_mnist), "--out", str(tmp_path / "small")
    )
    _one_line(result, 1, f"refusing to download checkpoint {uri}/{best}", f"holds {size} bytes")
    assert not (tmp_path / "small").exists()

    # A key that would lead out of the download folder is refused, nothing is written.
    prefix = uri.removeprefix(f"s3://{bucket}/")
    escaped = f"escaped-{uuid.uuid4().hex}"
    client.put_object(Bucket=bucket, Key=f"{prefix}/{best}/../../../{escaped}", Body=b"x")
    with pytest.raises(UserError, match=r"not a plain path inside it"):
        with local_copy(f"{uri}/{best}"):
            pass
    import tempfile

    for place in ("/", tempfile.gettempdir(), Path(tempfile.gettempdir()).parent):
        assert not (Path(place) / escaped).exists()


def test_a_planted_snapshot_entry_on_s3_is_never_followed(s3, run_copy, tiny_mnist, tmp_path):
    bucket = s3.bucket()
    original = (run_copy / SNAPSHOT_FILE).read_text()
    for name in ("../other/checkpoint_1", f"s3://{bucket}/elsewhere", "checkpoint_1?versionId=1"):
        (run_copy / SNAPSHOT_FILE).write_text(original)
        _plant_snapshot(run_copy, name)
        uri = _upload(run_copy, bucket, f"r-{uuid.uuid4().hex[:6]}")
        with pytest.raises(CorruptSnapshot, match="is not one folder inside the run"):
            Run.at(uri).best_checkpoint()
        out = tmp_path / "out"
        result = run_cli_here("evaluate", uri, "--data-dir", str(tiny_mnist), "--out", str(out))
        _one_line(result, 1, f"{uri}/{SNAPSHOT_FILE} is corrupt")
        assert not out.exists()


# --------------------------------------------------------------------------- a full disk

_WRITE = r"""
import json, os, resource, signal, sys
from pathlib import Path
from raytrain_mnist.driver.runs import RunStorage
from raytrain_mnist.errors import UserError

root, how = sys.argv[1], sys.argv[2]
files = RunStorage(root, "r")
files.write_json("summary.json", {"status": "before"})
if how == "fsize":  # a file may grow to 64 KiB: the write fails midway with EFBIG
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
try:
    files.write_bytes("summary.json", b"x" * (4 << 20))
    error = None
except UserError as exc:
    error = str(exc)
print(json.dumps({
    "error": error,
    "listing": sorted(os.listdir(Path(root) / "r")),
    "summary": (Path(root) / "r" / "summary.json").read_text(),
}))
"""


def _can_mount_tmpfs(tmp_path: Path) -> str | None:
    """None when this process may mount a tmpfs in a private mount namespace, else why not."""
    if os.geteuid() != 0:
        return "not root: no tmpfs can be mounted"
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = tmp_path / "probe"
    probe.mkdir()
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "mount", "-t", "tmpfs", "tmpfs", probe],
        capture_output=True,
        text=True,
    )
    return None if result.returncode == 0 else f"cannot mount a tmpfs: {result.stderr.strip()}"


def _check_failed_write(result, errno_text: str) -> None:
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["error"] is not None, "the write did not fail"
    assert errno_text in seen["error"] and "is kept" in seen["error"], seen["error"]
    assert "\n" not in seen["error"]
    assert seen["listing"] == ["summary.json"], seen["listing"]  # no temporary file left
    assert json.loads(seen["summary"]) == {"status": "before"}  # the previous file, whole


def test_a_full_disk_leaves_the_previous_file_and_no_temporary_file(tmp_path):
    """A real full disk: a 1 MiB tmpfs in a mount namespace of its own (root only)."""
    if reason := _can_mount_tmpfs(tmp_path):
        pytest.skip(reason)
    disk = tmp_path / "disk"
    disk.mkdir()
    script = 'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$1" -c "$2" "$0" full'
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
        + [str(disk), sys.executable, _WRITE],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    _check_failed_write(result, "No space left on device")
    assert not any(disk.iterdir())  # it all happened on the tmpfs


def test_a_write_that_fails_midway_leaves_the_previous_file(tmp_path):
    """The same without root: the file size limit cuts the write off after 64 KiB."""
    result = subprocess.run(
        [sys.executable, "-c", _WRITE, str(tmp_path), "fsize"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    _check_failed_write(result, "File too large")


def test_a_payload_that_cannot_be_written_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "f.json"
    target.write_text("before")
    with pytest.raises(TypeError):
        atomic_write(target, object())  # type: ignore[arg-type]
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]
    assert target.read_text() == "before"


def test_a_run_file_that_is_a_link_is_replaced_never_written_through(tmp_path):
    place = Outside(tmp_path / "outside")
    (place.root / "summary.json").write_text('{"kept": true}')
    place.seal()
    (tmp_path / "runs" / "r").mkdir(parents=True)
    os.symlink(place.root / "summary.json", tmp_path / "runs" / "r" / "summary.json")
    Run(tmp_path / "runs", "r").write_json("summary.json", {"status": "finished"})
    written = tmp_path / "runs" / "r" / "summary.json"
    assert not written.is_symlink() and json.loads(written.read_text()) == {"status": "finished"}
    place.assert_untouched()
