"""Where SGLang 0.5.23 decides by algorithm *name* and leaves DSPINE out: included where the feature works for
DSPINE (it is the DFlash V2 worker underneath), refused with a clear error where it does not.

* ``--speculative-draft-window-size``: honoured (the DFlash compact draft KV cache), but SGLang warns "has no
  effect" for any name other than EAGLE/EAGLE3/DFLASH; the false warning is filtered out.
* the scheduler's per-batch speculative metrics snapshot (``metrics_reporter._SPEC_DECODE_SNAPSHOT_ALGORITHMS``,
  a tuple of enum members): DSPINE is added, so its acceptance shows in SGLang's metrics as DFLASH's does.
* refused in ``algo.validate_server_args`` (clear DSPINE errors instead of SGLang's lists of other names):
  block verification, ragged verify (``SGLANG_RAGGED_VERIFY_MODE``), LoRA adapters — none checked for DSPINE.
"""

from __future__ import annotations

import logging

from . import ALGORITHM_NAME
from .after_import import after_import

SPECULATIVE_HOOK_LOGGER = "sglang.srt.arg_groups.speculative_hook"
METRICS_MODULE = "sglang.srt.managers.scheduler_components.metrics_reporter"


class FalseWindowWarning(logging.Filter):
    """Drops SGLang's "--speculative-draft-window-size has no effect" warning for DSPINE (it has an effect)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("--speculative-draft-window-size has no effect")
                    and ALGORITHM_NAME in tuple(map(str, record.args or ())))


def _add_to_metrics_snapshot(module) -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string(ALGORITHM_NAME)
    if algo not in module._SPEC_DECODE_SNAPSHOT_ALGORITHMS:
        module._SPEC_DECODE_SNAPSHOT_ALGORITHMS = (*module._SPEC_DECODE_SNAPSHOT_ALGORITHMS, algo)


def include() -> None:
    """Install the inclusions above in this process (idempotent; after the algorithm is registered)."""
    log = logging.getLogger(SPECULATIVE_HOOK_LOGGER)
    if not any(isinstance(f, FalseWindowWarning) for f in log.filters):
        log.addFilter(FalseWindowWarning())
    after_import(METRICS_MODULE, _add_to_metrics_snapshot)
