"""Where dspine keeps what it computes once per machine: calibrated cost models, built CPU kernels.

``$DSPINE_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/dspine`` (default ``~/.cache/dspine``).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    root = os.environ.get("DSPINE_CACHE_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dspine")
    return Path(root).expanduser()
