"""``report``: a summary of committed results, computed from the parts (so it is right after crashes).

tau (accept length) is reported request-weighted (mean/median over rows) and token-weighted (total
completion tokens / total verify steps); the two differ when long outputs accept better (see the design
notes). "tau by position" is the fraction of verify steps whose draft was accepted at least up to position j.

By source (the DSpine draft, suffix matches): verify steps, tokens proposed and accepted from the parts, and from
the engine's own record in the shards' state files (``dspine_batch.engines.decisions``) whether a source ran and,
when it never did, why ("dspine draft  not run — --engine-arg proposers=suffix").

The prefix-cache hit rate is cached prompt tokens / prompt tokens over the ok rows whose engine reported a cache
count (``cached_prompt_tokens`` not null): rows that do not say (an engine without the count, parts written
before schema 3) are left out of both sums rather than counted as misses, and with none the rate is n/a.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from dspine_batch.engines.decisions import combine, source_lines
from dspine_batch.errors import error_kind
from dspine_batch.ops.answer_stats import AnswerTally, format_answers
from dspine_batch.ops.cost import cost_line, job_cost
from dspine_batch.outdir.output import arrow_path, committed_parts, open_output, shard_states
from dspine_batch.outdir.schema import SOURCE_STATS
from dspine_batch.storage.objects import ObjectStore
from dspine_batch.storage.urls import is_url

COLUMNS = ["row_id", "status", "error", "finish_reason", "prompt_tokens", "completion_tokens", "verify_steps",
           "draft_tokens_proposed", "draft_tokens_accepted", "accept_length", "accept_histogram", "latency_s"]
OPTIONAL = SOURCE_STATS + ["cached_prompt_tokens"]  # read where a part has them (added in schema 2 and 3)


def summarize(outdir: str) -> dict[str, Any]:
    n = ok = 0
    prompt_toks = comp_toks = steps = spec_toks = proposed = accepted = 0
    taus: list[np.ndarray] = []
    lat: list[np.ndarray] = []
    hist = np.zeros(0, dtype=np.int64)
    finish: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    examples: dict[str, str] = {}
    errored: set[tuple[str, str]] = set()
    rows: set[str] = set()
    by_source = {name: 0 for name in SOURCE_STATS}  # dspine_ / suffix_ / forced_ (grammar-forced tokens)
    cached = cache_prompt = cache_rows = 0  # prefix cache: rows that report it, their cached and prompt tokens
    answers = AnswerTally()  # reasoning, tool calls, logprobs, structured outputs (schema 4)
    parts = committed_parts(outdir)
    for part in parts:
        # parts written before schema 2 have no by-source columns, before schema 3 no cached_prompt_tokens
        src = arrow_path(part.path)
        have = set(pq.read_schema(src["source"], filesystem=src.get("filesystem")).names)
        answers.add_part(part.path, have)
        t = pq.read_table(**src, columns=COLUMNS + [c for c in OPTIONAL if c in have]).to_pydict()
        n += len(t["row_id"])
        rows.update(t["row_id"])
        for i, st in enumerate(t["status"]):
            finish[t["finish_reason"][i]] += 1
            if st != "ok":
                key = error_kind(t["error"][i] or "failed")
                if (t["row_id"][i], key) not in errored:  # rows, as the run log counts them, not samples
                    errored.add((t["row_id"][i], key))
                    errors[key] += 1
                examples.setdefault(key, t["error"][i] or "")
                continue
            ok += 1
            prompt_toks += t["prompt_tokens"][i] or 0
            comp_toks += t["completion_tokens"][i] or 0
            if "cached_prompt_tokens" in t and t["cached_prompt_tokens"][i] is not None:
                cache_rows += 1
                cached += t["cached_prompt_tokens"][i]
                cache_prompt += t["prompt_tokens"][i] or 0
            if t["verify_steps"][i]:
                steps += t["verify_steps"][i]
                # tokens committed by verify rounds, in the engine's own accept_length convention
                spec_toks += (t["accept_length"][i] or 0.0) * t["verify_steps"][i]
                proposed += t["draft_tokens_proposed"][i] or 0
                accepted += t["draft_tokens_accepted"][i] or 0
                for name in by_source:
                    by_source[name] += (t[name][i] or 0) if name in t else 0
                h = t["accept_histogram"][i]
                if h:
                    if len(h) > len(hist):
                        hist = np.pad(hist, (0, len(h) - len(hist)))
                    hist[: len(h)] += np.asarray(h, dtype=np.int64)
        taus.append(np.array([x for x, s in zip(t["accept_length"], t["status"], strict=True)
                              if x is not None and s == "ok"], dtype=np.float64))
        lat.append(np.array([x for x in t["latency_s"] if x is not None], dtype=np.float64))
    tau = np.concatenate(taus) if taus else np.zeros(0)
    lats = np.concatenate(lat) if lat else np.zeros(0)
    shards = {p.shard for p in parts}
    states = dict(shard_states(outdir))
    elapsed = max((states.get(tag, {}).get("elapsed_s", 0.0) for tag in shards), default=0.0)
    firsts = [st["first_token_s"] for tag in shards if isinstance((st := states.get(tag, {})).get("first_token_s"),
                                                                    (int, float))]
    decided = combine([st["decisions"] for st in states.values() if isinstance(st.get("decisions"), dict)])
    total_steps = int(hist.sum())
    by_pos = [float(hist[j:].sum() / total_steps) for j in range(1, len(hist))] if total_steps else []
    return {
        "outdir": open_output(outdir).display, "input_rows": len(rows), "output_rows": n, "ok": ok, "errors": n - ok,
        "prompt_tokens": prompt_toks, "completion_tokens": comp_toks, "elapsed_s": round(elapsed, 3),
        "first_token_s": min(firsts) if firsts else None,
        "prefix_cache": {"rows": cache_rows, "prompt_tokens": cache_prompt, "cached_prompt_tokens": cached,
                         "hit_rate": _r(cached / cache_prompt) if cache_prompt else None},
        "tokens_per_s": round(comp_toks / elapsed, 2) if elapsed else None,
        "latency_s": _quantiles(lats),
        "tau_mean": _r(tau.mean()) if len(tau) else None, "tau_median": _r(np.median(tau)) if len(tau) else None,
        "tau_token_weighted": _r(spec_toks / steps) if steps else None,  # = sum(tau_i * steps_i) / sum(steps_i)
        "accept_rate": _r(accepted / proposed) if proposed else None,
        "verify_steps": steps, "accept_histogram": hist.tolist(), "accept_rate_by_position": [_r(x) for x in by_pos],
        "by_source": _by_source(by_source, decided),
        "cost": job_cost([states[tag] for tag in shards if tag in states], comp_toks),
        "answers": answers.summary(),
        "finish_reasons": dict(finish.most_common()),
        "error_kinds": [{"error": k, "count": c, "example": examples[k]} for k, c in errors.most_common(20)],
    }


def _by_source(totals: dict[str, int], decided: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per source: the parts' counts (the truth) and, from the engine's record (``engines.decisions``), whether it
    ran and why not. A source only the record knows (a newer engine's) comes with the record's counts."""
    out = {}
    for src in dict.fromkeys(("dspine", "suffix", "forced", *decided)):
        rec = decided.get(src, {})
        if f"{src}_verify_steps" in totals:
            steps, prop, acc = (totals[f"{src}_{k}"] for k in ("verify_steps", "tokens_proposed", "tokens_accepted"))
        else:
            steps, prop, acc = (int(rec.get(k) or 0) for k in ("rounds", "proposed", "accepted"))
        out[src] = {"verify_steps": steps, "tokens_proposed": prop, "tokens_accepted": acc,
                    "accept_rate": _r(acc / prop) if prop else None,
                    "tau": _r((acc + steps) / steps) if steps else None,  # tokens a step commits, bonus included
                    "ran": bool(steps) or bool(rec.get("ran")), "why": rec.get("why"),
                    "chooser": rec.get("chooser"), "recorded": bool(rec), "record": rec or None}
    return out


