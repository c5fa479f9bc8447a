"""Engine CPU benchmark: one fixed workload through transformers and slofleet, against this machine's FLOP limit.

Workload: 16 chat prompts of 20-300 words through the chat template, 32 output tokens each, greedy, fixed length
(EOS ignored). Every run, warm-up included, gets prompts of the same lengths that no earlier run has seen (only the
chat template's system prompt repeats, which the prefix cache may keep). Each system runs it --runs times, in
rounds of one run per system so the machine's drift moves every figure alike (transformers in a process of its own,
see Transformers); each round also measures the GEMM rates at the workload's shapes (torch's in fp32 and bf16, and
slofleet's own kernels where the CPU has them: fp32 on AVX-512 or AVX2, bf16 on AMX or AVX512-BF16), from which the
limit follows, at the fastest of them (the table also gives the fraction of the limit at torch's GEMMs alone, the
issue's first definition):

    limit_s = prompt tokens x 2 x 106.2M FLOP / (fastest GEMM at 2048x576x1536 and 512x576x1536)
            + 16 x 31 x 2 x 134.5M FLOP / (fastest GEMM at 16x576x1536)

(106.2M: the weights every prompt token multiplies; 134.5M: those plus the LM head, which only sampled positions
reach). The table shows the median tokens/s, the ratio to transformers generate_batch(), the median fraction
of the limit reached (limit_s of that run's prompts over its time) and the median share of the machine's CPU time
the hypervisor gave to other guests during a run ("stolen", from /proc/stat): on a shared 2-core VM, runs with 6-8%
stolen were 15-25% slower than runs with under 1%, more than the share itself (a parallel kernel waits for its
slowest thread). llama.cpp (llama-cpp-python, sequential, on the same GGUF) is included when installed.

Beside it, a memory floor the FLOP limit leaves out: every decode step reads all the weights (134.5M parameters) as
LLM() holds them (bf16, fp32, or a Q4_1 checkpoint's projections in their 5 bits: quant.py) and, for each row, the K
and V of every token before it in every layer (in LLM()'s cache dtype), at best at the machine's read bandwidth
measured in the same run; prefill at the GEMM rate plus 31 such steps gives the fraction of the FLOP limit an engine
holding those bytes could reach here.

--speculative K adds LLM(num_speculative_tokens=K) (n-gram drafts) beside LLM() defaults, on this workload and on a
quoting one (the same notes, each prompt asking for them back word for word; rows marked [quote]), in the same
rounds, and prints the ratio of the two per workload.

    .venv/bin/python benchmarks/engine_cpu.py [--runs 3] [--skip generate generate_batch] [--speculative 4]
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import itertools
import multiprocessing
import platform
import random
import statistics
import sys
import time

import torch

WORDS = ("river mountain signal engine quiet garden window market theory planet music letter forest "
         "winter machine story bridge lantern harbor circuit memory ocean desert village candle rhythm").split()
N_PROMPTS, OUT_TOKENS = 16, 32
PREFILL_FLOP, DECODE_FLOP = 2 * 106.2e6, 2 * 134.5e6  # per prompt token, per sampled token
GEMM_SHAPES = {"prefill 2048": 2048, "prefill 512": 512, "decode 16": 16}  # rows of x (576) @ W (576 x 1536)


def prompts(seed: int, quote: bool = False) -> list[str]:
    rng = random.Random(seed)
    lengths = [round(20 + i * (300 - 20) / (N_PROMPTS - 1)) for i in range(N_PROMPTS)]
    rng.shuffle(lengths)
    ask = "Repeat the following notes word for word" if quote else "Summarise the following notes"
    return [f"{ask} (set {seed}){'' if quote else ' in one sentence'}: " + " ".join(rng.choice(WORDS) for _ in
                                                                                   range(n)) for n in lengths]


def cpu_jiffies() -> tuple[int, int]:
    """(stolen, all) CPU time since boot, summed over CPUs, from /proc/stat; (0, 0) where there is none. Stolen time
    is what the hypervisor gave other guests while this VM's vCPUs were ready to run."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return 0, 0
    return fields[7] if len(fields) > 7 else 0, sum(fields)


def stolen_since(before: tuple[int, int]) -> float:
    steal, total = (b - a for a, b in zip(before, cpu_jiffies()))
    return steal / total if total else 0.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def chat_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts]


