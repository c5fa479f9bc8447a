"""`slofleet trace URL REQUEST_ID [--png FILE]`: one request's trace as a waterfall, in the terminal and as a PNG.

URL is a router (its answer merges in the spans of the engines that served the request) or an engine; REQUEST_ID is
the x-request-id of the answer (or a trace id). Spans of several machines are placed by their own clocks."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import urllib.parse

from slofleet.api.contract import INTERNAL_TOKEN_ENV

HIDDEN = ("slofleet.request_id", "http.request.method", "url.path")  # in the header line or the span's name
COLOURS = {"router": "#4C72B0", "prefill": "#DD8452", "decode": "#55A868", "unified": "#8172B3"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="a router or an engine, e.g. http://127.0.0.1:8080")
    parser.add_argument("request_id", metavar="REQUEST_ID", help="the x-request-id of the answer (or a trace id)")
    parser.add_argument("--png", metavar="FILE", help="also draw the waterfall into this PNG file")
    token = os.environ.get("SLOFLEET_API_KEY") or os.environ.get(INTERNAL_TOKEN_ENV, "")
    parser.add_argument("--api-key", default=token,
                        help="sent as a bearer token: a router's API key, or an engine's --api-key or internal token "
                             f"(default: $SLOFLEET_API_KEY, else ${INTERNAL_TOKEN_ENV})")
    parser.add_argument("--width", type=int, default=0, help="bar width in characters (default: fit the terminal)")


def fetch(url: str, key: str, api_key: str) -> dict:
    import httpx

    r = httpx.get(f"{url.rstrip('/')}/debug/traces/{urllib.parse.quote(key, safe='')}", timeout=15,
                  headers={"authorization": f"Bearer {api_key}"} if api_key else None)
    if r.status_code != 200:
        raise LookupError(f"{url} answered {r.status_code}: {r.text[:300]}")
    return r.json()


def ordered(spans: list[dict]) -> list[tuple[int, dict]]:
    """(depth, span) in tree order, children by start time; a span whose parent is not here (a client's) is a root."""
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[dict]] = {}
    for s in sorted(spans, key=lambda s: (s["start_ns"], -s["end_ns"])):
        children.setdefault(s["parent_id"] if s["parent_id"] in ids else None, []).append(s)
    out: list[tuple[int, dict]] = []

    def walk(parent: str | None, depth: int) -> None:
        for s in children.get(parent, []):
            out.append((depth, s))
            walk(s["span_id"], depth + 1)

    walk(None, 0)
    return out


def where(span: dict) -> str:
    return span.get("role") or (span.get("service") or "?").removeprefix("slofleet-")


def details(span: dict) -> str:
    attrs = {k.removeprefix("slofleet.").removeprefix("http.response."): v
             for k, v in span["attributes"].items() if k not in HIDDEN}
    return " ".join(f"{k}={v}" for k, v in attrs.items())


def render(doc: dict, width: int) -> str:
    rows = ordered(doc["spans"])
    t0 = min(s["start_ns"] for s in doc["spans"])
    total = max(max(s["end_ns"] for s in doc["spans"]) - t0, 1)
    rids = sorted({s["attributes"].get("slofleet.request_id") for s in doc["spans"]} - {None})
    lines = [f"trace {doc['trace_id']}  request {', '.join(rids) or '?'}  {total / 1e6:.1f} ms  {len(rows)} spans",
             f"{'start ms':>9} {'dur ms':>9}  {'where':<8} {'span':<32} |{'':<{width}}|"]
    for depth, s in rows:
        a = int((s["start_ns"] - t0) / total * width)
        b = max(a + 1, round((s["end_ns"] - t0) / total * width))
        bar = (" " * a + "█" * (b - a)).ljust(width)[:width]
        name = ("  " * depth + s["name"])[:32]
        lines.append(f"{(s['start_ns'] - t0) / 1e6:9.1f} {(s['end_ns'] - s['start_ns']) / 1e6:9.1f}  "
                     f"{where(s):<8} {name:<32} |{bar}| {details(s)}".rstrip())
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ordered(doc["spans"])
    t0 = min(s["start_ns"] for s in doc["spans"])
    fig, ax = plt.subplots(figsize=(12, 0.32 * len(rows) + 1.4))
    for y, (_, s) in enumerate(rows):
        left, dur = (s["start_ns"] - t0) / 1e6, (s["end_ns"] - s["start_ns"]) / 1e6
        ax.barh(y, max(dur, 1e-3), left=left, color=COLOURS.get(where(s), "#937860"))
        ax.text(left + dur, y, f" {dur:.1f} ms", va="center", fontsize=7)
    labels = [f"{where(s):<8}{'  ' * d}{s['name']}" for d, s in rows]
    width = max(map(len, labels))  # equal lengths: the right-aligned monospace labels keep their indentation
    ax.set_yticks(range(len(rows)), [label.ljust(width) for label in labels], fontsize=8, family="monospace")
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first span started")
    ax.set_title(f"trace {doc['trace_id']}", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import httpx

    try:
        doc = fetch(args.url, args.request_id, args.api_key)
    except (LookupError, httpx.HTTPError, ValueError) as e:
        print(f"slofleet trace: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    width = args.width or max(20, shutil.get_terminal_size((140, 24)).columns - 68)
    print(render(doc, width))
    if args.png:
        plot(doc, args.png)
        print(f"wrote {args.png}")
    return 0
