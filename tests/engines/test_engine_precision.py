"""The reference engine's dtype/quant engine args: recorded in its identity, lossless within the setting."""

from __future__ import annotations

import pytest
from helpers import chat_requests, reference_engine

from dspine_batch.errors import UsageError


def test_bf16_int8_setting_is_recorded_and_speculative_equals_plain(tiny):
    eng = reference_engine(tiny, dtype="bfloat16", quant="int8")
    assert eng.identity()["dtype"] == "bfloat16" and eng.identity()["quant"] == "int8"
    reqs = chat_requests(eng)
    spec = list(eng.run(iter(reqs), max_in_flight=8))
    plain = list(reference_engine(tiny, draft=False, quant="int8").run(iter(reqs), 8))  # quant alone implies bf16
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    fp32 = reference_engine(tiny, dtype="float32")
    assert fp32.identity()["dtype"] == "float32" and "quant" not in fp32.identity()


def test_default_dtype_is_auto_and_resolved_in_the_identity(tiny):
    from dspine.models.registry import auto_dtype

    eng = reference_engine(tiny)  # no dtype: auto, i.e. bf16 where our bf16 family runs this target
    want = auto_dtype(eng.model_path)
    assert eng.identity()["dtype"] == want
    assert ("-bf16" in eng.target.kernel) == (want == "bfloat16")


@pytest.mark.parametrize("args,match", [({"dtype": "fp16"}, "dtype 'fp16'"), ({"quant": "int2"}, "quant 'int2'"),
                                        ({"dtype": "float32", "quant": "int4"}, "compute in bfloat16")])
def test_bad_precision_is_a_usage_error(tiny, args, match):
    with pytest.raises(UsageError, match=match):
        reference_engine(tiny, **args)
