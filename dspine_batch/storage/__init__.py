"""Where data lives: local paths and fsspec URLs (``s3://``, ``gs://``, ``az://``, ``hf://``, ...).

Holds ``urls.py`` (telling a URL from a path, redacting secrets, ``--storage-option`` parsing, which extra a
scheme needs), ``fs.py`` (the fsspec filesystem of a URL with the job's storage options, retries with backoff on
transient errors, one-line messages for permanent ones), ``objects.py`` (an object-store prefix: create-only
writes, compare-and-swap, server-side copy: the primitives an exactly-once OUTDIR needs where there is no rename;
the one interface the commit protocol sees), ``primitives.py`` (what each store implements under it), ``s3.py``
and ``azure.py`` (those primitives as S3's API and Azure Blob Storage spell them, picked by URL scheme) and
``lease.py`` (shard ownership on a store without ``flock``: a lease object with an expiry, renewed by
compare-and-swap). The commit protocol built on them lives in ``dspine_batch.outdir``.

May import: ``dspine_batch.errors`` only (the pipeline and the ops import this package, never the reverse).
"""