def gemm_rates() -> dict[str, dict[str, float]]:
    """GFLOP/s per shape of torch's GEMM in each dtype and, where they are built, of slofleet's own GEMM kernels
    (the limit takes the fastest of them), at the thread count every system runs with."""
    from slofleet.engine.backends.cpu import cpu_kernels
    from slofleet.engine.backends.cpu.dtype_probe import gemm_gflops
    kinds = [("fp32", torch.float32, False), ("bf16", torch.bfloat16, False)]
    if cpu_kernels.panel_columns():
        kinds.append(("fp32 kernel", torch.float32, True))
    if cpu_kernels.bf16_gemm():
        kinds.append(("bf16 kernel", torch.bfloat16, True))
    return {shape: {name: gemm_gflops(rows, 576, 1536, dtype, seconds=0.2, kernel=kernel)
                    for name, dtype, kernel in kinds}
            for shape, rows in GEMM_SHAPES.items()}


def torch_only(rates: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The rates of torch's own GEMMs: the limit as the issue first defined it, before the engine had kernels."""
    return {shape: {kind: r for kind, r in by.items() if "kernel" not in kind} for shape, by in rates.items()}


def prefill_seconds(rates: dict[str, dict[str, float]], prompt_tokens: int) -> float:
    return prompt_tokens * PREFILL_FLOP / max(*rates["prefill 2048"].values(), *rates["prefill 512"].values()) / 1e9


def limit_seconds(rates: dict[str, dict[str, float]], prompt_tokens: int) -> float:
    decode = max(rates["decode 16"].values())
    return prefill_seconds(rates, prompt_tokens) + N_PROMPTS * (OUT_TOKENS - 1) * DECODE_FLOP / decode / 1e9


def read_gbps() -> float:
    """Memory read bandwidth (GB/s): the best of 5 sums over a 512 MiB fp32 tensor, at the benchmark's threads."""
    big = torch.ones(1 << 27)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        big.sum()
        best = max(best, big.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def weight_bytes(model) -> int:
    """What one decode step reads of a model's weights: each projection's packed form where it has one, else its
    weight (the embedding's lookups read a few rows only)."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return sum(m.panels.nbytes if m.panels is not None else m.weight.nbytes for m in layers)


def kv_token_bytes(model_runner) -> int:
    """The bytes of K and V one token holds in a runner's cache, over all its layers."""
    caches = model_runner.kv_caches
    return sum(k.nbytes + v.nbytes for k, v in caches) // (caches[0][0].shape[0] * caches[0][0].shape[1])


def decode_kv_bytes(prompt_tokens: int, per_token: int) -> list[int]:
    """The cache bytes each decode step reads: at step s (1-31) every row attends its prompt and s tokens more."""
    return [(prompt_tokens + N_PROMPTS * s) * per_token for s in range(1, OUT_TOKENS)]


def floor_seconds(rates: dict[str, dict[str, float]], prompt_tokens: int, gbps: float, weights: int,
                  kv_token: int) -> float:
    """Prefill at the GEMM rate, then each decode step at least one read of `weights` bytes and its rows' KV cache
    (see the docstring), or its FLOPs at the GEMM rate where they take longer."""
    flop = N_PROMPTS * DECODE_FLOP / (max(rates["decode 16"].values()) * 1e9)
    return prefill_seconds(rates, prompt_tokens) + sum(max(flop, (weights + kv) / (gbps * 1e9))
                                                       for kv in decode_kv_bytes(prompt_tokens, kv_token))


def run_hf_generate(model, ids) -> int:
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=OUT_TOKENS, min_new_tokens=OUT_TOKENS, do_sample=False, pad_token_id=2)
    n = 0
    for x in ids:
        with torch.inference_mode():
            out = model.generate(torch.tensor([x]), generation_config=cfg)
        n += out.shape[1] - len(x)
    return n


def run_hf_generate_batch(model, ids) -> int:
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=OUT_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=2)
    outs = model.generate_batch(inputs=ids, generation_config=cfg, progress_bar=False)
    return sum(len(o.generated_tokens) for o in outs.values())


class Transformers:
    """The transformers rows, run in a process of their own so their heap stays apart from the engines' (each call is
    timed here). LLM() ran slower right after generate_batch() with the rows in its process and still does with them
    apart: what those runs share is CPU time the hypervisor stole (the table's "stolen"), which rose after the rows'
    minute of full load; the worker itself idles between calls."""

    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve_transformers, args=(child,), daemon=True)
        self.proc.start()

    def __call__(self, kind: str, ids: list[list[int]]) -> int:
        self.conn.send((kind, ids))
        return self.conn.recv()


def serve_transformers(conn) -> None:
    from transformers import AutoModelForCausalLM

    from slofleet.engine import loader
    hf = AutoModelForCausalLM.from_pretrained(loader.resolve("default"), dtype=torch.float32).eval()
    runs = {"generate": run_hf_generate, "generate_batch": run_hf_generate_batch}
    while True:
        try:
            kind, ids = conn.recv()
        except EOFError:  # the benchmark is done and closed its end
            return
        conn.send(runs[kind](hf, ids))


