"""The one log line format of every command: ``dspine-batch: <message>`` on stderr, flushed, with any secret a
message could carry (a URL's password, a SAS token, a key named like a credential) redacted (``storage.urls``)."""

from __future__ import annotations

import sys

from dspine_batch.storage.urls import redact


def log(msg: str) -> None:
    print(f"dspine-batch: {redact(msg)}", file=sys.stderr, flush=True)
