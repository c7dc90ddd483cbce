"""dspine-batch: offline batch generation with exactly-once resume.

Data flows one way: ``sources`` (input rows) -> ``mapping`` (rows to requests) -> ``scheduler`` (bounded
in-flight work) -> ``engine`` (any implementation of the engine protocol) -> ``sink`` (atomic Parquet parts).
``pipeline`` wires them; ``cli`` is the user-facing entry point.
"""

__version__ = "0.1.0"
