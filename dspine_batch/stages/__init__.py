"""Several stages in one job (``[[stages]]`` in a job file): each stage's rows are built from the committed rows of
the stage before it (a template over their columns and parsed outputs, an ``explode`` of a list into rows), its
outputs filtered (``where``) and deduplicated (``dedup``), consecutive stages on one model on one engine loaded
once (a stage on another model after them), each stage exactly-once in its own ``OUTDIR/<stage>/`` (a local
directory or an object-store prefix). The stages as written (``spec.py``), rows between stages (``rows.py``), the
predicate language (``where.py``), the run (``run.py``), a finished job's rerun without a model (``rerun.py``) and
the staged ``finalize`` (``finalize.py``).

May import: ``dspine_batch`` (errors, digest), ``dspine_batch.pipeline``, ``dspine_batch.engines`` and
``dspine_batch.ops`` (a staged finalize is the ops one per stage); imported by the CLI only.
"""
