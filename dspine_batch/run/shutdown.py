"""Stop signals: SIGTERM/SIGINT/SIGUSR1 stop admission, in-flight work gets a grace budget, then we commit
and exit 75. A second signal exits at once.

Exiting at once is safe at any instant because of the commit protocol (``sink``): the worst case is a
staging file, deleted on the next start. When the grace budget runs out, ``Interrupted`` is raised only if
the main thread is inside the engine (``in_engine``), whose in-flight work we drop anyway; anywhere else
(sink, bookkeeping) the timeout just sets ``expired`` and the main loop stops at the next row boundary, so
an exception can never land between "part renamed" and "buffer cleared".
"""

from __future__ import annotations

import os
import signal

from dspine_batch.errors import EXIT_INTERRUPTED, Interrupted

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Shutdown:
    def __init__(self, grace_seconds: float):
        self.grace_seconds = grace_seconds
        self.requested = False
        self.reason = ""
        self.expired = False
        self.in_engine = False
        self._old: dict[int, object] = {}

    def install(self) -> Shutdown:
        for sig in (*STOP_SIGNALS, signal.SIGALRM):
            self._old[sig] = signal.signal(sig, self._on_alarm if sig == signal.SIGALRM else self._on_signal)
        return self

    def restore(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in self._old.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old.clear()

    def request(self, reason: str) -> None:
        """Stop admitting work (also used for non-signal stops, e.g. --on-error fail)."""
        if not self.requested:
            self.requested = True
            self.reason = reason

    def _on_signal(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.requested and self.reason.startswith("signal"):
            os.write(2, f"dspine-batch: second {name}: exiting now (committed parts are safe)\n".encode())
            os._exit(EXIT_INTERRUPTED)
        self.request(f"signal {name}")
        os.write(2, f"\ndspine-batch: {name}: finishing in-flight work (up to {self.grace_seconds:g}s), then "
                    "committing; send again to exit at once\n".encode())
        signal.setitimer(signal.ITIMER_REAL, max(self.grace_seconds, 0.001))

    def _on_alarm(self, signum: int, frame: object) -> None:
        self.expired = True
        if self.in_engine:
            raise Interrupted("grace period over")
