"""The run: every ``dspine-batch generate`` — one stage or many, a local directory or an object store — through one
runner (``runner``), so the watchdog, --request-timeout, engine-death isolation, --retry-errors, the error budget,
SIGTERM grace and the lock or lease hold for every stage of every job.

May import: ``dspine_batch.pipeline``, ``dspine_batch.stages``, ``dspine_batch.engines``, ``dspine_batch.errors``,
``dspine_batch.digest``, ``dspine_batch.ops``, ``dspine_batch.storage``.
"""
