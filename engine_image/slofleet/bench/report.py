"""`slofleet bench`'s figures: per bucket and overall, TTFT/TPOT/ITL/E2E statistics under the names `vllm bench
serve` writes (mean_ttft_ms, median_ttft_ms, std_ttft_ms, p99_ttft_ms, ..., request_throughput, output_throughput,
completed, duration), and against each bucket's SLO: attainment (the share of its requests within every target;
a failed request misses), goodput (such requests per second) and attainment over time; a table and a PNG."""
from __future__ import annotations

import numpy as np

from .loadgen import Result
from .workload import Target

METRICS = ("ttft", "tpot", "itl", "e2el")  # vllm's names; e2el is the end-to-end latency


def good(r: Result, t: Target | None) -> bool:
    if t is None or r.status != 200 or r.ttft is None:
        return False
    return ((t.ttft is None or r.ttft <= t.ttft) and (t.tpot is None or r.tokens < 2 or r.tpot <= t.tpot)
            and (t.e2e is None or r.e2e <= t.e2e))


def latencies(results: list[Result], metric: str) -> list[float]:
    ok = [r for r in results if r.status == 200 and r.ttft is not None]
    if metric == "itl":
        return [x for r in ok for x in r.itls]
    if metric == "tpot":
        return [r.tpot for r in ok if r.tokens > 1]
    return [r.ttft if metric == "ttft" else r.e2e for r in ok]


def stats(results: list[Result], duration: float, percentiles: list[float], target: Target | None) -> dict:
    ok = [r for r in results if r.status == 200 and r.ttft is not None]
    out_tokens, in_tokens = sum(r.tokens for r in ok), sum(r.prompt_tokens for r in ok)
    row: dict = {"completed": len(ok), "failed": len(results) - len(ok), "total_input_tokens": in_tokens,
                 "total_output_tokens": out_tokens, "request_throughput": len(ok) / duration,
                 "output_throughput": out_tokens / duration,
                 "total_token_throughput": (in_tokens + out_tokens) / duration}
    for m in METRICS:
        xs = np.array(latencies(results, m)) * 1000
        row |= {f"mean_{m}_ms": float(xs.mean()) if xs.size else None,
                f"median_{m}_ms": float(np.median(xs)) if xs.size else None,
                f"std_{m}_ms": float(xs.std()) if xs.size else None}
        row |= {f"p{p:g}_{m}_ms": float(np.percentile(xs, p)) if xs.size else None for p in percentiles}
    if target is not None:
        n_good = sum(good(r, target) for r in results)
        attainment = n_good / len(results) if results else None
        row |= {"slo": {"percentile": target.percentile, "ttft_ms": _ms(target.ttft), "tpot_ms": _ms(target.tpot),
                        "e2e_ms": _ms(target.e2e)},
                "attainment": attainment, "met": None if attainment is None else attainment >= target.percentile / 100,
                "request_goodput": n_good / duration}
    return row


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000


def over_time(results: list[Result], target: Target, span: float, windows: int = 20) -> list[list[float | None]]:
    """[window end (s), attainment of the requests sent in it (None without any)] over `windows` equal windows of
    the time requests were sent in."""
    edges = np.linspace(0, max(span, 1e-9), windows + 1)
    out = []
    for lo, hi in zip(edges, edges[1:]):
        rs = [r for r in results if lo <= r.start < hi or (hi == edges[-1] and r.start >= hi)]
        out.append([float(hi), sum(good(r, target) for r in rs) / len(rs) if rs else None])
    return out


def summary(results: list[Result], duration: float, percentiles: list[float], targets: dict[str, Target],
            meta: dict) -> dict:
    """One object: the run's own fields, the overall figures (attainment over every bucket with an SLO), and
    `buckets`, one entry per bucket with the same figures plus its SLO's."""
    names, span = sorted({r.bucket for r in results}), max((r.start for r in results), default=0.0)
    buckets = {}
    for b in names:
        rs = [r for r in results if r.bucket == b]
        buckets[b] = stats(rs, duration, percentiles, targets.get(b))
        if b in targets:
            buckets[b]["attainment_over_time"] = over_time(rs, targets[b], span)
    out = meta | {"duration": duration, "num_prompts": len(results)} | stats(results, duration, percentiles, None)
    judged = [r for r in results if r.bucket in targets]
    n_good = sum(good(r, targets[r.bucket]) for r in judged)
    return out | {"attainment": n_good / len(judged) if judged else None,
                  "request_goodput": n_good / duration if judged else None, "buckets": buckets}


