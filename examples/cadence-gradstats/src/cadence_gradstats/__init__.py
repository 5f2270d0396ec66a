"""Gradient statistics and a learning-rate finder for Cadence.

Both callbacks are published under the entry-point group `cadence.callbacks`
(`gradient_histogram`, `lr_finder`), so a Cadence config can name them; they
run only when named.

Example:
    >>> from cadence.run.registry import build_callback
    >>> build_callback({"name": "gradient_histogram", "bins": 30}).config.bins
    30
"""

from __future__ import annotations

from cadence_gradstats.histogram import GradientHistogram, GradientHistogramConfig
from cadence_gradstats.lr_finder import LRFinder, LRFinderConfig

__version__ = "0.1.0"

__all__ = ["GradientHistogram", "GradientHistogramConfig", "LRFinder", "LRFinderConfig", "__version__"]
