"""`tune` end to end on real Ray (CPU, Gloo): ASHA, results, resume; and bad search spaces.

Every search runs in a subprocess, as a user runs it, with a local Ray of its own. Each
subprocess gets a private RAY_TMPDIR: Ray's address discovery then never sees another
cluster's ``ray_current_cluster`` file, and every Ray process it leaves behind can be
found by that directory and stopped.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import psutil
import pytest
from PIL import Image

from raytrain_mnist.config import (
    DEFAULT_RECIPE,
    RECIPES,
    ConfigError,
    TrainConfig,
    recipe_config,
)
from raytrain_mnist.driver.searching import SearchResult
from raytrain_mnist.driver.searching.space import (
    SEARCH_SPACE,
    SEARCH_SPACES,
    Param,
    SearchSpace,
    parse_range,
)
from raytrain_mnist.nn import checkpoint as ckpt
from tests.conftest import (
    MARKER_VAR,
    REPO,
    kill_marked,
    run_cli,
    tiny_run_flags,
    write_tiny_mnist,
)

BEST_KEYS = {
    "best_val_accuracy",
    "best_config",
    "best_checkpoint",
    "fit_command",
    "num_trials",
    "num_stopped_early",
    "best_trial",
    "trials",
}


# --------------------------------------------------------------------------- no Ray


@pytest.mark.parametrize(
    "args, message",
    [
        (["--range", "lr=-1:0.1"], "lr"),
        (["--range", "lr=0.3:0.001"], "LOW must be below HIGH"),
        (["--range", "weight_decay=0:1e-3"], "LOW must be > 0"),
        (["--range", "momentum=-0.5:0.9"], "--momentum must be a number >= 0"),
        (["--set", "dropout=0.5"], "unknown parameter 'dropout'"),
        (["--range", "epochs=1,2"], "--max-epochs"),
        (["--set", "lr"], "NAME=VALUE"),
        (["--num-samples", "0"], "--num-samples must be an integer >= 1"),
        (["--max-concurrent-trials", "0"], "--max-concurrent-trials"),
        (["--range", "batch_size=64,100", "--num-workers", "3"], "multiple of 3"),
        (["--lr", "0.05", "--range", "lr=1e-3:0.1"], "both set lr"),
        (["--grace-period", "3", "--max-epochs", "2"], "--grace-period 3"),
        (["--range", "batch_size=1:8"], "list of values"),
    ],
)
def test_bad_search_input_is_one_line_and_exit_2(args, message, tmp_path):
    done = run_cli("tune", *args, "--storage-path", str(tmp_path), timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert "Traceback" not in done.stderr and not list(tmp_path.iterdir())


class _Planted:
    def __reduce__(self):
        return (os.system, (f"touch {PLANTED_MARK}",))


PLANTED_MARK = f"/tmp/raytrain_mnist_planted_{uuid.uuid4().hex[:8]}"


def _planted_tune_state() -> dict[str, bytes]:
    """What Tune's restore and analysis unpickle, written by someone else, with code inside:
    its tuner, the searcher's state, an experiment state (newer by name than any Tune
    writes) whose trials are a cloudpickle blob, and a trial's pickled error and params."""
    import pickle

    blob = pickle.dumps(_Planted())
    state = {"trial_data": {"_type": "CLOUDPICKLE_FALLBACK", "value": blob.hex()}}
    return {
        "tuner.pkl": blob,
        "experiment_state-9999-12-31_23-59-59.json": json.dumps(state).encode(),
        "basic-variant-state-9999-12-31_23-59-59.json": blob,
        "searcher-state-9999-12-31_23-59-59.pkl": blob,
        "trainable.pkl": blob,
    }


def _planted_trial_state() -> dict[str, bytes]:
    import pickle

    blob = pickle.dumps(_Planted())
    return {"error.pkl": blob, "params.pkl": blob}


def _plant_tune_state(exp: Path, trials: Sequence[str] = ()) -> None:
    exp.mkdir(parents=True, exist_ok=True)
    for name, payload in _planted_tune_state().items():
        (exp / name).write_bytes(payload)
    for trial in trials:
        (exp / f"trial_{trial}").mkdir(exist_ok=True)
        for name, payload in _planted_trial_state().items():
            (exp / f"trial_{trial}" / name).write_bytes(payload)


