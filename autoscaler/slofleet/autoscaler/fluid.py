"""The fleet simulator's fluid model, one tick at a time (sim.py describes it, and runs it under a controller):
prompts served from one FIFO, running requests decoding on a ring of finish steps, KV overflow preempting."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .policy import SLO
from .profiles import Profile
from .signals import RoleSignals


@dataclass(slots=True, kw_only=True)
class Inputs:
    """A trace's requests and what the profile and targets make of them, fixed for one run."""
    prof: Profile
    targets: dict[str, SLO]
    arr: np.ndarray  # arrival times
    p: np.ndarray  # prompt tokens (float)
    o: np.ndarray  # output tokens (int)
    cls: np.ndarray  # each request's bucket, an index into `targets`
    nb: int  # buckets
    ttft_t: np.ndarray  # targets by bucket
    tpot_t: np.ndarray
    pos: np.ndarray  # each request's last prompt token's place in the fleet's prefill queue
    alone: np.ndarray  # its prefill on an idle replica
    ticks: int
    ring_len: int  # a finish step is at most one tick's steps + output ahead


@dataclass(slots=True, kw_only=True)
class State:
    """The fleet between ticks: the fluid queues, the running requests' finish ring, replicas, counters."""
    first: np.ndarray  # first-token time per request
    last_step: np.ndarray  # the step count S at which its last token comes
    steps: np.ndarray  # decode steps done per replica (S) at each tick boundary
    # per finish slot: requests (by bucket), their prompt tokens, their entry step; running KV is then exact:
    # K = prompts + B * S - entry steps (each running request holds its prompt plus one token per step)
    ring_n: np.ndarray
    ring_p: np.ndarray
    ring_s0: np.ndarray
    running: np.ndarray  # B by bucket
    ready: int
    desired: int
    minute_paid: np.ndarray
    by_prompt: np.ndarray  # counters by bucket, as an engine's per-bucket metrics
    by_gen: np.ndarray
    ttft_ok: np.ndarray
    ttft_n: np.ndarray
    itl_ok: np.ndarray
    itl_n: np.ndarray
    step_time: float
    C: float = 0.0  # prompt tokens served from the fleet's queue
    debt: float = 0.0  # evicted tokens to recompute, served before the queue
    S: float = 0.0  # decode steps done per replica
    K: float = 0.0  # KV tokens held
    kv_p: float = 0.0
    kv_s0: float = 0.0
    evicted: float = 0.0
    B: int = 0  # running requests
    done_pre: int = 0  # requests past their prefill
    starting: deque = field(default_factory=deque)  # when each asked-for replica becomes ready
    draining: deque = field(default_factory=deque)  # when each removed one has drained
    serving: int = 0  # this tick's replicas with requests: ready + draining
    arrived: int = 0  # requests arrived by this tick's end
    queued: float = 0.0  # prompt tokens waiting this tick
    prompt_total: float = 0.0  # fleet-wide counters
    gen_total: float = 0.0
    finished: float = 0.0
    preemptions: float = 0.0
    snaps: list[RoleSignals] = field(default_factory=list)
    paid_s: float = 0.0
    actions: int = 0
    reasons: list[str] = field(default_factory=list)


@dataclass(slots=True, kw_only=True)
class Entrants:
    """The requests whose first token comes in this tick."""
    sl: slice
    oo: np.ndarray  # their outputs, prompts and buckets
    pp: np.ndarray
    cc: np.ndarray
    multi: np.ndarray  # those with more than one output token, which go on decoding


