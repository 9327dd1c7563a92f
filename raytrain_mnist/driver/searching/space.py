"""What ``tune`` searches and how: the search space's defaults next to :class:`TrainConfig`.

* :data:`SEARCH_SPACE` — the default distribution of each searched :class:`TrainConfig` field.
* :class:`SearchSpace` — that, changed by the command line: ``--set lr=0.05`` (or ``--lr 0.05``)
  fixes a field, ``--range lr=1e-3:0.3`` changes a range, ``--range batch_size=64,128`` a choice.
* :class:`TuneSettings` — how the search runs (samples, scheduler, metric, concurrency).

Every value a trial can draw is checked up front against :class:`TrainConfig` and
:class:`FitConfig`'s rules, so a bad search space is one :class:`ConfigError` line before
anything starts, never a failed trial.
"""

from __future__ import annotations

import dataclasses
import itertools
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from raytrain_mnist.config import (
    DEFAULT_RECIPE,
    ConfigError,
    FitConfig,
    RunSettings,
    TrainConfig,
    check_data_fits,
    settings_digest,
)
from raytrain_mnist.config import (
    option as _opt_field,
)
from raytrain_mnist.errors import EXIT_USAGE, UserError

KINDS = ("loguniform", "uniform", "choice", "fixed")
SCHEDULER_CHOICES = ("asha", "fifo")
METRIC_CHOICES = ("val_accuracy", "val_loss", "train_accuracy", "train_loss")
MODE_CHOICES = ("max", "min")
#: The largest seed of Tune's sampler (``BasicVariantGenerator(random_state=...)``).
SEARCH_SEED_MAX = 2**32 - 1
#: The per-trial budget (``--max-epochs``); never searched.
_NOT_SEARCHABLE = ("epochs",)


@dataclass(frozen=True)
class Param:
    """One searched field: ``loguniform``/``uniform`` over [low, high], a ``choice`` of
    ``values``, or ``fixed`` to ``values[0]``."""

    kind: str
    low: Optional[float] = None
    high: Optional[float] = None
    values: tuple = ()

    def candidates(self) -> tuple:
        """The values whose validity implies every draw's (bounds, or every choice)."""
        return (self.low, self.high) if self.kind in ("loguniform", "uniform") else self.values

    def to_tune(self) -> Any:
        from ray import tune

        if self.kind == "loguniform":
            return tune.loguniform(self.low, self.high)
        if self.kind == "uniform":
            return tune.uniform(self.low, self.high)
        if self.kind == "choice":
            return tune.choice(list(self.values))
        return self.values[0]

    def describe(self) -> str:
        if self.kind in ("loguniform", "uniform"):
            return f"{self.kind}({self.low:g}, {self.high:g})"
        if self.kind == "choice":
            return "choice(" + ", ".join(str(v) for v in self.values) + ")"
        return f"fixed {self.values[0]}"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "low": self.low, "high": self.high, "values": list(self.values)}


#: The default search space: log-uniform learning rate, a choice of global batch sizes,
#: uniform momentum, log-uniform weight decay. TrainConfig's defaults (0.1, 128, 0.9, 5e-4)
#: lie inside every range.
#: The default space of each ``--recipe``, around its values (AdamW's learning rates and
#: decoupled weight decay live far from SGD's; ``momentum`` is AdamW's beta1).
SEARCH_SPACES: dict[str, dict[str, Param]] = {
    "one-epoch": {
        "lr": Param("loguniform", 5e-3, 0.08),
        "batch_size": Param("choice", values=(64, 128, 256)),
        "momentum": Param("uniform", 0.6, 0.9),
        "weight_decay": Param("loguniform", 5e-3, 0.2),
    },
    "classic": {
        "lr": Param("loguniform", 1e-3, 0.3),
        "batch_size": Param("choice", values=(64, 128, 256)),
        "momentum": Param("uniform", 0.8, 0.95),
        "weight_decay": Param("loguniform", 1e-5, 1e-3),
    },
}
#: The default recipe's.
SEARCH_SPACE: dict[str, Param] = SEARCH_SPACES[DEFAULT_RECIPE]


def searchable() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in _NOT_SEARCHABLE)


def _field_type(name: str) -> type:
    return typing.get_type_hints(TrainConfig)[name]


def _parse_value(name: str, text: str, option: str) -> Any:
    kind = _field_type(name)
    try:
        return kind(text.strip()) if kind is not str else text.strip()
    except ValueError:
        raise ConfigError(
            f"{option}: {text.strip()!r} is not a valid {kind.__name__} for {name}"
        ) from None


def _split(item: str, option: str) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not name or not value.strip():
        raise ConfigError(f"{option} {item!r}: write NAME=VALUE, e.g. {option} lr=0.05")
    if name not in searchable():
        hint = "; the per-trial epochs are --max-epochs" if name in _NOT_SEARCHABLE else ""
        raise ConfigError(
            f"{option} {item!r}: unknown parameter {name!r}; searchable: "
            f"{', '.join(searchable())}{hint}"
        )
    return name, value


