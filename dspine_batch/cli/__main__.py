"""``python -m dspine_batch.cli``: the ``dspine-batch`` command."""

from dspine_batch.cli.commands import main

main()
