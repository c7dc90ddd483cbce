"""The exactly-once batch pipeline: source -> scheduler -> engine -> sink.

Holds the job settings (``config.py``), input rows (``sources.py``), rows to requests (``mapping.py``; request
fields in ``requests.py``, conversations and tools in ``prompts.py``, grammars checked up front in
``structures.py``), bounded in-flight work (``scheduler.py``), reading the answer (``answers.py`` with the
``reasoning.py`` and ``tool_calls.py`` parsers), finished rows into Parquet parts (``sink.py``, output schema in
``schema.py``; how a part is committed exactly once, on a disk or an object store, is ``dspine_batch.outdir``'s),
which failed rows ``--retry-errors`` takes out of committed parts (``retry.py``), the run's fingerprint
(``manifest.py``), sharding (``shard.py``), signal handling (``shutdown.py``), the progress bar (``progress.py``),
the heap during a run (``heap.py``), what is settled before rows stream (``preflight.py``: the job, the checks
before the model loads), and ``job.py``, which wires them for one ``dspine-batch generate``. See
``docs/design.md``, "The exactly-once pipeline".

May import: ``dspine_batch.engines`` (the protocol and the registry), ``dspine_batch.errors``,
``dspine_batch.digest``, ``dspine_batch.outdir`` (the exactly-once output), ``dspine_batch.storage`` (URLs, fsspec).
"""
