"""SLO-aware admission against none through the router, to a queueing stand-in whose knee is known (the CI test's,
tests/router/test_admission.py): goodput at 0.5x, 1x, 3x and 6x the knee, per admission mode.

    .venv/bin/python benchmarks/admission_standin.py slo-predicted off
"""
from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.router.test_admission import BUCKETS, HI_TOKENS, LO_TOKENS, PREFILL_TPS, QueueEngine, drive  # noqa: E402
from tests.support.router import RouterProc  # noqa: E402

TARGET = {"hi": 0.4, "lo": 1.2}  # the buckets' TTFT targets, s


def sweep(mode: str, seconds: float = 6.0) -> None:
    engine, logs = QueueEngine(), Path(tempfile.mkdtemp(prefix="admission-standin-"))
    (logs / "b.json").write_text(json.dumps({"buckets": [b | {"admission": {"mode": mode}} for b in BUCKETS[:2]]}))
    router = RouterProc("--upstream", engine.url, "--buckets", str(logs / "b.json"), log=logs / "router.log")
    knee = PREFILL_TPS / ((HI_TOKENS + LO_TOKENS) / 2)
    try:
        router.wait_ready()
        asyncio.run(drive(router.url, knee / 2, 2.0))  # the router learns the replica's rates
        for times in (0.5, 1, 3, 6):
            out = asyncio.run(drive(router.url, times * knee, seconds))
            ok = [o for o in out if o.status == 200 and o.complete and o.seconds <= TARGET[o.bucket]]
            refused = sorted(o.seconds * 1000 for o in out if o.status == 429)
            hi = [o for o in out if o.bucket == "hi" and o.status == 200]
            print(f"{mode} {times:g}x knee ({times * knee:g} req/s): offered {len(out)} refused {len(refused)} "
                  f"within {len(ok) / len(out):.0%} goodput {times * knee * len(ok) / len(out):.2f} req/s, "
                  f"priority 0 admitted within {sum(o.seconds <= TARGET['hi'] for o in hi) / max(1, len(hi)):.0%}, "
                  f"refusal p99 {refused[int(0.99 * (len(refused) - 1))] if refused else 0:.0f} ms", flush=True)
            time.sleep(3)
    finally:
        router.stop()
        engine.stop()


if __name__ == "__main__":
    for m in sys.argv[1:] or ["slo-predicted", "off"]:
        sweep(m)
