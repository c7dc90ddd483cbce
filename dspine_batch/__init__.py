"""dspine-batch: offline batch generation with exactly-once resume.

Data flows one way: ``pipeline.sources`` (input rows) -> ``pipeline.mapping`` (rows to requests) ->
``pipeline.scheduler`` (bounded in-flight work) -> ``engines`` (any implementation of ``engines.base.Engine``) ->
``pipeline.sink`` (atomic Parquet parts); ``pipeline.job`` wires them. ``ops`` holds the commands around a job
(slurm, status, finalize, report); ``cli`` is the user-facing entry point. ``errors`` (exit codes) and ``digest``
(file content digests) sit beneath everything. Imports point down that list, never back up:
``tests/house/test_layering.py`` checks it.
"""

import time as _time

__version__ = "0.1.0"
IMPORTED_AT = _time.monotonic()  # the command's first import: ``pipeline.job.since_start`` measures from near here