def parse_range(item: str) -> tuple[str, Param]:
    """``lr=1e-3:0.3`` (the field's default kind, uniform if none) or ``batch_size=64,128``."""
    name, text = _split(item, "--range")
    option = f"--range {item!r}"
    if ":" in text:
        if _field_type(name) is not float:
            raise ConfigError(
                f"{option}: {name} takes a list of values (e.g. {name}=a,b,c), not a LOW:HIGH range"
            )
        low_text, _, high_text = text.partition(":")
        low, high = (_parse_value(name, t, option) for t in (low_text, high_text))
        default = SEARCH_SPACE.get(name)
        kind = default.kind if default and default.kind in ("loguniform", "uniform") else "uniform"
        if not low < high:
            raise ConfigError(
                f"{option}: LOW must be below HIGH (to fix {name}, use "
                f"--set {name}={low_text.strip()})"
            )
        if kind == "loguniform" and low <= 0:
            raise ConfigError(
                f"{option}: {name} is searched log-uniformly, so LOW must be "
                f"> 0 (got {low_text.strip()})"
            )
        return name, Param(kind, low, high)
    values = tuple(_parse_value(name, t, option) for t in text.split(",") if t.strip())
    if len(set(values)) != len(values):
        raise ConfigError(f"{option}: the values repeat")
    if len(values) == 1:
        return name, Param("fixed", values=values)
    return name, Param("choice", values=values)


def parse_set(item: str) -> tuple[str, Param]:
    """``lr=0.05``: fix a field for every trial."""
    name, text = _split(item, "--set")
    return name, Param("fixed", values=(_parse_value(name, text, f"--set {item!r}"),))


@dataclass(frozen=True)
class SearchSpace:
    """The searched and fixed fields, on top of a base :class:`TrainConfig`."""

    params: Mapping[str, Param] = field(default_factory=lambda: dict(SEARCH_SPACE))

    @classmethod
    def from_cli(
        cls,
        sets: Iterable[str] = (),
        ranges: Iterable[str] = (),
        fixed: Mapping[str, Any] | None = None,
        recipe: str = DEFAULT_RECIPE,
    ) -> SearchSpace:
        """``fixed``: fields given as training flags (``--lr 0.05``), fixed like ``--set``;
        the rest of the space is ``recipe``'s (:data:`SEARCH_SPACES`)."""
        params = dict(SEARCH_SPACES[recipe])
        origin: dict[str, str] = {}
        changes = [
            (f"--{n.replace('_', '-')}", n, Param("fixed", values=(v,)))
            for n, v in (fixed or {}).items()
        ]
        changes += [(f"--set {s}", *parse_set(s)) for s in sets]
        changes += [(f"--range {r}", *parse_range(r)) for r in ranges]
        for option, name, param in changes:
            if name in origin:
                raise ConfigError(f"{origin[name]} and {option} both set {name}: keep one")
            origin[name] = option
            params[name] = param
        return cls(params)

    def with_params(self, **params: Param) -> SearchSpace:
        """This space with ``params`` searched (or fixed) instead, e.g.
        ``SearchSpace().with_params(lr=Param("loguniform", 0.02, 0.3))``."""
        return SearchSpace({**self.params, **params})

    def check(self, base: TrainConfig, run: RunSettings) -> None:
        """Every value a trial can draw makes a valid :class:`FitConfig`."""
        for name, param in self.params.items():
            if name not in searchable():
                raise ConfigError(
                    f"unknown search parameter {name!r}; searchable: {', '.join(searchable())}"
                )
            if param.kind not in KINDS:
                raise ConfigError(
                    f"search parameter {name}: kind {param.kind!r} is not one of {', '.join(KINDS)}"
                )
            for value in param.candidates():
                try:
                    FitConfig(dataclasses.replace(base, **{name: value}), run)
                except ConfigError as exc:
                    raise ConfigError(f"search space {name}={param.describe()}: {exc}") from None

    def check_data(self, base: TrainConfig, run: RunSettings, train_size: int) -> None:
        """Every combination a trial can draw of the fields that decide the steps per epoch
        fits a training set of ``train_size`` images (:func:`config.check_data_fits`)."""
        fields = ("batch_size", "schedule")
        choices = [
            self.params[n].candidates() if n in self.params else (getattr(base, n),) for n in fields
        ]
        for values in itertools.product(*choices):
            drawn = dict(zip(fields, values, strict=False))
            try:
                check_data_fits(dataclasses.replace(base, **drawn), run, train_size)
            except ConfigError as exc:
                searched = ", ".join(
                    f"{n}={self.params[n].describe()}"
                    for n in fields
                    if n in self.params and self.params[n].kind != "fixed"
                )
                raise ConfigError(
                    f"search space {searched or 'fixed values'}: a trial with "
                    f"{', '.join(f'{n}={v}' for n, v in drawn.items())} "
                    f"fails: {exc}"
                ) from None

    @property
    def searched(self) -> list[str]:
        return [n for n, p in self.params.items() if p.kind != "fixed"]

    def fixed_values(self) -> dict[str, Any]:
        return {n: p.values[0] for n, p in self.params.items() if p.kind == "fixed"}

    def param_space(self) -> dict:
        """Tune's ``param_space``: the training values nested under ``train_loop_config``."""
        return {"train_loop_config": {n: p.to_tune() for n, p in self.params.items()}}

    def to_dict(self) -> dict:
        return {n: p.to_dict() for n, p in sorted(self.params.items())}

    def describe(self) -> str:
        return ", ".join(f"{n} {p.describe()}" for n, p in self.params.items())


