"""The reference engine's dtype/quant engine args: recorded in its identity, lossless within the setting."""

from __future__ import annotations

import pytest
from test_reference_engine import _engine, _requests, tiny  # noqa: F401  (tiny is a fixture)

from dspine_batch.errors import UsageError


def test_bf16_int8_setting_is_recorded_and_speculative_equals_plain(tiny):  # noqa: F811
    eng = _engine(tiny, dtype="bfloat16", quant="int8")
    assert eng.identity()["dtype"] == "bfloat16" and eng.identity()["quant"] == "int8"
    reqs = _requests(eng)
    spec = list(eng.run(iter(reqs), max_in_flight=8))
    plain = list(_engine(tiny, draft=False, quant="int8").run(iter(reqs), 8))  # quant alone implies bf16
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    fp32 = _engine(tiny)
    assert fp32.identity()["dtype"] == "float32" and "quant" not in fp32.identity()


@pytest.mark.parametrize("args,match", [({"dtype": "fp16"}, "dtype 'fp16'"), ({"quant": "int2"}, "quant 'int2'"),
                                        ({"dtype": "float32", "quant": "int4"}, "compute in bfloat16")])
def test_bad_precision_is_a_usage_error(tiny, args, match):  # noqa: F811
    with pytest.raises(UsageError, match=match):
        _engine(tiny, **args)