def test_a_planted_tune_state_or_trial_record_is_refused_before_anything_starts(tmp_path):
    """Tune's state in a directory this project did not write (no search.json) is someone
    else's experiment: refused, never read. A trial record that is not the one this search
    wrote for that trial is one line too, before Ray starts."""
    exp = tmp_path / "planted"
    _plant_tune_state(exp)
    common = ["--storage-path", str(tmp_path), "--name", "planted", "--dataset", "sample"]
    done = run_cli("tune", *common, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "never restored" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not os.path.exists(PLANTED_MARK)

    # The search's own identity, and a record of its first trial that claims other values.
    from raytrain_mnist.data import load_sample
    from raytrain_mnist.driver.runs import data_identity
    from raytrain_mnist.driver.searching.plan import draw_trials
    from raytrain_mnist.driver.searching.records import TRIAL_FILE
    from raytrain_mnist.driver.searching.space import experiment_identity
    from raytrain_mnist.tune import parse_command

    cmd = parse_command(common)
    identity = {
        **experiment_identity(cmd.space, cmd.settings, cmd.train, cmd.run),
        "data": data_identity(load_sample()),
    }
    (exp / "search.json").write_text(json.dumps(identity))
    name, values = draw_trials(cmd.space, cmd.settings, identity)[0]
    history = [{"epoch": 1, "val_accuracy": 0.9, "val_loss": 0.3}]
    record = {"trial_id": name, "config": values, "status": "stopped early", "history": history}
    (exp / "runs" / name).mkdir(parents=True)
    (exp / "runs" / name / TRIAL_FILE).write_text(
        json.dumps({**record, "config": {**values, "lr": 0.5}})
    )
    done = run_cli("tune", *common, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{name}/{TRIAL_FILE} is not a record" in lines[0], lines
    assert "its values are not the ones this search draws" in lines[0]
    assert "starting" not in done.stdout and not os.path.exists(PLANTED_MARK)


def test_a_trial_record_is_read_like_input():
    from raytrain_mnist.driver.searching.records import record_problem

    values = {"lr": 0.05}
    good = {
        "trial_id": "a_00000",
        "config": values,
        "status": "finished",
        "history": [
            {"epoch": 1, "val_accuracy": 0.5, "val_loss": 1.0},
            {"epoch": 2, "val_accuracy": None, "val_loss": None},  # a diverged epoch
        ],
    }
    assert record_problem(good, "a_00000", values, 2, "val_accuracy") is None
    h1, h2 = good["history"]
    for bad, problem in [
        ([], "not a JSON object"),
        ({**good, "trial_id": "b_00000"}, "it names trial 'b_00000'"),
        ({**good, "config": {"lr": 0.1}}, "its values are not"),
        ({**good, "status": "running"}, "status 'running'"),
        ({**good, "history": {}}, "history is not a list"),
        ({**good, "history": [h1, h2, h2]}, "history is not a list of 1 to 2"),
        ({**good, "history": [h1]}, "'finished' after 1 of 2"),
        ({**good, "status": "stopped early"}, "'stopped early' after 2 of 2"),
        ({**good, "history": [h2, h1]}, "epoch record 1 is of epoch 2"),
        ({**good, "history": [{**h1, "epoch": True}, h2]}, "epoch record 1 is of epoch True"),
        ({**good, "history": [h1, {**h2, "x": 1}]}, "epoch record 2 does not hold"),
        ({**good, "history": [h1, {**h2, "val_loss": "1"}]}, "val_loss '1' is not a finite"),
        ({**good, "history": [{**h1, "val_accuracy": 1.5}, h2]}, "is not an accuracy"),
    ]:
        assert problem in (record_problem(bad, "a_00000", values, 2, "val_accuracy") or ""), bad


def test_search_space_from_the_command_line():
    space = SearchSpace.from_cli(
        sets=["momentum=0.85"],
        ranges=["lr=1e-4:0.2", "batch_size=32,64"],
        fixed={"weight_decay": 1e-4},
    )
    assert space.params["lr"].kind == "loguniform" and space.params["lr"].low == 1e-4
    assert space.params["batch_size"].values == (32, 64)
    assert space.fixed_values() == {"momentum": 0.85, "weight_decay": 1e-4}
    assert space.searched == ["lr", "batch_size"]
    tune_space = space.param_space()["train_loop_config"]
    assert tune_space["momentum"] == 0.85 and tune_space["weight_decay"] == 1e-4
    assert parse_range("schedule=onecycle,constant")[1].values == ("onecycle", "constant")
    # Each recipe's values lie inside its default space, the defaults inside the default one.
    assert SEARCH_SPACES[DEFAULT_RECIPE] == SEARCH_SPACE
    assert recipe_config(DEFAULT_RECIPE) == TrainConfig()
    assert set(SEARCH_SPACES) == set(RECIPES)
    for recipe, params in SEARCH_SPACES.items():
        values = recipe_config(recipe)
        for name, param in params.items():
            value = getattr(values, name)
            inside = param.low <= value <= param.high if param.low is not None else None
            assert inside if inside is not None else value in param.values, (recipe, name)
    with pytest.raises(ConfigError, match="unknown parameter"):
        parse_range("nope=1,2")


def test_a_search_result_is_what_best_json_holds():
    """best.json: every field but the status, the best metric under its own name, the
    trials without their per-epoch history."""
    trial = {"trial_id": "a", "rank": 1, "history": [{"epoch": 1}], "config": {"lr": 0.1}}
    result = SearchResult(
        status="interrupted",
        name="s",
        experiment_dir="/x/s",
        metric="val_loss",
        mode="min",
        best_trial="a",
        best_metric=0.25,
        best_val_accuracy=0.9,
        best_epoch=1,
        best_config={"lr": 0.1},
        best_checkpoint="/x/s/runs/a/checkpoint_000000",
        fit_command="python -m raytrain_mnist fit --lr 0.1",
        num_trials=1,
        num_finished=0,
        num_stopped_early=0,
        num_errors=0,
        num_unfinished=1,
        search_space={},
        scheduler="asha",
        max_epochs=2,
        num_workers=1,
        wall_time_s=3.0,
        trials=[trial],
    )
    record = result.to_dict()
    assert list(record)[:7] == [
        "name",
        "experiment_dir",
        "metric",
        "mode",
        "best_trial",
        "best_val_loss",
        "best_val_accuracy",
    ]
    assert list(record)[-1] == "trials" and record["trials"] == [
        {"trial_id": "a", "rank": 1, "config": {"lr": 0.1}}
    ]
    assert "status" not in record and "best_metric" not in record
    assert json.loads(json.dumps(record)) == record
    assert result.trials[0]["history"]  # the result keeps them


def test_the_default_space_changed_in_python_is_the_command_lines():
    space = SearchSpace().with_params(lr=Param("loguniform", 0.02, 0.3))
    assert space == SearchSpace.from_cli(ranges=["lr=0.02:0.3"])
    assert SearchSpace().params == SEARCH_SPACE  # unchanged


# --------------------------------------------------------------------------- real searches


@pytest.fixture(scope="module")
def mixed_mnist(tmp_path_factory, sample_digits) -> Path:
    """Like ``tiny_mnist``, but drawn from every class: the sample is sorted by label, so
    its first 715 digits are 0s and 1s, and a test set of only 1s cannot tell a trained
    model from an untrained one."""
    import numpy as np

    images, labels = sample_digits
    order = np.random.default_rng(0).permutation(len(labels))
    return write_tiny_mnist(tmp_path_factory.mktemp("mixed"), (images[order], labels[order]))


def _tune_command(data: Path, storage: Path | str, name: str, *extra: str) -> list[str]:
    flags = tiny_run_flags(data, storage, name, *extra, cpus_per_worker=1)
    return [sys.executable, "-m", "raytrain_mnist.tune", *flags]


#: A line of Ray's Python logging: "2026-12-01 11:20:00,123\tERROR services.py:123 -- ...".
RAY_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+[A-Z]+ \S+\.py:\d+ -- ")


def test_ctrl_c_stops_the_search_prints_its_table_and_resume_command_and_exits_130(
    mixed_mnist, tmp_path, ray_env
):
    """Tune turns the first SIGINT into a graceful stop: the library returns an interrupted
    result (it raises nothing), the command prints the trials, the resume line and
    ``raytrain-mnist: interrupted``, and exits 130, as a Ctrl-C of fit does."""
    command = _tune_command(
        mixed_mnist,
        tmp_path,
        "stopped",
        "--num-samples",
        "2",
        "--max-epochs",
        "20",
        "--max-concurrent-trials",
        "1",
        "--scheduler",
        "fifo",
    )
    driver = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=ray_env,
        start_new_session=True,
    )
    seen: list[str] = []
    try:
        for line in driver.stdout:  # the trial starts inside Tune's fit: stop it there
            seen.append(line)
            if line.startswith("trial ") and " started: " in line:
                break
        assert any(" started: " in line for line in seen), "".join(seen)
        # Its Train run starts no placement-group cleaner: the search's reaper removes what
        # one would (a process less for every trial). Its workers up, a cleaner would be too.
        titles = _titles_once_up(driver, "ray::RayTrainWorker")
        assert any("ray::TrainController" in t for t in titles), titles
        assert not any("PlacementGroupCleaner" in t for t in titles), titles
        driver.send_signal(signal.SIGINT)
        out, err = driver.communicate(timeout=240)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=30)
    out = "".join(seen) + out
    assert driver.returncode == 130, out[-3000:] + err[-3000:]
    # Ray's own log lines may come after ours while it shuts down (a GCS call that timed out
    # on a loaded machine: "... ERROR services.py:N -- ... internal_kv_get"); ours end the rest.
    lines = [line for line in err.splitlines() if line.strip() and not RAY_LOG_LINE.match(line)]
    assert lines[-1] == "raytrain-mnist: interrupted", err[-3000:]
    assert (
        lines[-2].startswith("search interrupted with ")
        and " unfinished; resume with: " in (lines[-2])
    ), err[-3000:]
    assert "--name stopped" in lines[-2] and "Traceback" not in err
    assert "rank" in out and "unfinished" in out, out[-3000:]
    best = json.loads((tmp_path / "stopped" / "best.json").read_text())
    assert best["num_unfinished"] >= 1 and best["num_finished"] == 0


