"""The event vocabulary of the training loop."""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    _StrEnum = enum.StrEnum
else:  # pragma: no cover - Python 3.10

    class _StrEnum(str, enum.Enum):
        def __str__(self) -> str:
            return str(self.value)


class Event(_StrEnum):
    """Every moment of a run at which callbacks are called.

    The value of each member is the name of the `Callback` method that handles
    it. This is the whole loop (`Engine.fit`), with each event where it fires::

        on_setup                          once per engine, before its first run
        on_load                           after a checkpoint was restored
        fit(steps | epochs):
          on_fit_start
          while the step/epoch budget is not spent and no stop was agreed:
            on_epoch_start                a new pass over the training data
            for each optimizer step (its micro-batches already fetched):
              on_step_start
              for each micro-batch (gradient sync only on the last;
                                    a backend overriding forward_backward runs
                                    them on its own schedule, e.g. pipeline):
                on_batch                  engine.batch on device; may be replaced
                forward -> loss           under backend.autocast(); the last outputs released first
                on_forward                engine.outputs, engine.loss; loss may be replaced
                backward
                on_backward
              on_before_optimizer_step    gradients complete (synced, unscaled)
              agree control requests      one small collective over the optimizer domain
              optimizer step (unless a skip was agreed)
              on_optimizer_step           only when the step was taken
              zero grad; state.step += 1
              on_step_end                 scheduler, gc, heartbeat ...
              on_log                      every log_interval steps: metrics reduced
              evaluate(split)             each evaluation set due (eval_every_steps / eval_sets)
              on_save_point               checkpoint, preemption: the step is complete,
                                          its evaluation included
            state.epoch += 1              the epoch's data ran out
            evaluate(split)               each evaluation set due (eval_every_epochs / eval_sets),
                                          unless its step schedule evaluated it at this step
            on_epoch_end
            agree control requests        so a stop raised at epoch end holds everywhere
            on_save_point                 the epoch is complete, its evaluation included
          on_log                          if steps ran since the last interval: metrics reduced
          on_fit_end
        always, when a run (fit/evaluate/predict) raised: on_exception
        always, at the end of a run: on_teardown

        evaluate(): per set: on_eval_start, on_eval_batch per batch (metric
                    objects updated before it), metrics reduced and metric
                    objects synchronized and computed, on_log, on_eval_end
        predict():  on_predict_start, on_predict_batch per batch, on_predict_end
        a checkpoint was committed: on_save
    """

    ON_SETUP = "on_setup"
    ON_LOAD = "on_load"
    ON_FIT_START = "on_fit_start"
    ON_EPOCH_START = "on_epoch_start"
    ON_STEP_START = "on_step_start"
    ON_BATCH = "on_batch"
    ON_FORWARD = "on_forward"
    ON_BACKWARD = "on_backward"
    ON_BEFORE_OPTIMIZER_STEP = "on_before_optimizer_step"
    ON_OPTIMIZER_STEP = "on_optimizer_step"
    ON_STEP_END = "on_step_end"
    ON_LOG = "on_log"
    ON_SAVE_POINT = "on_save_point"
    ON_EPOCH_END = "on_epoch_end"
    ON_FIT_END = "on_fit_end"
    ON_EVAL_START = "on_eval_start"
    ON_EVAL_BATCH = "on_eval_batch"
    ON_EVAL_END = "on_eval_end"
    ON_PREDICT_START = "on_predict_start"
    ON_PREDICT_BATCH = "on_predict_batch"
    ON_PREDICT_END = "on_predict_end"
    ON_SAVE = "on_save"
    ON_EXCEPTION = "on_exception"
    ON_TEARDOWN = "on_teardown"
