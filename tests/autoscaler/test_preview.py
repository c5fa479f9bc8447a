"""`slofleet simulate --llmservice`: a spec's prediction from its own buckets and bounds, and a proposed change beside
it."""
import argparse

import numpy as np
import pytest
import yaml

from slofleet.autoscaler import preview, simulate_cli, traces
from tests.support import ROOT

EXAMPLE = ROOT / "manifests" / "examples" / "llmservice-unified.yaml"


def spec(path, chat_slo: dict, autoscaling: bool = True, max_replicas: int = 16) -> str:
    doc = {"apiVersion": "slofleet.dev/v1alpha1", "kind": "LLMService", "metadata": {"name": "chat"},
           "spec": {"model": {"name": "m", "source": "embedded"}, "autoscaling": {"enabled": autoscaling},
                    "topology": {"unified": {"minReplicas": 1, "maxReplicas": max_replicas, "replicas": 2}},
                    "buckets": [{"name": "chat", "match": {"maxPromptTokens": 1024}, "slo": chat_slo},
                                {"name": "doc", "slo": {"percentile": 90, "ttftMs": 4000}}]}}
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    simulate_cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_a_tighter_slo_predicts_more_replica_hours_and_a_looser_one_fewer(tmp_path):
    slos = {"tighter": {"percentile": 99, "ttftMs": 250, "tpotMs": 30},
            "current": {"percentile": 95, "ttftMs": 500, "tpotMs": 50},
            "looser": {"percentile": 90, "ttftMs": 2000, "tpotMs": 100}}
    hours = {}
    for name, slo in slos.items():
        path = spec(tmp_path / f"{name}.yaml", slo)
        args = preview.load_args(parse("--llmservice", path, "--hours", "3"), preview.load_service(path))
        result, share = preview.run_spec((path, name, "conversation-day", args))
        hours[name] = result.replica_hours
        assert set(result.buckets) == {"chat", "doc"} and 0.3 < share["chat"] < 0.7
    assert hours["tighter"] > hours["current"] > hours["looser"], hours


def test_requests_fall_into_buckets_as_the_router_classifies_them():
    svc = preview.load_service(str(EXAMPLE))  # chat: <= 1024 prompt tokens on the chat route; doc: longer ones
    routed, slos = preview.targets(svc)
    assert [b.name for b in routed] == ["chat", "doc", "default"] and slos["default"].target == 0.0
    t = traces.Trace("code", np.zeros(3), np.array([100, 2000, 500], np.int32), np.array([10, 10, 10], np.int32))
    assert preview.classify(t, routed).tolist() == [2, 1, 2]  # code is /v1/completions: not chat
    chat = traces.Trace("conversation", t.arrival, t.prompt, t.output)
    assert preview.classify(chat, routed).tolist() == [0, 1, 0]


def test_compare_prints_both_predictions_side_by_side_and_draws_a_png(tmp_path, capsys):
    tight = spec(tmp_path / "tight.yaml", {"percentile": 99, "ttftMs": 300, "tpotMs": 30}, max_replicas=4)
    png = tmp_path / "preview.png"
    args = parse("--llmservice", str(EXAMPLE), "--compare", tight, "--traces", "conversation", "--png", str(png),
                 "--price-per-hour", "2.5", "--jobs", "1")
    assert simulate_cli.run(args) == 0
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines() if line.strip()}
    assert "llmservice-unified.yaml" in lines[""] and "tight.yaml" in lines[""]
    assert "autoscaling off: 2 replicas" in lines["fleet"] and "autoscaled, 1-4 replicas" in lines["fleet"]
    assert "p99 TTFT 500ms TPOT 50ms" in lines["bucket chat"] and "p99 TTFT 300ms TPOT 30ms" in lines["bucket chat"]
    assert lines["cost"].count("at 2.5/h") == 2 and len(lines["replica-hours"].split()) == 3
    assert png.stat().st_size > 10_000


def test_a_spec_the_simulator_cannot_model_is_refused(tmp_path, capsys):
    path = tmp_path / "disagg.yaml"
    path.write_text(yaml.safe_dump({"metadata": {"name": "d"}, "spec": {
        "model": {"name": "m", "source": "embedded"},
        "topology": {"mode": "disaggregated", "prefill": {}, "decode": {}}}}))
    assert simulate_cli.run(parse("--llmservice", str(path), "--traces", "conversation")) == 2
    assert "unified" in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--llmservice", "{bundle}"], None),  # an LLMService among other kinds: previewed
    (["--llmservice", "{policy}"], "0 LLMService documents (kinds in it: SLOPolicy)"),
    (["--llmservice", "{readme}"], "not YAML"),
    (["--llmservice", "{inverted}"], "minReplicas must be <= maxReplicas"),
    (["--llmservice", "{example}", "--price-per-hour", "-3"], "--price-per-hour must be 0 or more"),
    (["--llmservice", "{example}", "--compare", "{missing}"], "No such file"),
    (["--replica-profile", "{readme}"], "--replica-profile"),
    (["--target", "95"], "at most 1"),
    (["--hours", "inf"], "--hours must be a number above 0"),
    (["--png", "{missing}/x.png"], "its folder does not exist"),
])
def test_bad_arguments_and_files_get_one_line_and_exit_2(tmp_path, capsys, argv, says):
    bundle = tmp_path / "bundle.yaml"
    bundle.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n---\n" + EXAMPLE.read_text())
    inverted = tmp_path / "inverted.yaml"
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["topology"]["unified"] = {"minReplicas": 5, "maxReplicas": 2}
    inverted.write_text(yaml.safe_dump(doc))
    files = {"bundle": bundle, "inverted": inverted, "example": EXAMPLE, "readme": ROOT / "README.md",
             "policy": ROOT / "manifests" / "examples" / "slopolicy.yaml", "missing": tmp_path / "missing"}
    argv = [a.format(**files) for a in argv]
    no_png = [] if "--png" in argv else ["--png", ""]
    rc = simulate_cli.run(parse(*argv, *no_png, "--traces", "code", "--policies", "slofleet"))
    out, err = capsys.readouterr()
    if says is None:
        assert rc == 0 and "bundle.yaml" in out
        return
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err
