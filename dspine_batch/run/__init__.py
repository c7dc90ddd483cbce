"""The run: every ``dspine-batch generate`` — one stage or many, a local directory or an object store — through one
runner, so the watchdog, --request-timeout, engine-death isolation, --retry-errors, the error budget, SIGTERM
grace and the lock or lease hold for every stage of every job.

The runner's start-up and end (``runner.py``), a stage's output and rows (``stage.py``), the loop of the stages on
one engine (``segment.py``); around it, bounded in-flight work (``scheduler.py``), the watchdog and
--request-timeout (``watchdog.py``), engine deaths told apart (``deaths.py``), stop signals (``shutdown.py``),
progress (``progress.py``), error rows said where they are seen (``errorlog.py``), the heap (``heap.py``), the
input rows a shard still owes (``selector.py``), finished rows into parts (``sink.py``), the shard's state file and
timing (``state.py``), sharding (``shard.py``); what is settled before rows stream (``preflight.py``), the run's
identity (``fingerprint.py``, ``rerun.py``), a finished job's rerun without a model (``precheck.py``) and
--retry-errors (``retry.py``).

May import: every package below it — ``dspine_batch.inputs``, ``dspine_batch.requests``, ``dspine_batch.stages``,
``dspine_batch.ops``, ``dspine_batch.engines``, ``dspine_batch.outdir``, ``dspine_batch.storage``,
``dspine_batch.config``, ``dspine_batch.log``, ``dspine_batch.errors``, ``dspine_batch.digest``.
"""
