"""Several stages in one job (``[[stages]]`` in a job file): each stage's rows are built from the committed rows of
the stage before it (a template over their columns and parsed outputs, an ``explode`` of a list into rows), its
outputs filtered (``where``) and deduplicated (``dedup``), consecutive stages on one model on one engine loaded
once (a stage on another model after them), each stage exactly-once in its own ``OUTDIR/<stage>/`` (a local
directory or an object-store prefix). The stages as written (``spec.py``), rows between stages and the rules that
judge them (``rows.py``), the predicate language (``where.py``), dedup across shards (``keylog.py``: each part's
kept keys in one log) and near duplicates (``near.py``), scoring stages (``score.py``) and select steps
(``select.py``: best-of-n), and the staged ``finalize`` (``finalize.py``). The one runner
(``dspine_batch.run``) runs them.

May import: ``dspine_batch.requests``, ``dspine_batch.inputs``, ``dspine_batch.engines``, ``dspine_batch.outdir``,
``dspine_batch.ops`` (a staged finalize is the ops one per stage), ``dspine_batch.storage``, ``dspine_batch.config``,
``dspine_batch.log``, ``dspine_batch.errors``.
"""
