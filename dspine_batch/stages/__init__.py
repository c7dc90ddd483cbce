"""Several stages in one job (``[[stages]]`` in a job file): each stage's rows are built from the committed rows of
the stage before it (a template over their columns and parsed outputs, an ``explode`` of a list into rows), its
outputs filtered (``where``) and deduplicated (``dedup``), all on one engine loaded once, each stage exactly-once in
its own ``OUTDIR/<stage>/``.

May import: ``dspine_batch`` (errors, digest), ``dspine_batch.pipeline``, ``dspine_batch.engines`` and
``dspine_batch.ops`` (a staged finalize is the ops one per stage); imported by the CLI only.
"""
