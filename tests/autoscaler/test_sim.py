import json

import numpy as np
import pytest

from slofleet.autoscaler import profiles
from slofleet.autoscaler.baselines import KEDAQueue, Static, Thresholds
from slofleet.autoscaler.policy import SLO, Decision, Fleet, Policy, PolicyConfig
from slofleet.autoscaler.profiles import Profile
from slofleet.autoscaler.signals import RoleSignals, Window
from slofleet.autoscaler.sim import SimConfig, simulate
from slofleet.autoscaler.traces import Trace

# a small replica: 5 ms steps, 50 us per prompt token, 0.1 ms per sequence, 10 ns per KV token
TOY = Profile("toy", step_s=0.005, prefill_token_s=50e-6, decode_seq_s=1e-4, kv_token_s=1e-8, token_budget=1024,
              max_batch=128, kv_tokens=200_000, cold_start_s=60.0)
SLO_ = SLO(ttft_s=0.5, tpot_s=0.05)


def poisson(rate, seconds, prompt=500, output=100, seed=0, start=0.0) -> Trace:
    rng = np.random.default_rng(seed)
    t = start + np.sort(rng.random(rng.poisson(rate * seconds)) * seconds)
    n = len(t)
    return Trace("toy", t, np.full(n, prompt, np.int32), np.full(n, output, np.int32))


def merge(a: Trace, b: Trace) -> Trace:
    order = np.argsort(np.concatenate([a.arrival, b.arrival]), kind="stable")
    cat = lambda x, y: np.concatenate([x, y])[order]  # noqa: E731
    return Trace("toy", cat(a.arrival, b.arrival), cat(a.prompt, b.prompt), cat(a.output, b.output))


def run(trace, ctrl, initial, profile=TOY):
    return simulate(trace, ctrl, SimConfig(profile, SLO_, initial=initial))


def test_a_lone_request_sees_the_profiles_prefill_and_step_times():
    r = run(poisson(0.05, 600, prompt=2000, output=50), Static(1), 1)
    # one chunked prefill of 2000 tokens in 2 steps; decode alone: step + one sequence + its KV tokens
    assert r.ttft_p50 == pytest.approx(2 * 0.005 + 2000 * 50e-6, rel=0.1)
    # (within 15%: the tick that holds the first token spreads its steps over the whole tick)
    assert r.tpot_p50 == pytest.approx(0.005 + 1e-4 + 2025 * 1e-8, rel=0.15)
    assert r.attainment == 1.0


def test_attainment_grows_with_replicas_and_overload_misses():
    trace = poisson(40.0, 300)  # each request costs ~25 ms of prefill + its share of decode: ~1 s/s per 25 req/s
    att = [run(trace, Static(n), n).attainment for n in (1, 2, 4)]
    assert att[0] < 0.5 < att[1] and att[2] >= 0.95 and att[1] <= att[2] + 0.01


def test_kv_capacity_causes_preemption_and_misses():
    trace = poisson(10.0, 120, prompt=3000, output=400)
    small = Profile(**{**TOY.__dict__, "kv_tokens": 8_000})
    roomy, tight = run(trace, Static(4), 4), run(trace, Static(4), 4, small)
    assert roomy.preemptions == 0 and tight.preemptions > 0
    assert tight.attainment < roomy.attainment


class StepTo:
    def __init__(self, at: float, n: int):
        self.at, self.n = at, n

    def decide(self, now, win, fleet):
        return Decision(self.n if now >= self.at else fleet.total, "test")


def test_cold_start_is_paid_before_it_serves():
    trace = poisson(2.0, 600)
    r = run(trace, StepTo(15.0, 3), 1)
    # 1 replica from 0, 2 more paid from t=15 (though they serve only from 75) until the trace drains
    end = trace.duration + SimConfig(TOY).tail_s
    assert r.replica_hours == pytest.approx((end + 2 * (end - 15)) / 3600, rel=0.02)
    assert r.actions == 1