def _titles_once_up(driver: subprocess.Popen, title: str, timeout: float = 240) -> list[str]:
    """The command lines (a Ray actor's names its class) of ``driver``'s processes once one
    of them shows ``title``."""
    deadline = time.monotonic() + timeout
    while True:
        titles = []
        for process in psutil.Process(driver.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                titles.append(" ".join(process.cmdline()))
        if any(title in t for t in titles) or time.monotonic() > deadline:
            return titles
        time.sleep(0.2)


# --------------------------------------------------------------------------- s3


# Two searches and a library call: 225 s on a quiet 2-core machine (2026-12-02 14:27).
@pytest.mark.timeout(1200)
def test_asha_stops_a_bad_trial_and_a_killed_s3_search_resumes_never_running_what_storage_holds(
    s3, mixed_mnist, tmp_path, ray_env
):
    """ASHA stops the hopeless trial and the next still runs; a search whose driver is
    killed (SIGKILL: a crash) mid-trial resumes on an object store from this project's JSON
    records and each trial's weights-only checkpoint. Whoever can write the prefix could
    replace Tune's state with code: the planted pickles never run, the trials that ended
    are not trained again, the killed one resumes from its committed epoch, and the same
    search as a library call then trains nothing, starts no Ray and returns best.json."""
    from raytrain_mnist.driver.runs import Run

    storage = s3()
    bucket, _, prefix = storage.removeprefix("s3://").partition("/")
    exp = f"{storage}/asha"
    experiment = Run(storage, "asha")
    client = s3.client
    # Search seed 2 draws lr 0.05, 1e-6, 0.05 in that order; one trial at a time, so the
    # hopeless second trial reaches epoch 1 after the first finished, and ASHA stops it.
    # The local Ray declares 2 CPUs: a leaked worker placement group would starve the third,
    # which needs the CPU the stopped trial's workers held (ray-project/ray#54305).
    command = _tune_command(
        mixed_mnist,
        storage,
        "asha",
        "--num-samples",
        "3",
        "--max-epochs",
        "2",
        "--range",
        "lr=1e-6,0.05",
        "--max-concurrent-trials",
        "1",
        "--search-seed",
        "2",
        "--scheduler",
        "asha",
        "--grace-period",
        "1",
    )
    # ray_env is made after the S3 fixture: it holds the AWS_* variables of the server. No
    # wait for a stopped trial's thread: a trial actor reused after the early stop (Tune's
    # reuse_actors) then fails to reset every time, as it did whenever the stopped trial's
    # Train run took over 2 s to end, and the third trial never runs.
    env = {**ray_env, "TUNE_FUNCTION_THREAD_TIMEOUT_S": "0"}

    def tune_result(trial: str) -> bytes | None:
        """Tune's own result.json of a trial, as its driver last synced it to the store."""
        try:
            key = f"{prefix}/asha/trial_{trial}/result.json"
            return client.get_object(Bucket=bucket, Key=key)["Body"].read()
        except client.exceptions.NoSuchKey:
            return None

    # 1. Run until the third trial committed an epoch, then kill the driver and its Ray. Once
    # the third trial's Train run has written its first object, the driver is held (SIGSTOP):
    # ASHA can then never act on that trial's first result (on a loaded machine it stopped
    # the trial before the kill came), and the trial trains on without it to its commit.
    driver = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env=env,
        start_new_session=True,
    )
    seen: list[str] = []
    started: list[str] = []
    try:
        for line in driver.stdout:
            seen.append(line)
            if line.startswith("trial ") and " started: " in line:
                started.append(line.split()[1])
                if len(started) == 3:
                    break
        assert len(started) == 3, "".join(seen)
        third = Run(f"{exp}/runs", started[2])
        deadline = time.monotonic() + 240

        def until(done) -> None:  # the driver still there, within the deadline
            while not done():
                assert time.monotonic() < deadline and driver.poll() is None, "".join(seen)
                time.sleep(0.1)

        third_keys = {"Bucket": bucket, "Prefix": f"{prefix}/asha/runs/{started[2]}/"}
        until(lambda: client.list_objects_v2(**third_keys).get("KeyCount"))  # its run began
        os.kill(driver.pid, signal.SIGSTOP)  # the driver alone, not its Ray (same group)
        until(lambda: third.latest_checkpoint() is not None)  # Ray Train's record of the commit
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        kill_marked(ray_env[MARKER_VAR])
    output = "".join(seen)
    assert f"trial {started[0]} finished" in output
    assert f"trial {started[1]} stopped early after epoch 1" in output
    # The ended trials' records are written as they end, before the next one starts.
    ended = {t: Run(f"{exp}/runs", t) for t in started[:2]}
    records_before = {t: run.read_bytes("trial.json") for t, run in ended.items()}
    assert all(records_before.values()), records_before
    checkpoints_before = {t: [p for p, _ in run.checkpoints()] for t, run in ended.items()}
    assert checkpoints_before[started[0]], checkpoints_before
    # Tune syncs its result.json of a trial to the store now and then: as it is, or absent.
    results_before = {t: tune_result(t) for t in started[:2]}
    # Its last epoch may have committed before the kill took (held, the driver could not take
    # its first result), but the trial had not ended.
    third_before = [p for p, _ in third.checkpoints()]
    assert len(third_before) in (1, 2) and third.read_bytes("trial.json") is None, third_before

    # 2. Plant code where Tune keeps its state, at the experiment's root and in its trials.
    for name, payload in _planted_tune_state().items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/asha/{name}", Body=payload)
    for trial in started:
        for name, payload in _planted_trial_state().items():
            key = f"{prefix}/asha/trial_{trial}/{name}"
            client.put_object(Bucket=bucket, Key=key, Body=payload)

    # 3. The same command resumes: the ended trials are skipped (records, Tune's results and
    # checkpoints as they were), the killed one resumes from its committed epoch and ends.
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=env, timeout=400)
    kill_marked(ray_env[MARKER_VAR])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not os.path.exists(PLANTED_MARK)
    assert "resuming search 'asha'" in done.stdout, done.stdout
    assert "2 of 3 trial(s) ended before; they are not trained again" in done.stdout
    for trial_id, run in ended.items():
        assert f"trial {trial_id} started" not in done.stdout  # not run again
        assert run.read_bytes("trial.json") == records_before[trial_id]
        assert [p for p, _ in run.checkpoints()] == checkpoints_before[trial_id]
        assert tune_result(trial_id) == results_before[trial_id]  # same iterations, times
    assert f"trial {started[2]} started" in done.stdout
    if len(third_before) == 1:  # killed between its epochs: resumed from its checkpoint
        assert third.latest_metrics()["resumed_from_epoch"] == 1
    else:  # both epochs had committed: the resumed trial found them and trained nothing
        assert [p for p, _ in third.checkpoints()] == third_before
    record = json.loads(third.read_bytes("trial.json"))
    assert record["status"] == "finished" and [h["epoch"] for h in record["history"]] == [1, 2]

    best = json.loads(experiment.read_bytes("best.json"))
    assert best.keys() >= BEST_KEYS
    trials = sorted(best["trials"], key=lambda t: t["trial_id"])  # creation order
    assert [t["trial_id"] for t in trials] == started
    assert [t["config"]["lr"] for t in trials] == [0.05, 1e-6, 0.05], (
        "Tune's sampler drew another order; pick the seed again"
    )
    assert trials[1]["stopped_early"] and trials[1]["epochs_run"] == 1
    assert [t["status"] for t in trials] == ["finished", "stopped early", "finished"]
    assert trials[2]["epochs_run"] == 2  # the trial after the stopped one ran to the end
    assert best["num_trials"] == 3 and best["num_stopped_early"] == 1
    assert best["num_finished"] == 2 and best["num_unfinished"] == 0 and best["num_errors"] == 0
    highest = max(trials, key=lambda t: t["best_val_accuracy"])
    assert best["best_trial"] == highest["trial_id"]
    assert best["best_val_accuracy"] == highest["best_val_accuracy"] > 0.5  # 512 digits
    assert trials[1]["best_val_accuracy"] < 0.3  # lr 1e-6 learns nothing

    # The CSV and the PNG hold exactly these trials.
    rows = list(csv.DictReader(io.StringIO(experiment.read_bytes("results.csv").decode())))
    assert [r["trial_id"] for r in rows] == [t["trial_id"] for t in best["trials"]]
    assert [r["rank"] for r in rows] == ["1", "2", "3"]
    by_id = {r["trial_id"]: r for r in rows}
    for t in trials:
        row = by_id[t["trial_id"]]
        assert int(row["epochs_run"]) == t["epochs_run"]
        assert row["stopped_early"] == str(t["stopped_early"])
        assert float(row["lr"]) == t["config"]["lr"]
        assert len(row["val_accuracy_per_epoch"].split()) == t["epochs_run"]
    with Image.open(io.BytesIO(experiment.read_bytes("val_accuracy.png"))) as image:
        assert image.format == "PNG" and image.size[0] > 400

    # The best checkpoint, in the best trial's run on the store, loads into ConvNet, and the
    # fit command trains its config again. It is the best epoch's: its own record says so.
    assert best["best_checkpoint"].startswith(f"{exp}/runs/{best['best_trial']}/checkpoint_")
    with experiment.local_copy(best["best_checkpoint"]) as local:
        state = ckpt.load(local)
        ckpt.load_model(local)
    assert state["epoch"] == best["best_epoch"]
    assert state["best_val_accuracy"] == best["best_val_accuracy"]
    from raytrain_mnist.fit import parse_config

    argv = shlex.split(best["fit_command"])
    module = argv.index("-m") + 1
    assert argv[module : module + 2] == ["raytrain_mnist", "fit"]
    assert parse_config(argv[module + 2 :]).train.to_dict() == best["best_config"]

    out = done.stdout
    assert "rank" in out and "stopped early" in out and "reproduce with:" in out
    assert f"best checkpoint: {best['best_checkpoint']}" in out

    # 4. Once more, as a library call from a script: typed settings name the same experiment
    # (the CLI's fixed --batch-size is a fixed parameter); every trial ended, so nothing
    # trains and no Ray starts (its RAY_TMPDIR stays empty: a Ray keeps its session there).
    # It prints nothing and returns what best.json holds, the same result as before.
    script = f"""
import json
from raytrain_mnist.config import RunSettings, TrainConfig
from raytrain_mnist.driver import search
from raytrain_mnist.driver.searching.space import Param, SearchSpace, TuneSettings

events = []
result = search(
    SearchSpace().with_params(
        lr=Param("choice", values=(1e-6, 0.05)), batch_size=Param("fixed", values=(32,))
    ),
    TuneSettings(num_samples=3, max_concurrent_trials=1, search_seed=2, grace_period=1),
    TrainConfig(epochs=2, batch_size=32),
    RunSettings.from_flags(num_workers=1, cpus_per_worker=1, dataset="mnist", data_dir={str(mixed_mnist)!r},
                storage_path={storage!r}, name="asha"),
    on_event=lambda event: events.append(type(event).__name__ + ": " + event.text),
)
with open({str(tmp_path / "library.json")!r}, "w") as f:
    json.dump({{"status": result.status, "record": result.to_dict(), "events": events}}, f)
"""
    ray_tmp = tmp_path / "library-ray"
    ray_tmp.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**env, "RAY_TMPDIR": str(ray_tmp)},
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout == "", done.stdout[-3000:]
    assert not list(ray_tmp.iterdir()) and not os.path.exists(PLANTED_MARK)
    library = json.loads((tmp_path / "library.json").read_text())
    assert library["status"] == "finished"
    assert library["events"][0].startswith("SearchStarting: resuming search 'asha'")
    assert library["events"][1].startswith("Note: search space: lr choice(1e-06, 0.05)")
    assert library["events"][2] == "Note: 3 of 3 trial(s) ended before; nothing to train"
    assert not any(" started: " in event for event in library["events"]), library["events"]
    record = library["record"]
    assert record == json.loads(experiment.read_bytes("best.json"))
    assert {k: v for k, v in record.items() if k != "wall_time_s"} == {
        k: v for k, v in best.items() if k != "wall_time_s"
    }
    argv = shlex.split(record["fit_command"])
    assert argv[argv.index("-m") + 1 : argv.index("-m") + 3] == ["raytrain_mnist", "fit"]


