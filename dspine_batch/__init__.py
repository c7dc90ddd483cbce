"""dspine-batch: offline batch generation with exactly-once resume.

The folders follow the data, one way: ``inputs`` (where rows come from: readers, totals, the row record) ->
``requests`` (what a row asks — fields, templates, conversations, grammars, the mapping of a row to its requests —
and what its answer says: reasoning, tool calls, log-probabilities) -> ``run`` (the one runner: the scheduler
around the engine, the watchdog, deaths, retries, signals, the sink) -> ``engines`` (any implementation of
``engines.base.Engine``) -> ``outdir`` (the exactly-once output: one commit protocol over ``storage``'s
primitives, the one recovery, the done-set, compaction and take-outs). ``stages`` holds a staged job's rules,
``ops`` the commands around a job (slurm, status, finalize, report, export), ``cli`` the user-facing entry point;
``config`` the job's settings, ``log`` the log line, ``errors`` (exit codes) and ``digest`` (content digests)
beneath everything. Imports point down that map, never back up: ``tests/house/test_layering.py`` checks it.
"""

import time as _time

__version__ = "0.1.0"
IMPORTED_AT = _time.monotonic()  # the command's first import: ``run.state.since_start`` measures from near here