_opt = _opt_field


@dataclass(frozen=True)
class TuneSettings:
    """How the search runs; the per-trial budget is :attr:`TrainConfig.epochs`."""

    num_samples: int = _opt(8, "trials to run (each a full TorchTrainer run)")
    scheduler: str = _opt(
        "asha",
        "trial scheduler: asha stops bad trials early, fifo runs every trial to the end",
        SCHEDULER_CHOICES,
    )
    metric: str = _opt("val_accuracy", "metric that ranks trials", METRIC_CHOICES)
    mode: Optional[str] = _opt(
        None, "max or min the metric; default: max for accuracies, min for losses", MODE_CHOICES
    )
    grace_period: int = _opt(1, "ASHA: epochs every trial runs before it can be stopped")
    reduction_factor: int = _opt(2, "ASHA: 1 in N trials goes on at each rung")
    max_concurrent_trials: Optional[int] = _opt(
        None,
        "trials running at once; default: as many as the cluster holds (each trial "
        "needs its workers' CPUs/GPUs plus a small share of a CPU), at most --num-samples",
    )
    search_seed: int = _opt(0, "seed of the sampler: the same seed draws the same trials")
    resume: bool = _opt(
        False,
        "continue the search in <storage-path>/<name>, and fail if there is none "
        "(re-running the same command resumes too)",
    )

    def __post_init__(self) -> None:
        for flag, value, minimum in (
            ("num-samples", self.num_samples, 1),
            ("grace-period", self.grace_period, 1),
            ("reduction-factor", self.reduction_factor, 2),
            ("search-seed", self.search_seed, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ConfigError(f"--{flag} must be an integer >= {minimum}, got {value!r}")
        if self.search_seed > SEARCH_SEED_MAX:  # the sampler seeds a NumPy RandomState
            raise ConfigError(
                f"--search-seed must be at most {SEARCH_SEED_MAX} (a 32-bit "
                f"seed), got {self.search_seed}"
            )
        if self.max_concurrent_trials is not None and (
            not isinstance(self.max_concurrent_trials, int) or self.max_concurrent_trials < 1
        ):
            raise ConfigError(
                f"--max-concurrent-trials must be an integer >= 1, got "
                f"{self.max_concurrent_trials!r}"
            )
        for flag, value, choices in (
            ("scheduler", self.scheduler, SCHEDULER_CHOICES),
            ("metric", self.metric, METRIC_CHOICES),
        ):
            if value not in choices:
                raise ConfigError(f"--{flag} must be one of {', '.join(choices)}; got {value!r}")
        if self.mode is not None and self.mode not in MODE_CHOICES:
            raise ConfigError(f"--mode must be max or min; got {self.mode!r}")

    @property
    def resolved_mode(self) -> str:
        return self.mode or ("min" if self.metric.endswith("loss") else "max")


def check_search(
    space: SearchSpace, settings: TuneSettings, train: TrainConfig, run: RunSettings
) -> None:
    """The rules of a search that span its parts: every value a trial can draw makes a valid
    :class:`FitConfig`, ASHA can stop a trial, and ``resume`` and ``fresh`` are not both
    asked for. One :class:`ConfigError` (or :class:`UserError`) line when broken."""
    FitConfig(train, run)  # the rules that span training and run settings
    space.check(train, run)
    check_budget(settings, train)
    if settings.resume and run.storage.fresh:
        raise UserError(
            "--resume continues a search and --fresh starts it again: keep one", EXIT_USAGE
        )


def check_budget(settings: TuneSettings, train: TrainConfig) -> None:
    if settings.scheduler == "asha" and settings.grace_period > train.epochs:
        raise ConfigError(
            f"--grace-period {settings.grace_period} is more than --max-epochs "
            f"{train.epochs}: ASHA could never stop a trial"
        )


def experiment_identity(
    space: SearchSpace, settings: TuneSettings, base: TrainConfig, run: RunSettings
) -> dict:
    """What a search computes; the same command resumes it, other settings are refused."""
    return {
        "search_space": space.to_dict(),
        "train": base.to_dict(),
        "num_samples": settings.num_samples,
        "scheduler": settings.scheduler,
        "metric": settings.metric,
        "mode": settings.resolved_mode,
        "grace_period": settings.grace_period,
        "reduction_factor": settings.reduction_factor,
        "search_seed": settings.search_seed,
        "num_workers": run.scaling.num_workers,
        "use_gpu": run.scaling.use_gpu,
        "dataset": run.data.dataset,
    }


def experiment_name(identity: dict, run: RunSettings) -> str:
    """``--name``, else derived from the settings: deterministic, no timestamp."""
    if run.storage.name:
        return run.storage.name
    return f"tune-{run.scaling.num_workers}w-{settings_digest(identity)}"