HELD: dict[str, int] = {}  # LLM() defaults' weight bytes ("weights") and KV bytes a token ("kv"), for the memory floor

# Per slofleet row, per call: engine steps, draft tokens, accepted ones (which the machine's load does not move),
# and the process's CPU seconds (which other processes on a shared machine move less than its wall time).
STEPS: dict[str, list[tuple[float, ...]]] = {}


def run_slofleet(llm, ids, _texts, name: str = "") -> int:
    from slofleet.engine import SamplingParams
    engine = llm.engine

    def counts() -> tuple[float, ...]:
        spec = engine.stats().spec
        return engine.step_stats.steps, sum(spec.drafted.values()), sum(spec.accepted.values()), time.process_time()
    before = counts()
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True))
    STEPS.setdefault(name, []).append(tuple(b - a for a, b in zip(before, counts())))
    return sum(len(o.token_ids) for o in outs)


def run_llama_cpp(llm, _ids, texts) -> int:
    n = 0
    for t in texts:
        out = llm.create_chat_completion([{"role": "user", "content": t}], max_tokens=OUT_TOKENS, temperature=0)
        n += out["usage"]["completion_tokens"]
    return n


def versions() -> str:
    found = []
    for p in ("torch", "transformers", "llama_cpp_python"):
        try:
            found.append(f"{p} {md.version(p)}")
        except md.PackageNotFoundError:
            pass
    flags = open("/proc/cpuinfo").read()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return (f"python {platform.python_version()}; {'; '.join(found)}; cpu flags: {' '.join(isa)}; "
            f"threads {torch.get_num_threads()}")


