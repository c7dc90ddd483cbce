"""Operating finished and running jobs: the commands around ``generate``.

Holds ``slurm.py`` (render and submit sbatch array jobs from a TOML job file), ``status.py`` (every shard's
progress), ``finalize.py`` (prove exactly-once coverage, write ``_SUCCESS``), ``report.py`` (acceptance
statistics of an output directory; answers and structured-output validity in ``answer_stats.py``) and
``export.py`` (an output directory as an OpenAI batch results file).

May import: ``dspine_batch.requests``, ``dspine_batch.inputs``, ``dspine_batch.outdir``, ``dspine_batch.engines``,
``dspine_batch.storage``, ``dspine_batch.config``, ``dspine_batch.log``, ``dspine_batch.errors``.
"""
