"""Ctrl-C and SIGTERM end a training run cleanly: finish the step in flight, checkpoint, return.

A cluster scheduler preempts a job with SIGTERM (and kills it a little later); a person stops a run
with Ctrl-C. Either way the loop should not die mid-step with a half-applied update and no
checkpoint, so the handler only raises a flag that the loop reads after each step (all ranks agree
on it, see ``distributed.any_rank``).

A second Ctrl-C is for a run that takes too long to stop. While a checkpoint is being written it
waits for the write (atomic, and the run stops right after it), so what the first Ctrl-C asked for
is not thrown away; a third stops at once. Anywhere else the second one stops at once: it raises
:class:`StoppedAtOnce` and no new checkpoint is written (``checkpoint.py``'s write is atomic, so
none is ever half written either way). The previous handlers come back when the run ends, so a
library caller's own handling is untouched.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C ended the run without the checkpoint of its last step; the training loop says
    (and gives as the message) which step ``--resume`` starts from."""


class StopSignal:
    """SIGINT / SIGTERM ask the loop to checkpoint and stop after the step in flight; a second
    SIGINT waits for a checkpoint being written, else stops at once (see the module docstring)."""

    def __init__(self):
        self.requested = False
        self.signum: int | None = None
        """The first signal received."""
        self.again = False
        """A second SIGINT came while a checkpoint was written: stop right after it."""
        self.stopped_writing = False
        """The stop at once came during a checkpoint's write (which may have ended by then)."""
        self._writing = self._stopping = False
        self._saved = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._saved[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self._stopping:  # already on the way out: let the message be written
            return
        if self.requested and signum == signal.SIGINT:
            if self._writing and not self.again:
                self.again = True
                print("\nSIGINT again: finishing the checkpoint being written (it is atomic), then stopping; "
                      "a third Ctrl-C stops at once without it", flush=True)  # fmt: skip
                return
            self._stopping, self.stopped_writing = True, self._writing
            raise StoppedAtOnce
        first = not self.requested  # else a repeated SIGTERM, or a stop asked for without a signal
        self.requested = True
        self.signum = self.signum or signum
        if not first:
            return
        again = " (a second Ctrl-C stops at once, without it)" if signum == signal.SIGINT else ""
        print(f"\n{signal.Signals(signum).name}: finishing this step, then checkpointing{again}", flush=True)

    @contextlib.contextmanager
    def writing_checkpoint(self):
        """A second SIGINT during the block waits for it to end (see the module docstring)."""
        self._writing = True
        try:
            yield
        finally:
            self._writing = False

    def restore(self):
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved = {}
