"""What a search will run before it runs it: the trials it draws (the same every time for
the same settings), whether the experiment directory holds this search to continue, and
how many trials run at once with how many CPUs per worker.
"""

from __future__ import annotations

import os
from typing import Any

from raytrain_mnist.config import RunSettings, TrainConfig, settings_digest
from raytrain_mnist.driver.runs import SEARCH_FILE, Run
from raytrain_mnist.driver.searching.space import SearchSpace, TuneSettings
from raytrain_mnist.errors import EXIT_USAGE, UserError

#: ``<experiment>/trials.json``: the trials the search draws (names and values), written when
#: it starts; a resume that draws others (another Tune's sampler) is refused.
PLAN_FILE = "trials.json"
#: What Tune's own restore would unpickle: a directory that holds it but no ``search.json``
#: is someone else's experiment.
TUNER_STATE = "tuner.pkl"
#: The trial actor only waits on its trainer; Tune refuses 0 CPUs, so it takes a sliver.
TRIAL_CPU = 0.01

#: The search's trials in order: (name, the training values it draws).
Plan = list[tuple[str, dict]]


def draw_trials(space: SearchSpace, settings: TuneSettings, identity: dict) -> Plan:
    """The search's trials in order: (name, the training values it draws).

    Tune's own sampler draws them, seeded with ``settings.search_seed``, value for value as
    Tune's ``BasicVariantGenerator(random_state=seed)`` draws its trials: the same settings
    draw the same trials every time, which is what lets a search resume with nothing of
    Tune's saved state. A trial is named ``<5 hex of the identity>_<index>``: its Train run
    is ``runs/<name>``."""
    import numpy as np
    from ray.tune.search.variant_generator import generate_variants

    rng = np.random.default_rng(settings.search_seed)
    spec = {"config": space.param_space()}
    prefix = settings_digest(identity)[:5]
    trials = []
    for index in range(settings.num_samples):
        _, resolved = next(generate_variants(spec, random_state=rng))
        values = resolved["config"]["train_loop_config"]
        trials.append((f"{prefix}_{index:05d}", {k: _plain(v) for k, v in values.items()}))
    return trials


def _plain(value: Any) -> Any:
    """A NumPy scalar as the Python number it holds (JSON writes it, == compares it)."""
    return value.item() if hasattr(value, "item") else value


def plan_record(plan: Plan) -> dict:
    """What ``trials.json`` holds."""
    return {"trials": [{"trial_id": name, "config": values} for name, values in plan]}


def trial_config(train: TrainConfig, values: dict) -> TrainConfig:
    """A trial's training settings: ``train`` with the values it drew."""
    return TrainConfig.from_dict({**train.to_dict(), **values})


def check_experiment(experiment: Run, identity: dict, plan: Plan, resume: bool) -> bool:
    """True when ``experiment`` holds a search to continue; refuses a conflicting one.

    Nothing of Tune's saved state is read: only this package's JSON records. A directory
    with Tune's state (``tuner.pkl``) but no ``search.json`` is someone else's experiment,
    and is not mixed into; a search whose recorded trials differ from the ones drawn now
    (a Tune whose sampler draws otherwise) is not continued with other values."""
    experiment.check_identity(identity, "search")
    known = experiment.identity() is not None
    if not known and experiment.is_file(TUNER_STATE):
        raise UserError(
            f"{experiment.dir} holds a Tune experiment that this command did not "
            f"start (no {SEARCH_FILE}); it is never restored or resumed. Pick another --name",
            EXIT_USAGE,
        )
    if resume and not known:
        raise UserError(
            f"--resume: no search to continue in {experiment.dir}; drop --resume to start it",
            EXIT_USAGE,
        )
    recorded = experiment.read_json(PLAN_FILE) if known else None
    if recorded is not None and recorded != plan_record(plan):
        raise UserError(
            f"{experiment.dir}/{PLAN_FILE}: the search drew other trials than this command "
            "draws now (another version of Ray Tune's sampler?); add --fresh to start it "
            "again, or pick another --name",
            EXIT_USAGE,
        )
    return known


def concurrency(settings: TuneSettings, run: RunSettings, local: bool) -> tuple[int, int]:
    """(trials at once, CPUs per worker) before connecting. A local Ray is sized for them."""
    cores = os.cpu_count() or 1
    wanted = settings.max_concurrent_trials
    scaling = run.scaling
    if not local:
        return wanted or settings.num_samples, scaling.cpus_per_worker or 1
    if scaling.cpus_per_worker:
        per_trial = scaling.num_workers * scaling.cpus_per_worker
        concurrent = wanted or max(1, min(settings.num_samples, cores // per_trial))
        return concurrent, scaling.cpus_per_worker
    # Share the machine's cores between the trials that run at once.
    concurrent = wanted or max(1, min(settings.num_samples, cores // scaling.num_workers))
    return concurrent, max(1, cores // (scaling.num_workers * concurrent))


def trials_the_cluster_holds(run: RunSettings, cpus_per_worker: int) -> int:
    """Trials that run at once without starving each other: each needs its trial actor
    (a sliver of a CPU), its workers (their own placement group, outside Tune's
    accounting) and a Train controller (no CPU)."""
    import ray

    total = ray.cluster_resources()
    scaling = run.scaling
    per_trial = scaling.num_workers * cpus_per_worker + TRIAL_CPU
    holds = int(total.get("CPU", 0) // per_trial)
    if scaling.use_gpu:
        holds = min(holds, int(total.get("GPU", 0) // scaling.num_workers))
    return holds
