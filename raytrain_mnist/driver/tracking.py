"""Experiment tracking on the driver: TensorBoard event files, and MLflow when asked for.

:class:`EpochLog` receives each committed epoch's metrics (the dict the driver prints) and
writes them as per-epoch scalars into the run directory, so ``tensorboard --logdir RUN_DIR``
(or ``--logdir STORAGE_PATH`` to compare runs) shows them. With MLflow (the optional extra
``pip install 'raytrain-mnist[mlflow]'``) it also records the run's parameters, the same
metrics, and at the end the best checkpoint, ``summary.json`` and the training curves as
artifacts; the tracking store is ``file:<run_dir>/mlruns`` unless a tracking URI is given.

Tracking never runs on the workers and never stops a training run: a logging failure after
start-up is one warning, then that logger is switched off.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from raytrain_mnist.config import finite_number
from raytrain_mnist.driver.runs import (
    CURVES_FILE,
    SUMMARY_FILE,
    Run,
    check_no_credentials,
    is_uri,
)
from raytrain_mnist.errors import EXIT_USAGE, UserError, first_line

logger = logging.getLogger(__name__)

#: Per-epoch metrics logged as scalars, under these same names (summary.json's history keys).
SCALARS = (
    "train_loss",
    "train_accuracy",
    "val_loss",
    "val_accuracy",
    "best_val_accuracy",
    "images_per_s",
    "epoch_time_s",
    "lr",
)
#: In the run directory: which MLflow run this run logs to, so a resumed run continues it.
MLFLOW_RUN_FILE = "mlflow_run.json"
DEFAULT_EXPERIMENT = "raytrain_mnist"
_MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


def _run_setting(config: Any, name: str, default: Any) -> Any:
    """``config.run.<name>`` when the config has that setting (a FitConfig or its dict)."""
    run = getattr(config, "run", None)
    if run is None and isinstance(config, dict):
        run = config.get("run")
    if dataclasses.is_dataclass(run):
        run = run.to_dict()  # RunSettings: every setting by its flag's name
    return run.get(name, default) if isinstance(run, dict) else default


def flat_params(config: Any) -> dict[str, str]:
    """``{"train.lr": "0.1", "run.num_workers": "2", ...}`` from a FitConfig or its dict."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = {f.name: _asdict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    params: dict[str, str] = {}
    for section, values in (config or {}).items():
        if isinstance(values, dict):
            params.update({f"{section}.{key}": str(value) for key, value in values.items()})
        else:
            params[section] = str(values)
    return params


def _asdict(value: Any) -> Any:
    """A section of a FitConfig as a dict; a plain setting (``auto_epochs``) as it is."""
    return value.to_dict() if dataclasses.is_dataclass(value) else value


_number = finite_number


class EpochLog:
    """Per-epoch scalars to TensorBoard (and MLflow). Call :meth:`log` once per committed
    epoch and :meth:`close` once at the end (it is safe to call twice).

    ``tensorboard``/``mlflow``/``mlflow_uri`` left at None are read from the config's run
    settings when it has them (``no_tensorboard``, ``mlflow``, ``mlflow_uri``), else
    TensorBoard is on and MLflow is off. A ``mlflow_uri`` turns MLflow on.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        config: Any = None,
        *,
        tensorboard: bool | None = None,
        mlflow: bool | None = None,
        mlflow_uri: str | None = None,
        experiment: str | None = None,
    ) -> None:
        self.run_dir = str(run_dir)
        self.config = config
        self.logged_epochs: list[int] = []
        self._closed = False
        if tensorboard is None:
            tensorboard = not _run_setting(config, "no_tensorboard", False)
        if mlflow_uri is None:
            mlflow_uri = _run_setting(config, "mlflow_uri", None)
        if mlflow is None:
            mlflow = bool(_run_setting(config, "mlflow", False)) or bool(mlflow_uri)
        self._tb = self._open_tensorboard() if tensorboard else None
        self._mlflow = _Mlflow(self.run_dir, config, mlflow_uri, experiment) if mlflow else None

    # ----------------------------------------------------------------- TensorBoard

    def _open_tensorboard(self):
        if is_uri(self.run_dir):
            logger.warning(
                "TensorBoard: %s is not a local directory; no event files are written", self.run_dir
            )
            return None
        writer = _EventFile(self.run_dir)
        if self.config is not None:
            params = flat_params(self.config)
            table = "\n".join(f"| {key} | {value} |" for key, value in sorted(params.items()))
            writer.add_text("config", "| setting | value |\n|---|---|\n" + table, 0)
        return writer

    @property
    def tensorboard_dir(self) -> str | None:
        return self._tb.log_dir if self._tb is not None else None

    # ----------------------------------------------------------------- both

    def log(self, metrics: dict[str, Any]) -> None:
        """One committed epoch: ``epoch`` plus any of :data:`SCALARS` (others are ignored)."""
        epoch = int(metrics["epoch"])
        scalars = {key: v for key in SCALARS if (v := _number(metrics.get(key))) is not None}
        self.logged_epochs.append(epoch)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, epoch)
            self._tb.flush()  # visible to a running `tensorboard` at once; one write per epoch
        if self._mlflow is not None:
            self._mlflow.log_metrics(scalars, epoch)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Flush and close. With a ``summary`` (fit's), MLflow also gets the final metrics,
        the best checkpoint, ``summary.json`` and the training curves, and the run status."""
        if self._closed:
            return
        self._closed = True
        if self._tb is not None:
            self._tb.close()
        if self._mlflow is not None:
            self._mlflow.finish(summary, (summary or {}).get("best_checkpoint"))


