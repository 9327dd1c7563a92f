"""The pictures of a run and of a search draw any title as plain text."""

import numpy as np
import pytest

from raytrain_mnist.driver import plots
from raytrain_mnist.driver.searching import plots as search_plots

HISTORY = [
    {"epoch": 1, "train_loss": 1.2, "val_loss": 0.9, "val_accuracy": 0.7, "train_accuracy": 0.6},
    {"epoch": 2, "train_loss": 0.5, "val_loss": 0.6, "val_accuracy": 0.8, "train_accuracy": 0.75},
]
#: mathtext would parse these: an unbalanced ``$``, ``_`` and ``^`` inside ``$...$``, a TeX
#: command that takes arguments it is not given.
TITLES = ["a$b_$c^{x}", "run $\\frac{", "$", "cost: $5 and $6_{x}$ ^_^"]


def _is_png(data: bytes) -> bool:
    return data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


@pytest.mark.parametrize("title", TITLES)
def test_titles_with_mathtext_characters_render_as_written(title):
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    drawn: list[str] = []
    original = Text.draw

    def spy(self, renderer):  # what each title says when it is drawn
        if self.get_text().startswith(title):
            drawn.append(self.get_text())
            assert not self._parse_math and not self.get_usetex()
        return original(self, renderer)

    Text.draw = spy
    try:
        assert _is_png(plots.training_curves_png(HISTORY, title))
        labels = np.arange(20) % 10
        predictions = labels.copy()
        predictions[:3] = 1
        counts = plots.confusion_matrix(labels, predictions)
        assert _is_png(plots.confusion_matrix_png(counts, title))
        images = np.zeros((20, 28, 28), np.uint8)
        confidence = np.full(20, 0.9)
        assert _is_png(plots.misclassified_png(images, labels, predictions, confidence, title))
        assert _is_png(plots.misclassified_png(images, labels, labels, confidence, title))
        trials = [
            {"trial_id": "a_00000", "history": HISTORY, "stopped_early": False, "rank": 1},
            {"trial_id": "a_00001", "history": HISTORY[:1], "stopped_early": True, "rank": 2},
        ]
        assert _is_png(search_plots.trials_png(trials, title))
    finally:
        Text.draw = original
        plt.close("all")
    # Every figure drew it (constrained layout draws each twice): whole, as written.
    assert title in drawn and any(text.startswith(title + "\ntrue → predicted") for text in drawn)


def test_mathtext_would_have_broken_the_title():
    """The check above can fail: the same title with mathtext on raises."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure()
    fig.suptitle(TITLES[0])
    try:
        with pytest.raises(ValueError):
            fig.savefig(__import__("io").BytesIO(), format="png")
    finally:
        plt.close(fig)
