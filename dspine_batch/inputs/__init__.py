"""Where rows come from: the input readers (``sources.py``: JSON Lines, compressed or not, OpenAI batch lines,
Parquet files and folders, Arrow and ``save_to_disk`` datasets, local Hugging Face datasets, over fsspec URLs),
how many rows there are and how far a run has read (``totals.py``), and the record of each JSON Lines row that
lets --retry-errors accept a fixed input (``rowrecord.py``).

May import: ``dspine_batch.errors``, ``dspine_batch.digest``, ``dspine_batch.storage``, ``dspine_batch.log``.
"""