def _quantiles(x: np.ndarray) -> dict[str, float] | None:
    if not len(x):
        return None
    return {k: _r(np.quantile(x, q)) for k, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}


def _r(x: float) -> float:
    return round(float(x), 4)


def write_report(outdir: str, summary: dict[str, Any]) -> None:
    if is_url(outdir):  # advisory: a plain overwrite
        ObjectStore(outdir).put("_report.json", json.dumps(summary, indent=2).encode())
        return
    path = os.path.join(outdir, "_report.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(path + ".tmp", path)


def format_report(s: dict[str, Any]) -> str:
    def f(x: Any, fmt: str = "{:.3f}") -> str:
        return "-" if x is None else fmt.format(x)

    lines = [
        f"{s['outdir']}",
        f"  rows        {s['input_rows']:,} input rows, {s['output_rows']:,} outputs ({s['ok']:,} ok, "
        f"{s['errors']:,} errors)",
        f"  tokens      {s['prompt_tokens']:,} prompt, {s['completion_tokens']:,} generated; "
        f"{f(s['tokens_per_s'], '{:,.1f}')} tok/s over {s['elapsed_s']:.1f}s"
        + (f"; first token {s['first_token_s']:.1f}s after start" if s.get("first_token_s") is not None else ""),
        _prefix_cache_line(s),
        f"  tau         tokens committed per verify step: mean {f(s['tau_mean'])} over rows, median "
        f"{f(s['tau_median'])}, token-weighted {f(s['tau_token_weighted'])}; accept rate {f(s['accept_rate'])} of "
        "proposed draft tokens",
        "  finish      outputs by finish reason: "
        + (", ".join(f"{k} {v:,}" for k, v in s["finish_reasons"].items()) or "-"),
    ]
    if s.get("cost") and (s["cost"]["cpu_s"] or s["cost"]["cost"] is not None):  # runs from before say nothing
        lines.append(f"  cost        {cost_line(s['cost'])}")
    lines += format_answers(s.get("answers"))
    lines += _source_lines(s)
    if s["latency_s"]:
        q = s["latency_s"]
        lines.append(f"  latency     seconds per output: p50 {q['p50']:.3f}s, p90 {q['p90']:.3f}s, p99 {q['p99']:.3f}s")
    pos = s["accept_rate_by_position"]
    if pos:
        lines.append(f"  by position share of verify steps that accepted draft tokens 1..j, for j = 1..{len(pos)}: "
                     + " ".join(f"{x:.2f}" for x in pos))
    for e in s["error_kinds"]:  # the kinds (``errors.error_kind``) the run log counted, in rows
        lines.append(f"  error rows  {e['count']:,} x {e['error']}; first: {e['example'][:200]}")
    return "\n".join(lines)


def _source_lines(s: dict[str, Any]) -> list[str]:
    """A line per proposal source (``decisions.source_lines``, the lines the run log ended with): the parts' counts
    (the truth), with the engine's record saying why a source did not run or was stopped. A source these rows never
    used that the engine ran for other rows of the job (a staged job's other stages share its engine) says so.
    Nothing for a run without speculation whose engine said nothing (older runs, engines without ``explain``)."""
    by = s.get("by_source", {})
    if not any(v["verify_steps"] or v.get("recorded") for v in by.values()):
        return []
    record = {}
    for src, v in by.items():
        rec = v.get("record") or {"why": v.get("why"), "chooser": v.get("chooser")}
        entry = {**rec, "rounds": v["verify_steps"], "proposed": v["tokens_proposed"],
                 "accepted": v["tokens_accepted"], "ran": bool(v["verify_steps"])}
        elsewhere = int(rec.get("rounds") or 0)
        if not v["verify_steps"] and elsewhere and not rec.get("why"):
            entry["why"] = (f"chosen for none of these rows; the engine ran it {elsewhere:,} verify steps on the job's "
                            "other rows (another stage's)")
        record[src] = entry
    return ["  " + line for line in source_lines(record)]


def _prefix_cache_line(s: dict[str, Any]) -> str:
    """The hit rate, and over how many outputs when not all of them report it; n/a (not 0%) when none does."""
    pc = s.get("prefix_cache")  # a summary from before schema 3 has none
    if not pc or not pc["rows"]:
        return "  prefix cache n/a (no output reports cached prompt tokens)"
    rate = "-" if pc["hit_rate"] is None else f"{pc['hit_rate']:.3f}"
    some = f" in the {pc['rows']:,} outputs that report it" if pc["rows"] < s["ok"] else ""
    return (f"  prefix cache {pc['cached_prompt_tokens']:,} of {pc['prompt_tokens']:,} prompt tokens served from "
            f"cache (hit rate {rate}){some}")


def plot_report(s: dict[str, Any], path: str) -> None:
    import matplotlib.pyplot as plt

    fig = plot_figure(s)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_figure(s: dict[str, Any]) -> Any:
    """The report's figure: the acceptance histogram (integer ticks on its count axes) and the by-position
    shares, under a title naming the job."""
    from dspine_batch.errors import UsageError

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise UsageError("--plot needs matplotlib (pip install matplotlib)") from e
    from matplotlib.ticker import MaxNLocator

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    fig.suptitle(f"{os.path.basename(s['outdir'].rstrip('/'))}: {s['input_rows']:,} rows, "
                 f"{s['verify_steps']:,} verify steps")
    hist = s["accept_histogram"]
    a.xaxis.set_major_locator(MaxNLocator(integer=True))  # counts: no 2.5 on either axis
    a.yaxis.set_major_locator(MaxNLocator(integer=True))
    a.bar([j + 1 for j in range(len(hist))], hist)
    a.set_xlabel("tokens committed per verify step (accepted drafts + 1)")
    a.set_ylabel("verify steps")
    a.set_title(f"tokens per verify step (mean tau {s['tau_mean'] or 0:.2f})")
    pos = s["accept_rate_by_position"]
    b.plot(range(1, len(pos) + 1), pos, marker="o")
    b.set_xticks(range(1, len(pos) + 1))
    b.set_ylim(0, 1)
    b.set_xlabel("draft position")
    b.set_ylabel("share of verify steps")
    b.set_title("draft tokens 1..j all accepted")
    fig.tight_layout()
    return fig
