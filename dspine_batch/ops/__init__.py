"""Operating finished and running jobs: the commands around ``generate``.

Holds ``slurm.py`` (render and submit sbatch array jobs from a TOML job file), ``status.py`` (every shard's
progress), ``finalize.py`` (prove exactly-once coverage, write ``_SUCCESS``) and ``report.py`` (acceptance
statistics of an output directory).

May import: ``dspine_batch.pipeline``, ``dspine_batch.engines``, ``dspine_batch.errors``.
"""
