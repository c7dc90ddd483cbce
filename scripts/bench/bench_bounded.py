#!/usr/bin/env python
"""What the budgets on user code cost, and what DuckDB would have cost for ``where`` (issue 50).

1. Templates: one row rendered by a plain ``SandboxedEnvironment`` (before) and by ours under budgets
   (``requests.templates``: counted loops and calls, checked sizes, a deadline), µs a row, for a one-field
   template and one with a loop and filters.
2. ``where``: our walker (``stages.where``) a row, against DuckDB evaluating the same predicate in SQL over an
   Arrow batch of the same rows (the alternative weighed in ``stages/where.py``), per batch and per row.

Each pair is timed side by side, alternating order, ``--repeats`` times; the best of each is printed.

Usage:
    python scripts/bench/bench_bounded.py [--rows 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from jinja2 import StrictUndefined
from jinja2.sandbox import SandboxedEnvironment

from dspine_batch.requests.templates import compile_template
from dspine_batch.stages.where import parse_where

TEMPLATES = {
    "one field": "Write questions about: {{ text }}",
    "loop+filters": "Doc {{ text|upper }}:{% for q in items %} {{ loop.index }}. {{ q|trim }}{% endfor %} "
                    "({{ items|length }} items, {{ '%5s' % kind }})",
}
PREDICATE = ("score >= 4 and len(reason) > 3", "score >= 4 and length(reason) > 3")


def _best(fn: Callable[[], None], n: int) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) / n


def bench_templates(rows: list[dict], repeats: int) -> None:
    plain_env = SandboxedEnvironment(undefined=StrictUndefined, autoescape=False)
    for name, text in TEMPLATES.items():
        plain = plain_env.from_string(text)
        ours = compile_template(text, "--prompt-template")
        assert plain.render(rows[0]) == ours.render(rows[0], "x", 0)
        runs = {"plain sandbox": lambda p=plain: [p.render(r) for r in rows],
                "under budgets": lambda o=ours: [o.render(r, "x", i) for i, r in enumerate(rows)]}
        best = {k: float("inf") for k in runs}
        for rep in range(repeats):
            for k in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
                best[k] = min(best[k], _best(runs[k], len(rows)))
        print(f"template {name!r}: " + ", ".join(f"{k} {v * 1e6:.1f} µs/row" for k, v in best.items())
              + f" (x{best['under budgets'] / best['plain sandbox']:.2f})")


def bench_where(rows: list[dict], repeats: int) -> None:
    import duckdb
    import pyarrow as pa

    walker = parse_where(PREDICATE[0])
    table = pa.Table.from_pylist([{"score": r["score"], "reason": r["reason"]} for r in rows])
    con = duckdb.connect()
    sql = f"select {PREDICATE[1]} as kept from batch"

    def duck_batch() -> None:
        batch = table  # noqa: F841 (read by DuckDB's replacement scan)
        con.execute(sql).fetchall()

    def duck_rows() -> None:
        for r in rows[:200]:
            con.execute(f"select {PREDICATE[1]} from (select ? as score, ? as reason)", [r["score"], r["reason"]])
            con.fetchall()

    want = [walker.test(r)[0] for r in rows]
    batch = table  # noqa: F841
    assert [k for (k,) in con.execute(sql).fetchall()] == want
    runs = {"walker": (lambda: [walker.test(r) for r in rows], len(rows)),
            "duckdb, one query a batch": (duck_batch, len(rows)),
            "duckdb, one query a row": (duck_rows, 200)}
    best = {k: float("inf") for k in runs}
    for rep in range(repeats):
        for k in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
            fn, n = runs[k]
            best[k] = min(best[k], _best(fn, n))
    print(f"where {PREDICATE[0]!r}, {len(rows)} rows: " + ", ".join(f"{k} {v * 1e6:.2f} µs/row"
                                                                      for k, v in best.items()))
    mixed = pa.Table.from_pylist  # one row's score a string: the batch has no one type
    try:
        mixed([{"score": 4, "reason": "fine"}, {"score": "high", "reason": "odd"}])
        print("a batch with a string score converts")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        print(f"a batch where one row's score is a string does not convert to Arrow: {str(e)[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    rows = [{"text": f"document {i} about the tides", "items": [f" q{j} " for j in range(5)], "kind": "k",
             "score": i % 6, "reason": "clear" if i % 3 else "ok"} for i in range(a.rows)]
    bench_templates(rows, a.repeats)
    bench_where(rows, a.repeats)


if __name__ == "__main__":
    main()
