"""Pictures of a search, drawn headless (matplotlib's Agg backend)."""

from __future__ import annotations

import io
from collections.abc import Sequence

from raytrain_mnist.driver.plots import PLAIN


def trials_png(trials: Sequence[dict], title: str, metric: str = "val_accuracy") -> bytes:
    """``metric`` per epoch, one line per trial, as PNG bytes.

    ``trials``: dicts with ``trial_id``, ``history`` (per epoch: ``epoch`` and ``metric``),
    ``stopped_early`` and ``rank`` (1 = best). Stopped trials are dashed, the best is bold.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = 100 if metric.endswith("accuracy") else 1
    fig, ax = plt.subplots(figsize=(9, 5), constrained_layout=True)
    for trial in sorted(trials, key=lambda t: t["rank"], reverse=True):
        history = trial["history"]
        if not history:
            continue
        best = trial["rank"] == 1
        ax.plot(
            [h["epoch"] for h in history],
            [scale * h[metric] for h in history],
            marker="o",
            linestyle="--" if trial["stopped_early"] else "-",
            linewidth=2.5 if best else 1.2,
            zorder=3 if best else 2,
            label=f"#{trial['rank']} {trial['trial_id']}"
            + (" (stopped)" if trial["stopped_early"] else ""),
        )
    epochs = sorted({h["epoch"] for t in trials for h in t["history"]})
    ax.set_xticks(epochs or [1])
    ax.set_title(title, **PLAIN)  # an experiment's name is drawn as written, never as mathtext
    ax.set(
        xlabel="epoch",
        ylabel=metric.replace("_", " ") + (" (%)" if scale == 100 else ""),
    )
    ax.grid(True, alpha=0.3)
    if any(t["history"] for t in trials):
        ax.legend(fontsize="small", loc="best")
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()
