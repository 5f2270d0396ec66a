"""Order constants of the built-in callbacks (lower runs first on every event)."""

from __future__ import annotations


class Order:
    """Where the built-ins sit in the total order; user callbacks default to 50.

    Checks and clipping come first so later callbacks see final gradients;
    state-changing callbacks (scheduler, EMA, early stopping) sit in the middle;
    metric producers and loggers come after them so they record the step's
    final state; checkpointing is last but for preemption, which exits after
    the checkpoint of its step is committed.
    """

    PROFILER = 0
    HEARTBEAT = 5
    NON_FINITE = 10
    GRAD_CLIP = 20
    DEFAULT = 50
    SCHEDULER = 60
    EMA = 65
    EARLY_STOPPING = 70
    GC = 75
    METRICS = 80
    LOGGER = 90
    PROGRESS = 95
    CHECKPOINT = 100
    PREEMPTION = 110
