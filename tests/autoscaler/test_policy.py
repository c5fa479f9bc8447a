import math

from slofleet.autoscaler.forecast import Forecaster
from slofleet.autoscaler.policy import SLO, Fleet, Policy, PolicyConfig
from slofleet.autoscaler.signals import RoleSignals, Window

# 1000 prompt and 100 output tokens per request; capacity: 10,000 prompt tokens/s or 1,000 tokens/s,
# so one replica serves 1/(0.1 + 0.1) = 5 requests/s at full capacity, 4 at the planned 80%
MIX = dict(mean_prompt=1000.0, mean_output=100.0)


def cfg(**kw) -> PolicyConfig:
    base = dict(slo=SLO(0.5, 0.05), min_replicas=1, max_replicas=20, prefill_tps=10_000, decode_tps=1_000,
                utilization=0.8, cold_start_s=60, down_window_s=300, stale_after_s=60)
    return PolicyConfig(**{**base, **kw})


def win(t: float, rate: float, pods: int = 2, waiting: float = 0, kv: float = 0.2, ttft: float | None = 1.0,
        itl: float | None = 1.0, preempt: float = 0.0, served: float | None = None) -> Window:
    """A window at `rate` arrivals/s of which `served` (default: all) were processed."""
    now = RoleSignals("unified", t, pods=pods, waiting=waiting, running=10, kv_usage=kv)
    done = rate if served is None else served
    return Window(now, 60.0, rate, MIX["mean_prompt"], MIX["mean_output"], done * 1000, done * 100, preempt,
                  ttft, itl)


def steady(policy: Policy, t0: float, t1: float, rate: float, fleet: Fleet, **kw):
    d = None
    for t in range(int(t0), int(t1), 15):
        d = policy.decide(t, win(t, rate, pods=fleet.ready, **kw), fleet)
    return d


def test_burst_scales_up_at_once_with_a_reason():
    p = Policy(cfg())
    assert steady(p, 0, 120, 8.0, Fleet(2)).desired == 2  # 8 req/s fits 2 replicas at 80%
    # 30 req/s arrive; the 2 replicas serve the 10 they can, the rest queues and TTFT is missed
    d = p.decide(135, win(135, 30.0, waiting=150, ttft=0.6, served=10.0), Fleet(2))
    assert d.desired >= 5 and "scale up" in d.reason  # one window could be noise: part of the way ...
    d = p.decide(150, win(150, 30.0, waiting=300, ttft=0.6, served=10.0), Fleet(2, starting=d.desired - 2))
    assert d.desired >= 8 and "req/s" in d.reason  # ... and all of it when the next window agrees


def test_rising_trend_is_forecast_one_cold_start_ahead():
    f = Forecaster()
    for t in range(0, 600, 15):  # +0.1 req/s every second
        f.add(float(t), 10.0 + t / 10)
    assert f.at(585 + 60) > 10.0 + 58.5 + 4


def test_scale_down_waits_for_the_stabilization_window_then_steps():
    p = Policy(cfg(down_step=0.25))
    steady(p, 0, 300, 32.0, Fleet(8))
    d = p.decide(315, win(315, 4.0, pods=8), Fleet(8))
    assert d.desired == 8 and d.condition == "Stabilizing"
    d = steady(p, 330, 600, 4.0, Fleet(8))
    assert d.desired == 8  # 32 req/s was still recommended within 300 s
    d = p.decide(630, win(630, 4.0, pods=8), Fleet(8))
    assert d.desired == 6 and "scale down" in d.reason  # at most 25% per decision


def test_no_scale_down_until_in_flight_work_can_drain():
    p = Policy(cfg())
    steady(p, 0, 300, 32.0, Fleet(8))
    # the load has dropped but the running requests' KV would not fit on fewer replicas
    d = steady(p, 300, 700, 2.0, Fleet(8), kv=0.85)
    assert d.desired == 8 and d.condition == "Draining" and "KV usage" in d.reason
    d = p.decide(705, win(705, 2.0, pods=8, kv=0.1), Fleet(8))
    assert d.desired == 7


