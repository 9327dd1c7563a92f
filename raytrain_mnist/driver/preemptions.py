"""The driver's record of a run's preemptions: summary.json's ``preemptions`` and the two
lines a preemption prints (seen; resumed).

Rank 0 tells the driver through its progress feed (``worker/preempt.py``): ``preemption``
when a node of the run is being preempted, ``preempt_step`` for each step trained during
the notice, ``holding`` once the final checkpoint is reported; each just-in-time
checkpoint arrives committed, as a report whose ``progress`` is ``"checkpoint"``. The next
worker group's ``ready`` says where it resumed. What was trained after that point and
before the node went is what the preemption cost: ``lost_steps``.
"""

from __future__ import annotations

from typing import Any

#: The feed's and the reports' kinds this module reads.
KINDS = ("preemption", "preempt_step", "holding", "checkpoint")


def _at(epoch: int, step: int) -> str:
    return f"step {step} of epoch {epoch}" if step else f"the end of epoch {epoch - 1}"


class PreemptionLog:
    """Preemptions as the monitor sees them; :attr:`entries` is summary.json's list. Each
    entry: ``node`` (the node id; ``nodes`` maps every preempted node to its ranks),
    ``ranks``, ``deadline_s`` (seconds of notice left when the run saw it), ``seen_at``
    (``epoch``, ``step``), ``epoch`` and ``step`` of the last checkpoint written during the
    notice and its ``checkpoint`` path, ``lost_steps`` (steps trained after the point the
    run resumed from; None until it resumes) and ``resumed_from`` (``epoch``, ``step``)."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self._steps_per_epoch = 0
        self._last = 0  # the last step trained during the open notice (a global step)

    @property
    def _open(self) -> dict[str, Any] | None:
        entry = self.entries[-1] if self.entries else None
        return entry if entry is not None and "resumed_from" not in entry else None

    def _global(self, epoch: int, step: int) -> int:
        """The step from the run's start of ``step`` of (1-based) ``epoch``."""
        return (epoch - 1) * self._steps_per_epoch + step

    def handle(self, m: dict[str, Any]) -> str | None:
        """Take one item of kind :data:`KINDS`; returns the line to print, if any."""
        kind = m.get("progress")
        if kind == "preemption":
            return self._seen(m)
        entry = self._open
        if entry is None:
            return None
        if kind in ("preempt_step", "holding"):
            self._last = max(self._last, self._global(m["epoch"], m["step"]))
        elif kind == "checkpoint":
            entry.update(epoch=m["epoch"] + 1, step=m["step"], checkpoint=m.get("checkpoint"))
        return None

    def _seen(self, m: dict[str, Any]) -> str:
        nodes = {node: sorted(ranks) for node, ranks in (m.get("nodes") or {}).items()}
        ranks = sorted({r for rs in nodes.values() for r in rs})
        self._steps_per_epoch = m.get("steps_per_epoch") or self._steps_per_epoch
        self._last = self._global(m["epoch"], m["step"])
        self.entries.append(
            {
                "node": next(iter(sorted(nodes)), None),
                "nodes": nodes,
                "ranks": ranks,
                "deadline_s": m.get("deadline_s"),
                "seen_at": {"epoch": m["epoch"], "step": m["step"]},
                "epoch": None,
                "step": None,
                "checkpoint": None,
                "lost_steps": None,
            }
        )
        where = ", ".join(
            f"{node[:12]} (rank(s) {', '.join(map(str, rs))})" for node, rs in nodes.items()
        )
        return (
            f"preemption: node {where} goes in {m.get('deadline_s', 0):.0f} s; "
            f"checkpoint at {_at(m['epoch'], m['step'])}, training goes on"
        )

    def resumed(self, m: dict[str, Any]) -> str | None:
        """A worker group's ``ready``: the line of the resume that answers the open
        preemption (None when there is none)."""
        entry = self._open
        if entry is None:
            return None
        epoch, step = (m.get("resumed_from_epoch") or 0) + 1, m.get("resumed_from_step") or 0
        entry["resumed_from"] = {"epoch": epoch, "step": step}
        entry["lost_steps"] = max(self._last - self._global(epoch, step), 0)
        return (
            f"resumed after the preemption from {_at(epoch, step)}: "
            f"{entry['lost_steps']} step(s) trained again" + _size_note(m)
        )


def resume_text(m: dict[str, Any]) -> str | None:
    """The line of a first worker group that resumes a run (None on a fresh start)."""
    epoch, step = m.get("resumed_from_epoch") or 0, m.get("resumed_from_step") or 0
    if step:
        return f"resumed from the checkpoint at step {step} of epoch {epoch + 1}" + _size_note(m)
    return f"resumed from the checkpoint of epoch {epoch}" if epoch else None


def _size_note(m: dict[str, Any]) -> str:
    """A mid-epoch resume on another world size is no longer the uninterrupted run's."""
    written_by, size = m.get("resumed_world_size"), m.get("world_size")
    if not m.get("resumed_from_step") or written_by in (None, size):
        return ""
    return f" (written by {written_by} worker(s), resumed on {size}: not bit-identical)"
