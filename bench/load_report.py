"""A load run's results.json -> report.md, and the summary table printed at the end of a run."""

from __future__ import annotations

import json
from pathlib import Path

PHASES = (
    ("end_to_end", "end to end"),
    ("queue_wait", "queue wait (submit → process starts)"),
    ("service", "service (process starts → completed)"),
    ("compute", "compute (backends' own translate time)"),
    ("service_minus_compute", "service − compute"),
    ("busy_answer", "busy rejection, time to answer"),
)


def _f(x, digits: int = 0) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def counts_line(r: dict) -> str:
    c = r["counts"]
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(c["error_kinds"].items())) or "none"
    line = (f"{c['requests']} requests: {c['ok']} ok, {c['busy']} busy ({_pct(r['rates']['busy_rate'])}), "
            f"{c['error']} errors ({_pct(r['rates']['error_rate'])}; {kinds})")
    if c["not_sent"]:
        line += f", {c['not_sent']} not sent (deadline)"
    if c["unfinished_users"]:
        line += f", {len(c['unfinished_users'])} users still waiting at the end"
    return line


def latency_rows(r: dict) -> list[list[str]]:
    rows = []
    for key, label in PHASES:
        s = r["latency_ms"].get(key)
        if s:
            rows.append([label, str(s["n"]), _f(s["p50"]), _f(s["p95"]), _f(s["p99"]), _f(s["mean"]), _f(s["max"])])
    return rows


LATENCY_HEADERS = ["ms", "n", "p50", "p95", "p99", "mean", "max"]


def _read(sample: dict) -> bool:
    """Whether a sample read the app's memory (or says why it could not)."""
    return "rss_mb" in sample or "memory_error" in sample