def table(s: dict, percentiles: list[float]) -> str:
    ps = "/".join(f"p{p:g}" for p in percentiles)
    lines = [f"slofleet bench: {s['num_prompts']} requests to {s['url']} ({s['model']}, {s['endpoint']}), "
             f"{s['workload']}, {s['duration']:.1f} s",
             f"{'bucket':14s} {'done':>5s} {'fail':>5s}  {'TTFT ' + ps + ' ms':>22s}  {'TPOT ' + ps + ' ms':>22s}  "
             f"{'E2E ' + ps + ' ms':>24s}  {'attain':>7s} {'goodput':>8s}"]

    def cell(row: dict, m: str) -> str:
        return "/".join("-" if row[f"p{p:g}_{m}_ms"] is None else f"{row[f'p{p:g}_{m}_ms']:.0f}" for p in percentiles)

    for name, row in [*s["buckets"].items(), ("all", s)]:
        att = "-" if row.get("attainment") is None else f"{row['attainment']:.1%}"
        gp = "-" if row.get("request_goodput") is None else f"{row['request_goodput']:.2f}/s"
        lines.append(f"{name:14s} {row['completed']:5d} {row['failed']:5d}  {cell(row, 'ttft'):>22s}  "
                     f"{cell(row, 'tpot'):>22s}  {cell(row, 'e2el'):>24s}  {att:>7s} {gp:>8s}")
    lines.append(f"request throughput {s['request_throughput']:.2f} req/s, output {s['output_throughput']:.1f} tok/s, "
                 f"total {s['total_token_throughput']:.1f} tok/s")
    for name, row in s["buckets"].items():
        if row.get("slo"):
            slo = ", ".join(f"{k[:-3].upper()} <= {v:g} ms" for k, v in row["slo"].items() if k != "percentile" and v)
            verdict = "met" if row["met"] else "missed"
            lines.append(f"SLO {name}: p{row['slo']['percentile']:g} {slo}: {verdict}")
    lines += [f"error: {e}" for e in s.get("errors", [])[:3]]
    return "\n".join(lines)


def plot(results: list[Result], s: dict, path: str) -> None:
    """Latency CDFs per bucket (TTFT, TPOT, E2E; dashed: the targets) and attainment over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for i, name in enumerate(s["buckets"]):
        color, rs, row = f"C{i}", [r for r in results if r.bucket == name], s["buckets"][name]
        for ax, m, key in zip(axes, ("ttft", "tpot", "e2el"), ("ttft_ms", "tpot_ms", "e2e_ms")):
            xs = np.sort(np.array(latencies(rs, m)) * 1000)
            if xs.size:
                ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", color=color, label=name)
            if (row.get("slo") or {}).get(key):
                ax.axvline(row["slo"][key], color=color, ls="--", lw=0.8)
        points = [(x, y) for x, y in row.get("attainment_over_time", []) if y is not None]
        if points:
            axes[3].plot(*zip(*points), marker="o", color=color, label=name)
            axes[3].axhline(row["slo"]["percentile"] / 100, color=color, ls="--", lw=0.8)
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)", "E2E (ms)")):
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # the 2x10^3, 3x10^3... labels overlap
            ax.legend(fontsize=8)
    axes[3].set(title="SLO attainment over time (dashed: target)", xlabel="s since start", ylim=(0, 1.05))
    axes[3].grid(alpha=0.3)
    if axes[3].has_data():
        axes[3].legend(fontsize=8)
    fig.suptitle(f"slofleet bench: {s['workload']} against {s['url']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