def test_policy_rides_a_burst_that_a_static_fleet_misses():
    trace = merge(poisson(10.0, 1800, seed=1), poisson(50.0, 600, seed=2, start=600.0))
    pre, dec = TOY.rates(500, 100, SLO_.tpot_s)
    policy = Policy(PolicyConfig(slo=SLO_, max_replicas=20, prefill_tps=pre, decode_tps=dec, cold_start_s=60))
    dyn, static = run(trace, policy, 1), run(trace, Static(1), 1)
    assert dyn.replicas.max() >= 2 and dyn.attainment > static.attainment + 0.2
    assert dyn.replicas[-5:].max() < dyn.replicas.max()  # and comes back down after it


def sig(waiting=0.0, kv=0.0, pods=2):
    return Window(RoleSignals("unified", 0.0, pods=pods, waiting=waiting, kv_usage=kv), 60, 1, 100, 10,
                  100, 10, 0, None, None)


def test_keda_and_threshold_baselines_follow_their_rules():
    assert KEDAQueue().decide(0, sig(waiting=23), Fleet(2)).desired == 5  # ceil(23 / 5)
    th = Thresholds()
    assert th.decide(0, sig(kv=0.95), Fleet(2)).desired == 3
    assert th.decide(30, sig(kv=0.95), Fleet(3)).desired == 3  # one change per interval
    assert th.decide(90, sig(kv=0.1), Fleet(3)).desired == 2


def test_simulator_matches_the_engine_measured_on_this_machine():
    """benchmarks/profile_cpu.py replayed a Poisson mix through the real engine at one replica and stored its
    TTFT/TPOT P50 beside the fitted profile; the simulator must land within 25% of both."""
    v = profiles.validation("cpu")
    if v is None:
        pytest.skip("no measured CPU profile: run benchmarks/profile_cpu.py")
    measured = json.loads(profiles.CPU_PROFILE.read_text())
    if measured.get("load_average", 0) >= measured.get("cpus", 1):
        pytest.skip(f"profile measured on an oversubscribed machine (load {measured['load_average']} on "
                    f"{measured['cpus']} CPUs): re-run benchmarks/profile_cpu.py on a quiet one")
    mix = np.array(v["arrivals"], dtype=np.float64)
    trace = Trace("engine-mix", mix[:, 0], mix[:, 1].astype(np.int32), mix[:, 2].astype(np.int32))
    prof = profiles.load("cpu")
    r = simulate(trace, Static(1), SimConfig(prof, SLO(60.0, 10.0), initial=1, dt=0.1))
    assert r.ttft_p50 == pytest.approx(v["ttft_p50_s"], rel=0.25)
    assert r.tpot_p50 == pytest.approx(v["tpot_p50_s"], rel=0.25)


class Watch(Static):
    """A static fleet that keeps the windows it is shown."""

    def __init__(self, n: int):
        super().__init__(n)
        self.seen = []

    def decide(self, now, win, fleet):
        if win is not None:
            self.seen.append(win)
        return super().decide(now, win, fleet)


def test_each_request_is_judged_by_its_own_buckets_targets_and_the_policy_sees_them_apart():
    t = poisson(10.0, 300)  # ~30 ms to a first token on an idle replica
    trace = Trace("toy", t.arrival, t.prompt, t.output, np.arange(len(t.arrival)) % 2)
    watch = Watch(2)
    r = simulate(trace, watch, SimConfig(TOY, SLO_, initial=2, buckets={"strict": SLO(0.001, 0.05),
                                                                         "easy": SLO(1.0, 0.05)}))
    assert r.buckets == {"strict": 0.0, "easy": 1.0} and r.attainment == pytest.approx(0.5, abs=0.01)
    last = watch.seen[-20]  # a window while requests still arrive
    assert set(last.buckets) == {"strict", "easy"}
    assert last.buckets["strict"].ttft_attainment == 0.0 and last.buckets["easy"].ttft_attainment == 1.0
    assert last.buckets["easy"].mean_prompt == pytest.approx(500) and last.buckets["easy"].arrival_rate > 3