def warm_up() -> None:
    """Import what TensorBoard's event file needs (:class:`_EventFile`), so that a thread
    can pay for it ahead of opening one."""
    from tensorboard.compat.proto import event_pb2, summary_pb2  # noqa: F401
    from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: F401


class _EventFile:
    """A TensorBoard event file, written by tensorboard's own ``EventFileWriter`` as torch's
    ``SummaryWriter`` writes it (the same file name, events and text summary), without
    torch: the driver of a ``fit --service`` never imports torch, whose import (1.8
    CPU-seconds here) would run beside the request's training."""

    def __init__(self, log_dir: str) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.log_dir = log_dir
        self._writer = EventFileWriter(log_dir)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._add(Summary.Value(tag=tag, simple_value=float(value)), step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        """Shown in TensorBoard's Text tab, under ``TAG/text_summary`` as torch names it."""
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from tensorboard.compat.proto.tensor_pb2 import TensorProto
        from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
        from tensorboard.plugins.text.plugin_data_pb2 import TextPluginData

        metadata = SummaryMetadata(
            plugin_data=SummaryMetadata.PluginData(
                plugin_name="text", content=TextPluginData(version=0).SerializeToString()
            )
        )
        tensor = TensorProto(
            dtype="DT_STRING",
            string_val=[text.encode("utf-8")],
            tensor_shape=TensorShapeProto(dim=[TensorShapeProto.Dim(size=1)]),
        )
        self._add(Summary.Value(tag=f"{tag}/text_summary", metadata=metadata, tensor=tensor), step)

    def _add(self, value, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._writer.add_event(
            Event(summary=Summary(value=[value]), step=step, wall_time=time.time())
        )

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Mlflow:
    """MLflow through its client API (no global active run: the driver's threads share it)."""

    def __init__(self, run_dir: str, config: Any, uri: str | None, experiment: str | None) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise UserError(
                "MLflow logging needs the optional extra: pip install 'raytrain-mnist[mlflow]'",
                EXIT_USAGE,
            ) from exc
        self.run_dir = run_dir
        local = not is_uri(run_dir)
        if uri is None:
            if not local:
                raise UserError(
                    f"MLflow: the run directory {run_dir} is not local; pass a tracking URI",
                    EXIT_USAGE,
                )
            uri = (Path(run_dir).resolve() / "mlruns").as_uri()
        check_no_credentials(uri, "--mlflow-uri")
        self.uri = uri
        if uri.startswith("file:"):
            # MLflow >= 3.7 refuses its file store unless asked; it is the simplest local store.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        experiment = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT)
        self.enabled = True
        try:
            self.client = MlflowClient(tracking_uri=uri)
            self.run_id = self._existing_run(local)
            if self.run_id is None:
                found = self.client.get_experiment_by_name(experiment)
                experiment_id = (
                    found.experiment_id
                    if found is not None
                    else self.client.create_experiment(experiment)
                )
                run = self.client.create_run(
                    experiment_id, run_name=Path(run_dir).name, tags={"run_dir": run_dir}
                )
                self.run_id = run.info.run_id
                self._call(
                    "log_batch",
                    self.run_id,
                    params=_params(flat_params(config)) if config is not None else [],
                )
                Run.at(run_dir).write_json(
                    MLFLOW_RUN_FILE, {"tracking_uri": uri, "run_id": self.run_id}
                )
            else:
                self.client.update_run(self.run_id, status="RUNNING")
        except UserError:
            raise
        except Exception as exc:  # any store error, before training starts: refuse
            raise UserError(f"MLflow at {uri}: {first_line(exc)}") from exc
        logger.info("MLflow: run %s in %s", self.run_id, uri)

    def _existing_run(self, local: bool) -> str | None:
        """A resumed run keeps logging to the MLflow run it started."""
        try:
            recorded = Run.at(self.run_dir).read_json(MLFLOW_RUN_FILE)
            if recorded is None or recorded.get("tracking_uri") != self.uri:
                return None
            self.client.get_run(recorded["run_id"])
            return recorded["run_id"]
        except Exception:  # unreadable, or the store no longer has it: start a new one
            return None

    def _call(self, method: str, *args, **kwargs) -> None:
        if not self.enabled:
            return
        try:
            getattr(self.client, method)(*args, **kwargs)
        except Exception as exc:  # tracking must never stop training
            self.enabled = False
            logger.warning(
                "MLflow: %s failed (%s); no more MLflow logging for this run",
                method,
                first_line(exc),
            )

    def log_metrics(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._call(
            "log_batch",
            self.run_id,
            metrics=[Metric(key, value, now, step) for key, value in scalars.items()],
        )

    def finish(self, summary: dict[str, Any] | None, best_checkpoint: str | None) -> None:
        from mlflow.entities import Metric

        summary = summary or {}
        now = int(time.time() * 1000)
        final = {
            f"final_{key}": v
            for key in ("val_accuracy", "val_loss", "best_val_accuracy", "wall_time_s")
            if (v := _number(summary.get(key))) is not None
        }
        if final:
            self._call(
                "log_batch", self.run_id, metrics=[Metric(k, v, now, 0) for k, v in final.items()]
            )
        local = not is_uri(self.run_dir)
        if best_checkpoint and local and Run.at(self.run_dir).contains(best_checkpoint):
            with tempfile.TemporaryDirectory(prefix="raytrain_mnist-mlflow-") as copy:
                if _copy_plain_files(Path(best_checkpoint), Path(copy)):
                    self._call("log_artifacts", self.run_id, copy, "best_checkpoint")
        for name in (SUMMARY_FILE, CURVES_FILE):
            path = Path(self.run_dir) / name
            if local and path.is_file() and not path.is_symlink():
                self._call("log_artifact", self.run_id, str(path))
        status = _MLFLOW_STATUS.get(summary.get("status"), "FINISHED" if summary else "KILLED")
        self._call("set_terminated", self.run_id, status)


def _copy_plain_files(source: Path, into: Path) -> int:
    """Copy the regular files below ``source`` into ``into`` (same relative paths) and
    return how many: a symbolic link (to a file or a directory) is never followed, so
    nothing outside the run reaches the tracking store, whoever planted the link (the rule
    ``evaluate`` keeps). ``source`` itself must not be a link."""
    if source.is_symlink() or not source.is_dir():
        return 0
    copied = 0
    for directory, subdirs, files in os.walk(source):  # never into a linked directory
        here = Path(directory)
        subdirs[:] = [d for d in subdirs if not (here / d).is_symlink()]
        for name in files:
            try:
                fd = os.open(here / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:  # a link (ELOOP), or gone meanwhile
                continue
            with os.fdopen(fd, "rb") as src:
                if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
                    continue
                target = into / here.relative_to(source) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "xb") as dst:
                    shutil.copyfileobj(src, dst)
            copied += 1
    return copied


def _params(params: dict[str, str]):
    from mlflow.entities import Param

    return [Param(key, value[:6000]) for key, value in params.items()]
