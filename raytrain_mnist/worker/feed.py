"""Rank 0's progress stream to the driver, while an epoch runs.

``ray.train.report`` speaks once an epoch; a user watching a long epoch needs more. Rank 0
sends small dicts, fire-and-forget, to an actor the driver owns (its ``put``). Every dict
carries ``"progress"`` (its kind) and ``"at"`` (unix time, when it was sent):

* ``"ready"``: the worker group is set up and about to train: ``world_size``,
  ``started_at`` (when this worker-group start's train function began, unix time: Ray has
  formed the process group by then), ``prepared_at`` (the model and loader prepared),
  ``node_id`` (whose clock these are), ``resumed_from_epoch`` (None on a fresh start),
  ``device`` (``"cpu"``, ``"cuda"``) and ``backend`` (the process group's); a resume
  also carries ``resumed_from_step`` (steps of the next epoch its checkpoint held: 0 at an
  epoch's end) and ``resumed_world_size`` (the world size that wrote it; None if unknown).
* ``"first_step"``: the first optimizer step of this worker-group start has been taken.
* ``"step"``: ``epoch`` (1-based), ``images`` and ``total`` (this epoch's images so far and
  in all, over every rank), ``seconds`` (since the epoch began) and ``loss`` (the mean over
  rank 0's images so far).
* ``"preemption"``, ``"preempt_step"``, ``"holding"``: a node of the run is being
  preempted (:mod:`.preempt`): seen (``nodes``: node id to its ranks, ``deadline_s``,
  ``epoch``, ``step``), a step trained during the notice, the final checkpoint reported.

The driver's side reads exactly these keys (``driver/monitor.py``).
"""

from __future__ import annotations

import time

import torch


class ProgressFeed:
    """Rank 0's stream to the driver: small dicts sent fire-and-forget to ``actor`` (its
    ``put``), at most one step update every ``every_s`` seconds so the feed costs nothing
    measurable. Without an actor (Tune trials, other ranks) every call is a no-op."""

    def __init__(self, actor, batch_size: int, steps_per_epoch: int, every_s: float = 0.5) -> None:
        self.actor, self.every_s = actor, every_s
        self.batch_size, self.steps_per_epoch = batch_size, steps_per_epoch
        self._last = float("-inf")
        self._epoch_started = 0.0
        self._first_step_sent = False

    def send(self, kind: str, **item) -> None:
        if self.actor is not None:
            self.actor.put.remote({"progress": kind, "at": time.time(), **item})

    def ready(
        self,
        world_size: int,
        started_at: float,
        resumed_from_epoch: int | None = None,
        device: str = "cpu",
        backend: str | None = None,
        prepared_at: float | None = None,
        **resumed,
    ) -> None:
        """``resumed``: ``resumed_from_step`` and ``resumed_world_size`` of a resume."""
        if self.actor is None:
            return
        import ray

        self.send(
            "ready",
            world_size=world_size,
            started_at=started_at,
            prepared_at=prepared_at,
            node_id=ray.get_runtime_context().get_node_id(),
            resumed_from_epoch=resumed_from_epoch,
            device=device,
            backend=backend,
            **resumed,
        )

    def epoch_start(self, epoch: int) -> None:
        self._epoch, self._epoch_started = epoch, time.perf_counter()

    @property
    def on_step(self):
        """The per-step callback for ``train_one_epoch``; None when nobody listens, so the
        other ranks and Tune trials pay not even a call per step."""
        return self.step if self.actor is not None else None

    def step(self, steps: int, sums: torch.Tensor) -> None:
        if self.actor is None:
            return
        if not self._first_step_sent:
            self._first_step_sent = True
            self.send("first_step")
        now = time.perf_counter()
        if now - self._last < self.every_s and steps < self.steps_per_epoch:
            return
        self._last = now
        loss_sum, _, count = sums.tolist()  # one read of the device a few times a second
        self.send(
            "step",
            epoch=self._epoch,
            images=steps * self.batch_size,
            total=self.steps_per_epoch * self.batch_size,
            seconds=now - self._epoch_started,
            loss=loss_sum / max(count, 1),
        )