@contextlib.contextmanager
def _stopper_of(**session):
    """Tune's stopper of a search whose session has no trials (``session``: its fields)."""
    from raytrain_mnist.driver.events import log_event
    from raytrain_mnist.driver.searching import run as tune_run

    defaults = dict(plan={}, searched=[], train=TrainConfig(), runs_root="unused", ended={})
    made = tune_run.Session(sink=log_event, metric="val_accuracy", **{**defaults, **session})
    token = tune_run.SESSION.set(made)
    try:
        yield tune_run.search_stop(), made
    finally:
        tune_run.SESSION.reset(token)


def test_a_lost_experiment_claim_stops_every_trial():
    """The Tune stopper ends the whole search once the experiment's hold is lost (another
    command's token in its lease), as it does after Ctrl-C; before that it lets trials run."""
    from raytrain_mnist.driver.runs import Claim

    claim = Claim()
    with _stopper_of(claim=claim) as (stopper, _):
        assert not stopper.stop_all()
        claim.handled = True
        claim.lose("the lease on search 'x' was taken by another command")
        assert stopper.stop_all()


def test_a_stalled_trial_stops_the_whole_search_as_no_interruption():
    """The placement reaper's line reaches Tune's stopper through the session: the search
    stops, and it is not an interruption (run_trials raises the line as the search's one
    error)."""
    with _stopper_of() as (stopper, session):
        assert not stopper.stop_all()
        session.stalled = "a trial's workers could not be placed for 5 s: ..."
        assert stopper.stop_all() and not session.interrupted


