"""The exactly-once output: one commit protocol over a store's primitives, for a local disk and an object store.

Holds where things live (``layout.py``), row keys as 64-bit hashes (``keyset.py``), commit records and the part
bytes they describe (``records.py``), the state every step shares (``core.py``: the store, the owner's lease, the
records a start read), the commit (``commit.py``: stage -> create-only record -> publish -> cleanup, and the
``Committer`` that runs it on threads for a store), parts checked against their records and damage moved aside
(``check.py``), the done-set (``done.py``), interrupted publishes and orphans (``sweep.py``), ``finalize
--compact`` (``compact.py``) and ``--retry-errors``' take-out (``supersede.py``) with their journals, the one
recovery every command runs first (``recovery.py``), the manifest (``manifest.py``), a local shard's ``flock``
(``lock.py``), outputs written before this layout (``legacy.py``), and ``output.py``: ``OutDir``, the ``Output``
the run, the stages and the ops call. The store is ``storage.objects.ObjectStore`` (S3, Azure, or the local disk
as one more store): no module here knows which. See ``docs/design.md``, "Parts and the commit protocol".

May import: ``dspine_batch.errors`` and ``dspine_batch.storage`` only (the requests, the stages, the runner and the
ops import this package, never the reverse). The output schema (``schema.py``: every column typed up front) is
the contract readers rely on.
"""