def advance(run: Inputs, st: State, dt: float, k: int, t0: float, t1: float) -> None:
    """One tick: replicas come and go, prompts are served, running requests decode, replicas are paid."""
    while st.starting and st.starting[0] <= t0:
        st.starting.popleft()
        st.ready += 1
    while st.draining and st.draining[0] <= t0:
        st.draining.popleft()
    st.serving = st.ready + len(st.draining)
    st.arrived = int(np.searchsorted(run.arr, t1))
    st.queued = (run.pos[st.arrived - 1] if st.arrived else 0.0) - st.C
    pre_time, entrants = prefill(run, st, dt, t0)
    if st.B and st.serving:
        decode(run, st, dt, t0, pre_time, entrants)
    if entrants is not None:
        st.done_pre = entrants.sl.stop
    if not st.B:
        st.kv_p = st.kv_s0 = st.evicted = st.K = 0.0
        st.running[:] = 0.0
    st.steps[k + 1] = st.S
    st.paid_s += (st.ready + len(st.starting) + len(st.draining)) * dt
    st.minute_paid[int(t0 // 60)] += (st.ready + len(st.starting) + len(st.draining)) * dt / 60


def prefill(run: Inputs, st: State, dt: float, t0: float) -> tuple[float, Entrants | None]:
    """Serve queued prompt tokens, sharing each step's token budget with the running decodes: the replicas' time
    it took, and the requests whose prefill ended."""
    prof, C0 = run.prof, st.C
    if not (st.ready and st.queued + st.debt > 0 and st.B < prof.max_batch * st.serving):
        return 0.0, None
    b = st.B / st.serving
    chunk = max(prof.token_budget - b, 1.0)
    tau = prof.step_s + prof.decode_seq_s * b + prof.kv_token_s * st.K / st.serving
    speed = st.ready * chunk / (tau + prof.prefill_token_s * chunk)  # prompt tokens/s while the queue lasts
    x = min(st.queued + st.debt, speed * dt, max(prof.kv_tokens * st.serving - st.K, 0.0))
    from_debt = min(st.debt, x)
    st.debt -= from_debt
    st.evicted = max(st.evicted - from_debt, 0.0)
    st.C += x - from_debt
    pre_time = x / st.ready * prof.prefill_token_s
    new = int(np.searchsorted(run.pos, st.C + 1e-6, side="right"))
    if new <= st.done_pre:
        return pre_time, None
    sl = slice(st.done_pre, new)
    # at full speed from the tick's start, after the recompute debt; never before its own prefill
    st.first[sl] = np.maximum(t0 + (from_debt + run.pos[sl] - C0) / speed, run.arr[sl] + run.alone[sl])
    entrants = Entrants(sl=sl, oo=run.o[sl], pp=run.p[sl], cc=run.cls[sl], multi=run.o[sl] > 1)
    first_tokens(run, st, entrants)
    return pre_time, entrants


def first_tokens(run: Inputs, st: State, e: Entrants) -> None:
    """Count the entrants' first tokens, and start decoding the ones with more to come."""
    nb, cc = run.nb, e.cc
    entering = np.bincount(cc, minlength=nb)
    st.ttft_n += entering
    st.ttft_ok += np.bincount(cc, st.first[e.sl] - run.arr[e.sl] <= run.ttft_t[cc], nb)
    st.by_prompt += np.bincount(cc, e.pp, nb)
    st.by_gen += entering
    st.prompt_total += float(e.pp.sum())
    st.gen_total += len(e.oo)
    st.finished += float(len(e.oo) - e.multi.sum())
    st.B += int(e.multi.sum())
    st.running += np.bincount(cc, e.multi, nb)
    st.kv_p += float(e.pp[e.multi].sum())


def decode(run: Inputs, st: State, dt: float, t0: float, pre_time: float, entrants: Entrants | None) -> None:
    """All running requests advance in the time prefill left; the ones whose last step passes end."""
    prof = run.prof
    tau = prof.step_s + prof.decode_seq_s * st.B / st.serving + prof.kv_token_s * st.K / st.serving
    n = max(dt - pre_time, 0.05 * dt) / tau
    st.step_time = dt / n
    if entrants is not None:
        join(run, st, entrants, n, dt, t0)
    ended, made = retire(run, st, n)
    st.B -= int(round(ended.sum()))
    st.running -= ended
    st.S += n
    tokens = st.running * n + made
    st.gen_total += float(tokens.sum())
    st.by_gen += tokens
    st.itl_n += tokens
    st.itl_ok += np.where(st.step_time <= run.tpot_t, tokens, 0.0)
    st.finished += float(ended.sum())
    preempt(run, st)


def join(run: Inputs, st: State, e: Entrants, n: float, dt: float, t0: float) -> None:
    """Entrants join the finish ring at the step count of their first token."""
    s_in = st.S + n * np.clip((st.first[e.sl] - t0) / dt, 0.0, 1.0)
    st.last_step[e.sl] = s_in + e.oo - 1
    slots = st.last_step[e.sl][e.multi].astype(np.int64) % run.ring_len
    np.add.at(st.ring_n, (slots, e.cc[e.multi]), 1.0)
    np.add.at(st.ring_p, slots, e.pp[e.multi])
    np.add.at(st.ring_s0, slots, s_in[e.multi])
    st.kv_s0 += float(s_in[e.multi].sum())


def retire(run: Inputs, st: State, n: float) -> tuple[np.ndarray, np.ndarray]:
    """Take the requests ending within the next `n` steps off the ring: how many by bucket, and the tokens they
    generated up to their own finish step (not the tick's end)."""
    lo, hi = int(st.S) + 1, int(st.S + n)
    ended = made = np.zeros(run.nb)
    if hi >= lo:
        idx = np.arange(lo, min(hi, lo + run.ring_len - 1) + 1) % run.ring_len
        ended = st.ring_n[idx].sum(axis=0)
        made = (np.arange(lo, lo + len(idx)) - st.S) @ st.ring_n[idx]
        st.kv_p -= st.ring_p[idx].sum()
        st.kv_s0 -= st.ring_s0[idx].sum()
        st.ring_n[idx] = 0.0
        st.ring_p[idx] = st.ring_s0[idx] = 0.0
    return ended, made


def preempt(run: Inputs, st: State) -> None:
    """KV past the fleet's capacity preempts: evicted tokens are recomputed (served before the queue) and then held
    again."""
    st.K = max(st.kv_p + st.B * st.S - st.kv_s0 - st.evicted, 0.0)
    cap = run.prof.kv_tokens * st.serving
    if st.K > cap and st.B:
        over = st.K - cap
        st.preemptions += math.ceil(over / (st.K / st.B))
        st.debt += over
        st.evicted += over
        st.K = cap
