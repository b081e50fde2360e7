"""Ctrl-C and SIGTERM end a training run cleanly: finish the step in flight, checkpoint, return.

A scheduler preempts with SIGTERM, a person stops a run with Ctrl-C; either way the loop must not die
mid-step with a half-applied update, so the handler only raises a flag the loop reads after each
step (all ranks agree, ``distributed.any_rank``).

A second Ctrl-C stops at once (:class:`StoppedAtOnce`, no new checkpoint), except during a checkpoint
write: that one finishes first (a third Ctrl-C stops at once). Writes are atomic either way.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C ended the run without the checkpoint of its last step; the training loop says
    (and gives as the message) which step ``--resume`` starts from."""


class StopSignal:
    """SIGINT / SIGTERM ask the loop to checkpoint and stop after the step in flight."""

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
