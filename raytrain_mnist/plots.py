"""Pictures of a run, drawn headless (matplotlib's Agg backend)."""

from __future__ import annotations

import io
from typing import Sequence


def training_curves_png(history: Sequence[dict], title: str) -> bytes:
    """Loss (log scale) and validation accuracy per epoch, as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    loss_ax.plot(epochs, [h["train_loss"] for h in history], "o-", label="train")
    loss_ax.plot(epochs, [h["val_loss"] for h in history], "s-", label="validation")
    loss_ax.set(title="Cross-entropy loss", xlabel="epoch", ylabel="loss (log scale)",
                yscale="log")
    acc_ax.plot(epochs, [100 * h["val_accuracy"] for h in history], "s-", color="tab:green",
                label="validation")
    if "train_accuracy" in history[0]:
        acc_ax.plot(epochs, [100 * h["train_accuracy"] for h in history], "o-",
                    color="tab:blue", label="train")
    acc_ax.axhline(99.0, color="grey", linestyle=":", linewidth=1, label="99 %")
    acc_ax.set(title="Accuracy", xlabel="epoch", ylabel="accuracy (%)")
    for ax in (loss_ax, acc_ax):
        ax.set_xticks(epochs)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()
