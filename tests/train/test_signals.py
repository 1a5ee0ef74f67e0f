"""The signals API the study's worker relies on: whether a running training loop has taken a signal."""

from __future__ import annotations

import os
import signal

from diffattn.train.signals import StopSignals, training_stop_taken


def test_training_stop_taken_while_a_loop_that_took_a_signal_runs() -> None:
    assert not training_stop_taken()
    with StopSignals() as outer:
        assert not training_stop_taken()  # running, no signal yet
        with StopSignals() as inner:
            os.kill(os.getpid(), signal.SIGINT)  # handled by the innermost handler, in this thread
            assert inner.signum == signal.SIGINT and outer.signum == 0
            assert training_stop_taken()
        assert not training_stop_taken()  # the loop that took it has finished
    assert not training_stop_taken()