def test_tunes_own_trial_progress_lines_are_not_printed(capsys):
    """Tune's progress callback prints "Trial ... completed" to stdout even with verbose=0
    when a trial ends with the result it last showed (none); a search passes a quiet one."""
    from ray.tune.progress_reporter import TrialProgressCallback

    from raytrain_mnist.driver.searching.run import quiet_progress

    class Trial:
        last_result: dict = {}

        def __str__(self) -> str:
            return "t0"

    TrialProgressCallback().on_trial_complete(0, [], Trial())
    assert "Trial t0 completed" in capsys.readouterr().out  # what Tune's own does
    quiet_progress().on_trial_complete(0, [], Trial())
    assert capsys.readouterr().out == ""


def test_a_trial_tune_ended_on_its_own_fails_the_search_and_only_a_stop_interrupts_it(
    tmp_path,
):
    """A trial that Tune ended before its last epoch with no error of its own (as one whose
    reused actor failed to reset did) is an error of a finished search, not the unfinished
    trial of an interrupted one: "interrupted" is what a Ctrl-C or a lost claim leaves."""
    from raytrain_mnist.driver.events import log_event
    from raytrain_mnist.driver.searching import run as tune_run
    from raytrain_mnist.driver.searching.result import NOT_RUN_OUT, collect_trials

    session = tune_run.Session(
        sink=log_event,
        plan={"t1": {"lr": 0.05}},
        searched=["lr"],
        train=TrainConfig(epochs=2),
        metric="val_accuracy",
        runs_root=str(tmp_path),
        ended={},
    )
    plan = [("t1", {"lr": 0.05})]
    [trial] = collect_trials(plan, session, "max")
    assert (trial["status"], trial["error"]) == ("error", NOT_RUN_OUT)
    session.stop_trials()  # Ctrl-C
    [trial] = collect_trials(plan, session, "max")
    assert (trial["status"], trial["error"]) == ("unfinished", None)