def systems(args) -> list[tuple[str, object]]:
    from slofleet.engine import LLM, loader
    out = []
    if {"generate", "generate_batch"} - set(args.skip):
        hf = Transformers()
        if "generate" not in args.skip:
            out.append(("transformers generate() one by one, fp32", lambda ids, t: hf("generate", ids)))
        if "generate_batch" not in args.skip:
            out.append(("transformers generate_batch(), fp32", lambda ids, t: hf("generate_batch", ids)))
    for dtype, key in (("float32", "fp32"), ("bfloat16", "bf16")):
        if key not in args.skip:
            llm = LLM(dtype=dtype)
            out.append((f"slofleet LLM(dtype={dtype})", lambda ids, t, e=llm: run_slofleet(e, ids, t)))
    if "defaults" not in args.skip or args.speculative:
        llm = LLM()
        HELD.update(weights=weight_bytes(llm.engine.runner.model), kv=kv_token_bytes(llm.engine.runner))
        name = f"slofleet LLM() defaults ({str(llm.engine.runner.dtype).removeprefix('torch.')})"
        out.append((name, lambda ids, t, e=llm, n=name: run_slofleet(e, ids, t, n)))
    if args.speculative:
        spec = LLM(num_speculative_tokens=args.speculative)
        name = f"slofleet LLM(num_speculative_tokens={args.speculative})"
        out.append((name, lambda ids, t, e=spec, n=name: run_slofleet(e, ids, t, n)))
        out += [(f"{name} [quote]", lambda ids, t, e=e, n=f"{name} [quote]": run_slofleet(e, ids, t, n))
                for name, e in ((out[-2][0], llm), (out[-1][0], spec))]
    if "llama.cpp" not in args.skip:
        try:
            from llama_cpp import Llama
            gguf = Llama(str(loader.embedded_gguf()), n_ctx=2048, n_threads=torch.get_num_threads(), verbose=False)
            out.append(("llama.cpp sequential, GGUF Q4_1", lambda ids, t: run_llama_cpp(gguf, ids, t)))
        except ImportError:
            log("llama-cpp-python not installed: llama.cpp row skipped")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip", nargs="*", default=[],
                    help="systems to skip: generate, generate_batch, fp32, bf16, defaults, llama.cpp")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="also LLM(num_speculative_tokens=K) beside LLM() defaults, on this and a quoting workload")
    args = ap.parse_args()
    from slofleet.engine import loader

    tok = loader.load_tokenizer(loader.resolve("default"))
    seeds = itertools.count()

    def workload(name: str = "") -> tuple[list[list[int]], list[str]]:
        texts = prompts(next(seeds), quote=name.endswith("[quote]"))
        return chat_ids(tok, texts), texts

    ids, _ = workload()
    log(f"workload: {len(ids)} prompts, ~{sum(map(len, ids))} prompt tokens "
        f"({min(map(len, ids))}-{max(map(len, ids))}), {OUT_TOKENS} output tokens each")
    table = systems(args)
    for name, fn in table:
        fn(*workload(name))  # warm-up, not timed, on prompts of its own
    rates: dict[str, list[float]] = {name: [] for name, _ in table}
    fractions: dict[str, list[float]] = {name: [] for name, _ in table}
    of_torch: dict[str, list[float]] = {name: [] for name, _ in table}
    stolen: dict[str, list[float]] = {name: [] for name, _ in table}
    gemm: list[dict[str, dict[str, float]]] = []
    for i in range(args.runs):
        gemm.append(gemm_rates())
        for name, fn in table:
            ids, texts = workload(name)
            cpu0, t0 = cpu_jiffies(), time.perf_counter()
            n = fn(ids, texts)
            dt = time.perf_counter() - t0
            stolen[name].append(stolen_since(cpu0))
            rates[name].append(n / dt)
            fractions[name].append(limit_seconds(gemm[-1], sum(map(len, ids))) / dt)
            of_torch[name].append(limit_seconds(torch_only(gemm[-1]), sum(map(len, ids))) / dt)
            log(f"{name}: run {i + 1}/{args.runs}: {rates[name][-1]:.1f} tok/s, {fractions[name][-1]:.0%} of limit, "
                f"{stolen[name][-1]:.1%} of CPU time stolen")
    print(versions())
    print("GEMM GFLOP/s (median of rounds):", "; ".join(
        f"{shape} " + ", ".join(f"{kind} {statistics.median(g[shape][kind] for g in gemm):.0f}"
                                for kind in gemm[0][shape]) for shape in GEMM_SHAPES))
    limit = statistics.median(N_PROMPTS * OUT_TOKENS / limit_seconds(g, sum(map(len, ids))) for g in gemm)
    print(f"FLOP limit of the workload: {limit:.1f} tok/s (at the last prompts' {sum(map(len, ids))} prompt tokens)")
    torch_limit = statistics.median(N_PROMPTS * OUT_TOKENS / limit_seconds(torch_only(g), sum(map(len, ids)))
                                    for g in gemm)
    print(f"  with torch's GEMMs only (the engine's kernels left out): {torch_limit:.1f} tok/s")
    # where no LLM() ran: bf16 weights, and a bf16 cache of the embedded model's 30 layers of 3 KV heads of 64
    gbps, held, kv = read_gbps(), HELD.get("weights", int(DECODE_FLOP)), HELD.get("kv", 2 * 30 * 3 * 64 * 2)
    prompt_tokens = sum(map(len, ids))
    floor = statistics.median(N_PROMPTS * OUT_TOKENS / floor_seconds(g, prompt_tokens, gbps, held, kv) for g in gemm)
    print(f"memory floor: a decode step reads the {held / 1e6:.0f} MB of weights LLM() holds and its rows' KV cache "
          f"({statistics.mean(decode_kv_bytes(prompt_tokens, kv)) / 1e6:.0f} MB on average), at {gbps:.1f} GB/s: "
          f"an engine is bound to {floor:.1f} tok/s, {floor / limit:.0%} of the FLOP limit")
    base = statistics.median(rates.get("transformers generate_batch(), fp32", [0])) or None
    print(f"{'system':45s} {'tok/s (median)':>15s} {'x generate_batch':>17s} {'of limit':>9s} {'of torch limit':>15s} "
          f"{'stolen':>7s}")
    for name, r in rates.items():
        rate = statistics.median(r)
        ratio = f"{rate / base:.2f}x" if base else "-"
        print(f"{name:45s} {rate:15.1f} {ratio:>17s} {statistics.median(fractions[name]):9.0%} "
              f"{statistics.median(of_torch[name]):15.0%} {statistics.median(stolen[name]):7.1%}")
    if args.speculative:
        names = [name for name in rates if "LLM() defaults" in name or "num_speculative_tokens" in name]
        for off, on in (names[:2], names[2:]):
            steps, cpu = ([statistics.median(x[i] for x in STEPS[n]) for n in (off, on)] for i in (0, 3))
            drafted, accepted = (sum(x[i] for x in STEPS[on]) for i in (1, 2))
            print(f"n-gram drafts on / off{' [quote]' if '[quote]' in on else ''}: "
                  f"{statistics.median(rates[on]) / statistics.median(rates[off]):.2f}x tok/s, "
                  f"{cpu[0] / cpu[1]:.2f}x tokens per CPU second, engine steps per run {steps[0]:.0f} -> "
                  f"{steps[1]:.0f}, {accepted / max(1, drafted):.0%} of {drafted:.0f} draft tokens accepted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
