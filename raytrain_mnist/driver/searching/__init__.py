"""The Tune search as a library call: :func:`search` returns a :class:`SearchResult`.

Every trial is a full ``TorchTrainer`` run of fit's worker loop, or with ``--service`` a
request to a warm service (:mod:`.on_service`); a search resumes from its own JSON records
and each trial's weights-only checkpoint, never from Tune's pickled state (docs/design.md,
"A search"). Library code: it never prints; its events go to ``on_event``.
"""

from raytrain_mnist.driver.searching.api import search
from raytrain_mnist.driver.searching.result import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    PLOT_FILE,
    RESULTS_FILE,
    SearchResult,
)

__all__ = [
    "FAILED",
    "FINISHED",
    "INTERRUPTED",
    "PLOT_FILE",
    "RESULTS_FILE",
    "SearchResult",
    "search",
]