def test_a_trial_that_ended_on_its_own_counts_the_epochs_its_train_run_committed(tmp_path):
    """Tune can end a trial without its last report (after a preemption: the Train run
    committed its last epoch, Tune's results stop one short). A trial that ended on its own
    is recorded from its Train run's latest checkpoint: finished, every epoch."""
    from raytrain_mnist import compat
    from raytrain_mnist.driver.events import log_event
    from raytrain_mnist.driver.searching import run as tune_run
    from tests.test_checkpoint import CFG, _resume_state

    train = dataclasses.replace(CFG, epochs=2)
    state = _resume_state(train)
    history = [{"epoch": e, "val_accuracy": 0.5 + e / 10, "val_loss": 1.0 / e} for e in (1, 2)]
    state.update(epoch=2, history=history, position=ckpt.boundary_position(train.to_dict(), 2, 1))
    run_dir = tmp_path / "t1"
    (run_dir / "checkpoint_2").mkdir(parents=True)
    ckpt.save(run_dir / "checkpoint_2", state)
    snapshot = compat.checkpoint_manager_snapshot(
        [("checkpoint_2", history[1], 1)], "checkpoint_2", 2
    )
    (run_dir / "checkpoint_manager_snapshot.json").write_bytes(snapshot)
    session = tune_run.Session(
        sink=log_event, plan={"t1": {}}, searched=[], train=train, metric="val_accuracy",
        runs_root=str(tmp_path), ended={},
        seen={"t1": {1: {"epoch": 1, "val_accuracy": 0.6, "val_loss": 1.0}}},  # Tune's: epoch 1
    )  # fmt: skip
    session.trial_ended("t1")
    record = session.ended["t1"]
    assert record["status"] == "finished" and [h["epoch"] for h in record["history"]] == [1, 2]
    assert json.loads((run_dir / "trial.json").read_text()) == record
