"""What a row asks and what its answer says.

Request fields as users write them, per row and job-wide, under OpenAI's and vLLM's names (``fields.py``); a row
to its requests, all validation of user data in one place (``mapping.py``, with row ids); conversations, tools and
the system prompt (``prompts.py``); grammars checked up front (``structures.py``); prompt templates and the
budgets that bound them and ``where`` (``templates.py``, ``budgets.py``); and from a completion to the answer
columns (``answers.py``, with the ``reasoning.py`` and ``tool_calls.py`` parsers).

May import: ``dspine_batch.inputs``, ``dspine_batch.outdir`` (row keys, the output schema),
``dspine_batch.engines``, ``dspine_batch.errors``, ``dspine_batch.storage``, ``dspine_batch.config``,
``dspine_batch.log``.
"""
