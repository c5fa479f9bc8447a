"""A real Prometheus and its promtool (Debian's `prometheus` package, installed by `make prometheus`), and the unit
tests for promtool that the chart's SLO burn rules are checked with."""
from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

INSTALL_HINT = "promtool/prometheus not found: run `make prometheus` (Debian's prometheus package)"
WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, INSTALL_HINT
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True, kw_only=True)
class Clock:
    """One SLO target of one bucket as the rendered rules read it."""
    bucket: str
    clock: str
    metric: str  # the histogram, without _bucket/_count
    le: str
    budget: float  # the share of requests the bucket's percentile lets miss


def clocks(groups: list[dict]) -> list[Clock]:
    """Every (bucket, clock) that the rules record, read back from their expressions."""
    found: dict[tuple[str, str], Clock] = {}
    for g in groups:
        budget = None
        for r in g["rules"]:
            m = re.search(r"\(1 - ([\d.]+) / 100\)", r.get("expr", "")) if "alert" in r else None
            budget = 1 - float(m.group(1)) / 100 if m else budget
        for r in g["rules"]:
            if "record" not in r:
                continue
            m = re.search(r"rate\(([\w:]+)_bucket\{bucket=\"([^\"]+)\", le=\"([^\"]+)\"", r["expr"])
            key = (m.group(2), r["labels"]["clock"])
            found[key] = Clock(bucket=key[0], clock=key[1], metric=m.group(1), le=m.group(3), budget=budget)
    return list(found.values())


def series(c: Clock, bad: float, minutes: int, labels: dict[str, str]) -> list[dict]:
    """A histogram's _count and its target bound's _bucket growing linearly, `bad` of the requests over the
    target: 1,000 requests a minute."""
    sel = ", ".join(f'{k}="{v}"' for k, v in {**labels, "bucket": c.bucket}.items())
    good = round(1000 * (1 - bad))
    return [{"series": f'{c.metric}_count{{{sel}}}', "values": f"0+1000x{minutes}"},
            {"series": f'{c.metric}_bucket{{{sel}, le="{c.le}"}}', "values": f"0+{good}x{minutes}"}]


def expanded(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"{{ \$labels\.(\w+) }}", lambda m: labels[m.group(1)], template)


def expected(groups: list[dict], c: Clock, severities: list[str], labels: dict[str, str]) -> list[dict]:
    """The alerts promtool must see: one per severity, with the rule's annotations filled in."""
    out = []
    for g in groups:
        for r in g["rules"]:
            if "alert" in r and f'bucket="{c.bucket}"' in r["expr"] and r["labels"]["severity"] in severities:
                lab = {**labels, "bucket": c.bucket, "clock": c.clock, "severity": r["labels"]["severity"]}
                out.append({"exp_labels": lab,
                            "exp_annotations": {k: expanded(v, lab) for k, v in r["annotations"].items()}})
    return out


@dataclass(slots=True, kw_only=True)
class Scenario:
    """A share of bad requests on one clock, and the severities that must fire for it (none: silent)."""
    name: str
    bad: float
    fires: list[str]


def scenarios(budget: float) -> list[Scenario]:
    """Every clock at 100% bad pages (and tickets); 4.5x the budget tickets only, where that is a share (a page
    needs 6x over 6h and 30m); half the budget stays silent."""
    out = [Scenario(name="page", bad=1.0, fires=["page", "ticket"]),
           Scenario(name="healthy", bad=0.5 * budget, fires=[])]
    if 4.5 * budget < 1:
        out.append(Scenario(name="ticket", bad=4.5 * budget, fires=["ticket"]))
    return out


def unit_tests(rule_file: str, groups: list[dict], labels: dict[str, str], minutes: int = 300) -> dict:
    """promtool's test file: for each bucket and clock and scenario, that clock's series at the scenario's share
    of bad requests and every other clock healthy; the alerts expected at 150 minutes."""
    all_clocks = clocks(groups)
    tests = []
    for c in all_clocks:
        for s in scenarios(c.budget):
            inputs = [x for o in all_clocks for x in series(o, s.bad if o is c else 0.0, minutes, labels)]
            tests.append({"interval": "1m", "input_series": inputs, "alert_rule_test": [
                {"eval_time": "150m", "alertname": "SlofleetSLOBudgetBurn",
                 "exp_alerts": expected(groups, c, s.fires, labels)}],
                "name": f"{c.bucket} {c.clock} {s.name}"})
    return {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests}


def write_rules(groups: list[dict], folder: Path) -> tuple[Path, Path]:
    """The PrometheusRule's groups as a plain rule file, and promtool's unit tests for it."""
    rules = folder / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    test = folder / "rules_test.yaml"
    test.write_text(yaml.safe_dump(unit_tests(rules.name, groups, {"namespace": "default", "service": "chat"}),
                                   sort_keys=False))
    return rules, test


class Prometheus:
    """A Prometheus server on loopback scraping the given targets every second, with the given rule file."""

    def __init__(self, folder: Path, jobs: dict[str, list[tuple[str, dict[str, str]]]], rules: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": job, "static_configs": [
                      {"targets": [t.split("//", 1)[-1]], "labels": lab} for t, lab in targets]}
                      for job, targets in jobs.items()]}
        if rules:
            config["rule_files"] = [str(rules)]
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(folder / "prometheus.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={folder / 'prometheus.yml'}", f"--storage.tsdb.path={folder / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60) -> Prometheus:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "prometheus exited; see prometheus.log"
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError("prometheus not ready")

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        params = {"query": expr} | ({"time": at} if at else {})
        body = httpx.get(self.url + "/api/v1/query", params=params, timeout=30).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
        params = {"query": expr, "start": start, "end": end, "step": step}
        body = httpx.get(self.url + "/api/v1/query_range", params=params, timeout=30).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def targets_up(self) -> int:
        return sum(float(r["value"][1]) == 1 for r in self.query("up"))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()
