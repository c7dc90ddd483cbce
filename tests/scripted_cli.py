"""``dspine-batch`` with the scripted test engine behind ``auto``/``reference``: the subprocess tests' entry point
(kill -9, signals), so the production CLI needs no switch for tests. ``python tests/scripted_cli.py generate ...``"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from helpers import scripted_engine  # noqa: E402

from dspine_batch.cli import main  # noqa: E402
from dspine_batch.engines.registry import engines_replaced  # noqa: E402

if __name__ == "__main__":
    with engines_replaced(scripted_engine):
        main()
