import math

import pytest

from slofleet.autoscaler.signals import Histogram, RoleSignals, merge, parse, stale, window

SLO = {"chat": (0.5, 0.05), "default": (1.0, 0.1)}


def scrape(waiting: int, ttft: tuple, itl: tuple, preempt: int = 0, first: int = 0) -> str:
    """Engine /metrics text as the engine writes it: two buckets, vLLM names, one slofleet extra."""
    lines = [
        "# TYPE vllm:num_requests_waiting gauge",
        f'vllm:num_requests_waiting{{model_name="m"}} {waiting}',
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{model_name="m"} 7',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{model_name="m"} 0.42',
        "# TYPE slofleet:queued_prompt_tokens gauge",
        f'slofleet:queued_prompt_tokens{{model_name="m"}} {waiting * 100}',
        "# TYPE vllm:num_preemptions counter",
        f'vllm:num_preemptions_total{{model_name="m"}} {preempt}',
        "# TYPE vllm:prompt_tokens counter",
        f'vllm:prompt_tokens_total{{model_name="m"}} {first * 1000}',
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ]
    for name, counts in (("vllm:time_to_first_token_seconds", ttft), ("vllm:inter_token_latency_seconds", itl)):
        if name.startswith("vllm:inter"):
            lines.append(f"# TYPE {name} histogram")
        for le, c in zip(("0.05", "0.5", "1.0", "+Inf"), counts):
            lines.append(f'{name}_bucket{{bucket="chat",le="{le}",model_name="m"}} {c}')
        lines.append(f'{name}_count{{bucket="chat",model_name="m"}} {counts[-1]}')
        lines.append(f'{name}_sum{{bucket="chat",model_name="m"}} 1.0')
    return "\n".join(lines) + "\n"


def test_parse_reads_gauges_counters_and_bucket_histograms():
    s = parse(scrape(3, (1, 2, 3, 4), (10, 20, 30, 40), preempt=5), "prefill", t=10.0)
    assert (s.waiting, s.running, s.kv_usage, s.queued_prompt_tokens, s.preemptions) == (3, 7, 0.42, 300, 5)
    assert s.ttft["chat"] == Histogram((0.05, 0.5, 1.0, math.inf), (1, 2, 3, 4))
    assert s.itl["chat"].total == 40


def test_window_attainment_is_the_difference_of_two_scrapes():
    old = parse(scrape(0, (10, 20, 30, 30), (0, 100, 100, 100), first=30), "prefill", t=0.0)
    new = parse(scrape(4, (10, 60, 70, 80), (0, 190, 200, 200), first=80), "prefill", t=10.0)
    w = window(old, new, SLO)
    # 50 first tokens in the window, 40 of them within 0.5 s; the 30 before the window do not count
    assert w.ttft_attainment == pytest.approx(0.8)
    # ITL target 0.05 sits on a bucket bound: 0 of the 100 new tokens were <= 0.05 s
    assert w.itl_attainment == pytest.approx(0.0)
    assert w.arrival_rate == pytest.approx((50 + 4) / 10)  # first tokens plus queue growth
    assert w.mean_prompt == pytest.approx(1000)


def test_fraction_interpolates_inside_a_bucket_and_ignores_empty_windows():
    h = Histogram((1.0, 2.0, math.inf), (10, 30, 40))
    assert h.fraction_le(1.5) == pytest.approx(20 / 40)
    assert h.fraction_le(5.0) == pytest.approx(30 / 40)  # the +Inf bucket is never credited
    assert h.minus(h).fraction_le(1.0) is None


def test_counter_reset_does_not_go_negative():
    old = parse(scrape(0, (50, 50, 50, 50), (5, 5, 5, 5), preempt=9, first=50), "decode", t=0.0)
    new = parse(scrape(0, (1, 2, 2, 2), (1, 1, 1, 1), preempt=1, first=2), "decode", t=10.0)  # pod restarted
    w = window(old, new, SLO)
    assert w.preemption_rate == 0.0
    assert w.ttft_attainment == pytest.approx(1.0)  # the restarted pod's own histogram counts whole


def test_merge_sums_pods_and_averages_kv():
    a = parse(scrape(2, (1, 1, 1, 1), (1, 1, 1, 1)), "decode", t=5.0)
    b = parse(scrape(4, (0, 1, 2, 3), (1, 2, 3, 4)), "decode", t=5.0)
    m = merge("decode", 5.0, [a, b])
    assert (m.pods, m.waiting, m.running, m.kv_usage) == (2, 6, 14, pytest.approx(0.42))
    assert m.ttft["chat"].counts == (1, 2, 3, 4)


def test_stale_when_missing_empty_or_old():
    s = RoleSignals("unified", t=100.0, pods=1)
    assert stale(None, 100.0, 60.0)
    assert stale(RoleSignals("unified", t=100.0, pods=0), 100.0, 60.0)
    assert stale(s, 161.0, 60.0)
    assert not stale(s, 150.0, 60.0)
