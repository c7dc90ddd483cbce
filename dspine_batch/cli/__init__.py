"""The ``dspine-batch`` command line (click): ``commands`` holds the commands (generate, estimate, prepare, info,
status, report, export, finalize, slurm) and ``main``, the entry point that turns our errors into one line and an
exit code; ``options`` the option types, the decorators giving each option its ``DSPINE_BATCH_<OPTION>`` variable
and default, and the job file's reading; ``help`` the sections and tables of ``generate --help``.

The top of the package: it may import every other package of dspine_batch (the runner, ops, requests, inputs,
engines, stages, outdir, storage, config, log, errors); nothing imports it.
"""

from dspine_batch.cli.commands import cli, main

__all__ = ["cli", "main"]
