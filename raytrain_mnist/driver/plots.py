"""Pictures of a run, drawn headless (matplotlib's Agg backend). Each returns PNG bytes.

Titles hold run names and paths, which are text, never markup: they are drawn with
matplotlib's mathtext and TeX off (:data:`PLAIN`), so a ``$`` in a name neither raises nor
turns the rest of the title into math.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np

#: Text properties of every title: drawn as it is written (no ``$...$`` mathtext, no TeX).
PLAIN = {"parse_math": False, "usetex": False}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def warm_up() -> None:
    """Import what drawing the training curves needs (matplotlib, its Agg backend, the
    ticker), so that a thread can pay for it ahead of the drawing."""
    _pyplot()
    import matplotlib.ticker  # noqa: F401


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    _pyplot().close(fig)
    return buffer.getvalue()


def training_curves_png(history: Sequence[dict], title: str) -> bytes:
    """Loss (log scale) and accuracy per epoch, as PNG bytes; the best epoch is marked."""
    plt = _pyplot()
    from matplotlib.ticker import FormatStrFormatter, LogLocator, MaxNLocator

    epochs = [h["epoch"] for h in history]
    val_acc = [100 * h["val_accuracy"] for h in history]
    best = int(np.argmax(val_acc))
    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    # Fixed margins: the labels are the same few words in every run, and constrained layout
    # was 45 % of the drawing's time, which a run's end waits for (benchmarks/README.md).
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.12, top=0.84, wspace=0.22)
    loss_ax.plot(epochs, [h["train_loss"] for h in history], "o-", label="train")
    loss_ax.plot(epochs, [h["val_loss"] for h in history], "s-", label="validation")
    loss_ax.set(title="Cross-entropy loss", xlabel="epoch", ylabel="loss (log scale)", yscale="log")
    loss_ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))  # 0.2, 0.5, 1, 2, 5
    for set_formatter in (loss_ax.yaxis.set_major_formatter, loss_ax.yaxis.set_minor_formatter):
        set_formatter(FormatStrFormatter("%g"))  # 0.5, not 5 x 10^-1
    if "train_accuracy" in history[0]:
        acc_ax.plot(
            epochs,
            [100 * h["train_accuracy"] for h in history],
            "o-",
            color="tab:blue",
            label="train",
        )
    acc_ax.plot(epochs, val_acc, "s-", color="tab:orange", label="validation")
    acc_ax.plot(
        epochs[best],
        val_acc[best],
        "*",
        color="tab:red",
        markersize=14,
        label=f"best: {val_acc[best]:.2f} % (epoch {epochs[best]})",
    )
    acc_ax.axhline(99.0, color="grey", linestyle=":", linewidth=1, label="99 %")
    low = min(val_acc + [100 * h.get("train_accuracy", 1.0) for h in history])
    acc_ax.set_ylim(max(0.0, min(low, 99.0) - 1.0), 100.2)  # accuracy never exceeds 100 %
    acc_ax.set(title="Accuracy", xlabel="epoch", ylabel="accuracy (%)")
    for ax in (loss_ax, acc_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # whole epochs, any run length
        ax.grid(True, alpha=0.3)
    loss_ax.legend(loc="upper right")
    acc_ax.legend(loc="lower right")  # the curves rise: keep the legend out of their way
    fig.suptitle(title, **PLAIN)
    return _png(fig)


def confusion_matrix(
    labels: np.ndarray, predictions: np.ndarray, num_classes: int = 10
) -> np.ndarray:
    """``counts[true, predicted]`` as int64."""
    flat = np.asarray(labels, dtype=np.int64) * num_classes + np.asarray(predictions, np.int64)
    return np.bincount(flat, minlength=num_classes**2).reshape(num_classes, num_classes)


def confusion_matrix_png(counts: np.ndarray, title: str) -> bytes:
    """Counts in every cell; colour = share of the true class (on a root scale, so that a
    handful of mistakes still shows). Row totals and per-class accuracy on the right."""
    plt = _pyplot()
    from matplotlib.colors import PowerNorm

    counts = np.asarray(counts)
    n = len(counts)
    totals = counts.sum(1)
    share = counts / np.maximum(totals, 1)[:, None]
    fig, ax = plt.subplots(figsize=(8.2, 7), constrained_layout=True)
    image = ax.imshow(share, cmap="Blues", norm=PowerNorm(gamma=0.35, vmin=0, vmax=1))
    for t in range(n):
        for p in range(n):
            if counts[t, p]:
                ax.text(
                    p,
                    t,
                    str(counts[t, p]),
                    ha="center",
                    va="center",
                    fontsize=9,
                    color="white" if share[t, p] > 0.5 else "black",
                    fontweight="bold" if t != p else "normal",
                )
    ax.set_xticks(range(n))
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"{c}  ({100 * counts[c, c] / max(totals[c], 1):.1f} %)" for c in range(n)])
    ax.set(xlabel="predicted digit", ylabel="true digit  (per-class accuracy)")
    ax.set_title(title, **PLAIN)
    ax.tick_params(top=False, bottom=True)
    colorbar = fig.colorbar(image, ax=ax, shrink=0.8, ticks=[0, 0.01, 0.05, 0.2, 0.5, 1])
    colorbar.ax.set_yticklabels(["0", "1 %", "5 %", "20 %", "50 %", "100 %"])
    colorbar.set_label("share of the true digit's test images")
    return _png(fig)


def most_confident_errors(
    labels: np.ndarray, predictions: np.ndarray, confidence: np.ndarray, limit: int
) -> np.ndarray:
    """The indices of at most ``limit`` wrong predictions, the one the model was most sure
    of first (ties in test-set order). ``confidence``: the softmax probability of the
    predicted class."""
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    confidence = np.asarray(confidence)
    wrong = np.flatnonzero(labels != predictions)
    return wrong[np.argsort(-confidence[wrong], kind="stable")][:limit]


def misclassified_png(
    images: np.ndarray,
    labels: np.ndarray,
    predictions: np.ndarray,
    confidence: np.ndarray,
    title: str,
    limit: int = 32,
    columns: int = 8,
) -> bytes:
    """The ``limit`` wrong predictions the model was most sure of, most confident first
    (:func:`most_confident_errors`).

    ``images`` uint8 ``(N, 28, 28)``; ``confidence`` the softmax probability of the
    predicted class.
    """
    plt = _pyplot()
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    confidence = np.asarray(confidence)
    num_wrong = int((labels != predictions).sum())
    order = most_confident_errors(labels, predictions, confidence, limit)
    if len(order) == 0:
        fig, ax = plt.subplots(figsize=(6, 2), constrained_layout=True)
        ax.axis("off")
        ax.text(0.5, 0.5, "no misclassified test digits", ha="center", va="center", fontsize=14)
        ax.set_title(title, **PLAIN)
        return _png(fig)
    cols = min(columns, len(order))
    rows = -(-len(order) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(1.6 * cols, 1.9 * rows + 0.6), constrained_layout=True, squeeze=False
    )
    for ax in axes.flat:
        ax.axis("off")
    for ax, i in zip(axes.flat, order, strict=False):
        ax.imshow(np.asarray(images[i]), cmap="gray_r", vmin=0, vmax=255)
        ax.set_title(
            f"{labels[i]} → {predictions[i]}  {100 * confidence[i]:.0f}%\n#{i}",
            fontsize=9,
            color="tab:red",
        )
    fig.suptitle(
        f"{title}\ntrue → predicted, confidence, test index ({len(order)} of {num_wrong} errors)",
        fontsize=11,
        **PLAIN,
    )
    return _png(fig)
