"""The exactly-once batch pipeline: source -> scheduler -> engine -> sink.

Holds the job settings (``config.py``), input rows (``sources.py``), rows to requests (``mapping.py``, row keys in
``keyset.py``; request fields in ``requests.py``, conversations and tools in ``prompts.py``, grammars checked up
front in ``structures.py``), bounded in-flight work (``scheduler.py``), reading the answer (``answers.py`` with the
``reasoning.py`` and ``tool_calls.py`` parsers), atomic Parquet parts (``sink.py``, output schema in
``schema.py``), resume's done-set (``resume.py``), where OUTDIR lives (``outputs.py``: a local directory, or an
object-store prefix with its own commit protocol in ``remote.py``, its layout in ``remote_layout.py``), taking
failed rows out of committed parts for ``--retry-errors`` (``retry.py``; ``supersede.py`` on a local disk,
``remote_supersede.py`` on an object store), the run's fingerprint (``manifest.py``), part compaction
(``compact.py``), sharding (``shard.py``), signal handling (``shutdown.py``), the progress bar (``progress.py``),
the heap during a run (``heap.py``), what is settled before rows stream (``preflight.py``: the job, the checks
before the model loads), and ``job.py``, which wires them for one ``dspine-batch generate``. See
``docs/design.md``, "The exactly-once pipeline".

May import: ``dspine_batch.engines`` (the protocol and the registry), ``dspine_batch.errors``,
``dspine_batch.digest``, ``dspine_batch.storage`` (URLs, fsspec, object-store primitives, leases).
"""
