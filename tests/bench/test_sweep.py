"""`slofleet bench --sweep`: the arithmetic (a refusal is not a failure but is not within SLO either; goodput is the
offered rate times the share within SLO; the knee is the highest rate with >= 95% within SLO), and a short sweep
against a stand-in OpenAI server that refuses past a concurrency limit: fresh prompts at every rate, refusals
counted as such, a table, a plot and the JSON."""
from __future__ import annotations

import argparse
import asyncio
import json
import math

import pytest

from slofleet.bench import cli, sweep
from slofleet.bench.loadgen import Result
from slofleet.bench.workload import Target
from tests.support import refused
from tests.support.server import serve_in_thread

SLO = {"chat": Target(95.0, ttft=0.5, tpot=0.05), "doc": Target(95.0, ttft=1.5)}


def ok(bucket: str, ttft: float, tpot: float = 0.01) -> Result:
    return Result(bucket, 200, ttft=ttft, tpot=tpot, tokens=8, e2e=ttft + 7 * tpot)


def test_refusals_count_as_offered_and_missed_not_failed():
    results = [ok("chat", 0.1), ok("chat", 0.9), ok("chat", 0.1, tpot=0.2), Result("chat", 429),
               Result("chat", 0), Result("chat", 200, error="no tokens"), ok("doc", 1.0), Result("doc", 429)]
    p = sweep.point(4.0, 7, results, SLO)
    chat, doc, total = p.buckets["chat"], p.buckets["doc"], p.total
    assert (chat.offered, chat.admitted, chat.refused, chat.failed, chat.within) == (6, 5, 1, 2, 1)
    assert (doc.offered, doc.admitted, doc.refused, doc.failed, doc.within) == (2, 1, 1, 0, 1)
    assert (total.offered, total.refused, total.failed, total.within) == (8, 2, 2, 2)
    assert p.goodput() == pytest.approx(4.0 * 2 / 8) and p.goodput("chat") == pytest.approx(4.0 * 1 / 8)
    assert p.goodput("chat") + p.goodput("doc") == pytest.approx(p.goodput())
    assert sweep.point(1.0, 0, [ok("batch", 0.1)], SLO).total.within == 0  # a bucket without an SLO never counts


def at(rate: float, within: int, refused_: int, offered: int = 100) -> sweep.RatePoint:
    return sweep.RatePoint(rate=rate, seed=0, buckets={"chat": sweep.Tally(offered=offered, refused=refused_,
                                                                            within=within)})


def test_the_knee_is_the_highest_rate_with_95_percent_of_offered_within_slo():
    points = [at(1, 100, 0), at(2, 96, 0), at(4, 95, 5), at(8, 94, 6), at(16, 50, 50)]
    assert sweep.knee(points) == 4  # 95 of 100 offered; 8 req/s misses by one
    assert sweep.knee([at(1, 94, 0), at(2, 10, 90)]) is None
    assert sweep.knee([at(1, 100, 0), at(2, 80, 0), at(4, 99, 0)]) == 4  # the highest, even past a dip
    # refusing everything never passes: nothing is within SLO
    assert sweep.knee([at(8, 0, 100)]) is None and at(8, 0, 100).goodput() == 0
    table = sweep.table(points)
    assert "knee: 4 req/s" in table and len(table.splitlines()) == len(points) + 2
    js = sweep.as_json(points)
    assert js["knee"] == 4 and js["rates"][3]["refused"] == 6 and js["rates"][3]["goodput"] == pytest.approx(8 * 0.94)


@pytest.mark.parametrize(("rates", "says"), [("", "positive"), ("1,x", "comma-separated"), ("0,1", "positive"),
                                              ("1,inf", "finite"), ("2,2", "twice"), ("nan", "positive")])
def test_bad_rates_are_refused_with_one_line(rates, says, capsys):
    refused(cli, ["--sweep", rates, "--model", "m"], says, capsys)


class Limited:
    """A stand-in OpenAI server: streams four chunks over STREAM_S, and answers 429 while LIMIT streams are open;
    records every prompt it was sent."""
    LIMIT, STREAM_S = 4, 0.1

    def __init__(self):
        self.open, self.prompts = 0, []
        self.server, self.thread, self.url = serve_in_thread(self.app)

    async def app(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        raw, more = b"", True
        while more:
            msg = await receive()
            raw, more = raw + msg.get("body", b""), msg.get("more_body", False)
        self.prompts.append(json.loads(raw)["messages"][0]["content"])
        if self.open >= self.LIMIT:
            await send({"type": "http.response.start", "status": 429, "headers": [(b"retry-after", b"1")]})
            return await send({"type": "http.response.body", "body": b'{"error": {"message": "busy"}}'})
        self.open += 1
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for _ in range(4):
                chunk = {"choices": [{"delta": {"content": "x"}}]}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                            "more_body": True})
                await asyncio.sleep(self.STREAM_S / 4)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            self.open -= 1


@pytest.fixture
def limited():
    s = Limited()
    yield s
    s.server.should_exit = True
    s.thread.join(5)


def test_a_sweep_counts_refusals_finds_the_knee_and_sends_fresh_prompts(limited, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    png = tmp_path / "curve.png"
    args = parser.parse_args(["--url", limited.url, "--model", "m", "--sweep", "80,4", "--num-prompts", "40",
                              "--json", "--png", str(png), "--seed", "5"])
    assert cli.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    low, high = out["rates"]  # in rising order whatever the order given
    assert (low["rate"], low["seed"], high["rate"], high["seed"]) == (4, 5, 80, 6)
    assert low["offered"] == high["offered"] == 40 and low["failed"] == high["failed"] == 0
    assert low["refused"] <= 2 and high["refused"] > 10  # four streams at a time: 80 req/s overflows them
    assert high["admitted"] + high["refused"] == 40 and high["within_slo"] <= high["admitted"]
    assert high["attainment"] < 0.95 <= low["attainment"] and out["knee"] == 4
    assert high["goodput"] == pytest.approx(80 * high["within_slo"] / 40)
    assert math.isclose(sum(b["goodput"] for b in high["buckets"].values()), high["goodput"])
    first, second = limited.prompts[:40], limited.prompts[40:]  # rates run in rising order
    assert not set(first) & set(second)
    heads = {" ".join(p.split()[:120]) for p in limited.prompts if len(p.split()) > 400}
    assert len(heads) == 2  # documents share a head within a rate, never across rates
    assert "knee: 4 req/s" in (tmp_path / "curve.txt").read_text()
    assert png.stat().st_size > 10_000 or "matplotlib is not installed" in capsys.readouterr().err