def memory_lines(r: dict) -> list[str]:
    m = r["memory"]
    if not any(_read(s) for s in m["samples"]):  # without a pid the samples hold the tallies alone
        return ["Not sampled: give `--pid PID` with `--url`, or use `--launch`."]
    lines = ["| requests finished | ok | busy | errors | app RSS MB | processes | app CPU s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for s in m["samples"]:
        rss = s.get("rss_mb", s.get("memory_error"))
        lines.append(f"| {s['finished']}{' (' + s['after'] + ')' if 'after' in s else ''} | {s.get('ok', '–')} | "
                     f"{s.get('busy', '–')} | {s.get('error', '–')} | {rss} | {s.get('processes', '–')} | "
                     f"{s.get('cpu_s', '–')} |")
    ch = m["change"]
    if ch:
        lines.append("")
        lines.append(f"RSS after {ch['to_finished']} requests: {ch['to_mb']:,.1f} MB against {ch['from_mb']:,.1f} MB "
                     f"after {ch['from_finished']}: {ch['change_mb']:+,.1f} MB ({ch['change_pct']:+.2f}%).")
    return lines


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|---" + "|---:" * (len(headers) - 1) + "|"]
    return out + ["| " + " | ".join(row) + " |" for row in rows]


def render(r: dict) -> str:
    o, e, cpu = r["options"], r["environment"], r["cpu_s"]
    target = f"`{r['url']}`"
    if r.get("launched"):
        la = r["launched"]
        target = (f"`python {' '.join(la['command'])}`, started by the benchmark (serving after {la['ready_s']} s; "
                  f"stopped by {la['stop']['signal']}, exit code {la['stop']['returncode']})")
    versions = ", ".join(f"{k} {v}" for k, v in e["versions"].items())
    lines = [
        f"# Load: the `{r.get('target', 'compare')}` endpoint under concurrent users",
        "",
        f"- App: {target}",
        f"- {o['users']} users, one request in flight each, {o['requests']} requests; per-request timeout "
        f"{o['timeout_s']:g} s, deadline {o['deadline_s']:g} s, back-off after busy {o['busy_backoff_s']:g} s, "
        f"think time {o['think_s']:g} s, repeat {o['repeat']}, {o['warmup']} warm-up requests not counted",
        f"- Sentences: {r['sentences']['distinct']} distinct from `{r['sentences']['tsv']}` (seed "
        f"{r['sentences']['seed']}), {r['sentences']['drawn']}",
        f"- Date: {e['date_utc']}; git {e.get('git') or 'unknown'}",
        f"- CPU: {e['cpu']}, {e['logical_cores']} logical / {e.get('physical_cores')} physical cores; load average "
        f"{e['load_average_1m_at_start']} at start, {e['load_average_1m_at_end']} at end",
        f"- CPU time during the run ({cpu['run_s']} s): app {_f(cpu['app'], 1)} s, load generator "
        f"{_f(cpu['load_generator'], 1)} s (the rest of the machine's cores went to whatever else ran)",
        f"- Python {e['python']}; {versions}",
        "",
        "## Outcomes",
        "",
        counts_line(r) + f"; {_f(r['throughput_ok_per_s'], 2)} ok requests/s over {r['run_s']} s.",
        "",
    ]
    if r["busy_messages"]:
        lines += ["Busy answers: " + "; ".join(f"`{m}`" for m in r["busy_messages"]), ""]
    if r["error_examples"]:
        lines += ["Errors (first 10):", ""]
        lines += [f"- request {x['index']} (user {x['user']}): {x['kind']}: {x['message']}"
                  for x in r["error_examples"]]
        lines.append("")
    lines += ["## Latency of ok requests", ""] + _table(LATENCY_HEADERS, latency_rows(r))
    rank = r.get("queue_rank_on_join")
    if rank:
        lines += ["", f"Queue position announced on joining (0 = next to run): median {_f(rank['p50'])}, "
                  f"max {_f(rank['max'])}."]
    tokens = r.get("output_tokens")
    if tokens:
        capped = ", ".join(f"{name} {n}" for name, n in r["capped"].items()) or "none"
        lines += ["", f"Longest output per request (tokens): median {_f(tokens['p50'])}, p99 {_f(tokens['p99'])}, "
                  f"max {_f(tokens['max'])}; requests where a backend stopped at the length cap: {capped}."]
    lines += translate_lines(r)
    lines += ["", "## App memory", ""] + memory_lines(r)
    lines += ["", "## What is timed", "", r["what_is_timed"], "", "Not measured: " + r["not_measured"] + ".", ""]
    return "\n".join(lines)


def translate_lines(r: dict) -> list[str]:
    """What the translate endpoint's batching did, and the offline baselines when measured."""
    together, bases = r.get("decoded_together"), r.get("baseline") or []
    out = []
    if o := r.get("open_loop"):
        late = o["late_ms"]
        out += ["", f"Open loop: {o['arrivals']} arrivals at {_f(o['rate_per_s'], 1)} requests/s on {o['connections']} "
                f"connections; offered {_f(o['offered_per_s'], 1)}/s, answered {_f(r['throughput_ok_per_s'], 1)}/s; "
                f"{o['sent_late']} requests sent late (every connection busy; latency counts from the scheduled "
                f"arrival){'' if not late else ', P99 lateness ' + _f(late['p99'], 0) + ' ms'}."]
    if together:
        served = r["served"]
        out += ["", f"Requests decoded together (the server's batches: the app's batcher or Ray Serve's, per ok request): median {_f(together['p50'])}, "
                f"mean {_f(together['mean'], 1)}, max {_f(together['max'])}; backend {', '.join(served['backends'])}."]
    sizes = r.get("batch_sizes")
    if sizes:
        out += ["", "Batch sizes (size: ok requests decoded in a batch of that size): "
                + ", ".join(f"{k}: {v}" for k, v in sizes.items())
                + f"; the decoder was busy {_pct(r.get('decoder_busy_share'))} of the run."]
    for base in bases:
        out += ["", f"Offline, the same backend ({base['backend']}) at batch {base['batch_size']} with the same "
                f"decoding (num_beams {base['num_beams']}, max_new_tokens {base['max_new_tokens']}) on the run's "
                f"{base['sentences']} sentences: {_f(base['sentences_per_s'], 1)} sentences/s (median of "
                f"{len(base['rounds_s'])} rounds); under load {_f(r['throughput_ok_per_s'], 1)} sentences/s, "
                f"**{_f(base['load_over_offline'], 2)}×** the offline rate (measured after the app stopped, in the "
                "load generator's process)."]
    return out


def summary_table(r: dict) -> str:
    """The console summary: outcomes, the latency table, the memory change."""
    rows = [LATENCY_HEADERS] + latency_rows(r)
    widths = [max(len(row[i]) for row in rows) for i in range(len(LATENCY_HEADERS))]
    text = [counts_line(r)]
    for row in rows:  # the label column left-aligned, the numbers right-aligned
        text.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    text += [line for line in translate_lines(r) if line]
    ch = r["memory"]["change"]
    if ch:
        text.append(f"app RSS {ch['from_mb']:,.1f} MB after {ch['from_finished']} requests -> {ch['to_mb']:,.1f} MB "
                    f"after {ch['to_finished']} ({ch['change_pct']:+.2f}%)")
    elif read := [s for s in r["memory"]["samples"] if _read(s)]:
        s = read[-1]
        text.append(f"app RSS {s.get('rss_mb', s.get('memory_error'))} MB after {s['finished']} requests")
    return "\n".join(text)


def write(results: dict, out_dir: Path) -> dict[str, Path]:
    """results.json and report.md into `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "report.md"}
    paths["json"].write_text(json.dumps(results, ensure_ascii=False, indent=1), encoding="utf-8")
    paths["markdown"].write_text(render(results), encoding="utf-8")
    return paths