def test_bounds_are_respected_and_reported():
    p = Policy(cfg(min_replicas=3, max_replicas=6))
    d = p.decide(0, win(0, 500.0), Fleet(2))
    assert d.desired == 6 and d.condition == "ScalingLimited"
    q = Policy(cfg(min_replicas=3, max_replicas=6, down_window_s=0))
    assert q.decide(0, win(0, 0.0, pods=5), Fleet(5)).desired == 4  # one step down ...
    assert steady(q, 15, 300, 0.0, Fleet(3)).desired == 3  # ... never below the minimum


def test_prefill_and_decode_decide_independently():
    # each role reads its own pool's window; prompts pile up on prefill while decode is comfortable (no
    # stabilization window, so that a fresh policy's recommendation is its decision)
    pre_hot = win(0, 8.0, waiting=40, ttft=0.5, itl=0.5, kv=0.97)
    dec_cool = win(0, 8.0, waiting=0, ttft=0.5, itl=1.0, kv=0.1)
    assert Policy(cfg(role="prefill", down_window_s=0)).decide(0, pre_hot, Fleet(2)).desired > 2
    # 800 tokens/s: one replica
    assert Policy(cfg(role="decode", down_window_s=0)).decide(0, dec_cool, Fleet(2)).desired == 1
    # the other way round: decode saturates, prefill does not move; and neither reads the other's signals
    dec_hot = win(15, 2.0, kv=0.97, itl=0.6, preempt=0.5, ttft=0.1, waiting=0)
    pre_cool = win(15, 2.0, kv=0.3, itl=0.1, ttft=1.0, preempt=0.5)
    assert Policy(cfg(role="decode", down_window_s=0)).decide(15, dec_hot, Fleet(2)).desired > 2
    assert Policy(cfg(role="prefill", down_window_s=0)).decide(15, pre_cool, Fleet(2)).desired == 1


def test_a_fresh_policy_holds_what_runs_for_one_stabilization_window():
    # it has not seen the window's recommendations; what runs (or is on record) stands for them
    p = Policy(cfg())
    assert p.decide(0, win(0, 4.0, pods=6), Fleet(6)).desired == 6
    assert steady(p, 15, 300, 4.0, Fleet(6)).desired == 6
    assert p.decide(315, win(315, 4.0, pods=6), Fleet(6)).desired == 5


def test_replicas_still_starting_are_the_cold_start_allowance():
    p = Policy(cfg())
    d = p.decide(0, win(0, 8.0, pods=2, ttft=0.5), Fleet(2, starting=3))
    assert d.desired == 5 and "still starting" in d.reason


def test_stale_or_missing_metrics_hold_the_last_decision():
    p = Policy(cfg())
    assert p.decide(0, None, Fleet(3)).desired == 3  # never scales on no data
    up = p.decide(15, win(15, 30.0), Fleet(3))
    assert up.desired > 3
    old = win(15, 500.0)  # the same scrape seen again 100 s later
    d = p.decide(115, old, Fleet(3))
    assert d.desired == up.desired and d.condition == "MetricsStale" and "stale" in d.reason
    no_pods = Window(RoleSignals("unified", 130, pods=0), 60, 0, None, None, 0, 0, 0, None, None)
    assert p.decide(130, no_pods, Fleet(3)).condition == "MetricsStale"


def test_capacity_is_learnt_when_the_fleet_saturates_below_the_prior():
    p = Policy(cfg())
    # 2 replicas miss their SLO at 6 req/s: they sustain 6, not the 10 the prior promised
    steady(p, 0, 600, 6.0, Fleet(2), ttft=0.5, waiting=20)
    assert p.scale < 0.8
    # the forecast now plans more replicas for the same rate than the prior would
    assert p.decide(615, win(615, 8.0, pods=8), Fleet(8)).desired > 2


def test_a_seen_season_bends_the_forecast_at_the_turns_a_trend_misses():
    season = 3600.0
    f = Forecaster(trend_s=600, season_s=season, slot_s=120)
    load = lambda t: 10 + 5 * math.sin(2 * math.pi * t / season)  # noqa: E731 (peaks at a quarter of the season)
    errors = []
    for day in range(2):
        for t in range(int(day * season), int((day + 1) * season), 15):
            if t % season == season / 4 - 300:  # five minutes before the peak, forecast the peak
                errors.append(abs(f.at(t + 300) - load(t + 300)))
            f.add(float(t), load(t))
    assert errors[1] < errors[0] / 2  # the first day's trend runs past the peak; the second knows the turn
