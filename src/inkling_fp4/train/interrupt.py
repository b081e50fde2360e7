"""Ctrl-C and SIGTERM end a training run cleanly: finish the step in flight, checkpoint, return.

A cluster scheduler preempts a job with SIGTERM (and kills it a little later); a person stops a run
with Ctrl-C. Either way the loop should not die mid-step with a half-applied update and no
checkpoint, so the handler only raises a flag that the loop reads after each step (all ranks agree
on it, see ``distributed.any_rank``). A second Ctrl-C interrupts at once, for a run that hangs.
The previous handlers come back when the run ends, so a library caller's own handling is untouched.
"""

from __future__ import annotations

import signal
import threading


class StopSignal:
    """SIGINT / SIGTERM ask the loop to checkpoint and stop after the step in flight; a second
    SIGINT interrupts at once."""

    def __init__(self):
        self.requested = False
        self.signum: int | None = None
        """The first signal received."""
        self._saved = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signum = self.signum or signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then checkpointing", flush=True)

    def restore(self):
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved = {}
