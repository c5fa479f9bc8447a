"""One-command GPU check of the Triton path (issue 6): `python benchmarks/gpu_check.py` on a CUDA machine.

Needs torch, triton and transformers only (no fastapi/pydantic/gguf, no download): it builds a randomly
initialised Llama-family model (16 layers, hidden 2048, 32/8 heads) and saves it with a word-level
tokenizer, then
  1. compares teacher-forced logits of the engine, Triton path vs torch path:
     fp32: relative L2 difference <= 1e-3;
     bf16: the Triton path's error against the fp32 torch logits <= 1.25x the torch bf16 path's error + 1e-3
     (greedy tokens are not comparable in bf16, so the torch bf16 path's own rounding sets the bar),
  2. measures paged-attention decode bandwidth on long-context batches against the card's memory bandwidth,
  3. runs 256 requests (512 prompt + 256 output tokens, bf16, ignore_eos, greedy) through the engine (Triton
     + CUDA graphs) and through transformers `generate_batch()`,
  4. runs tests/kernels compiled (TRITON_INTERPRET=0; a small runner stands in where pytest is missing),
and prints one table.
`--smoke` runs a tiny version of everything on the CPU under the Triton interpreter (to check the script).

On a lent GPU machine, as one run (about 5-7 minutes; the full log, with the profile, comes back as a file):
    python benchmarks/gpu_check.py > $OUT/gpu_check.log 2>&1; rc=$?; tail -c 11000 $OUT/gpu_check.log; exit $rc
"""
from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import itertools
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
import types
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "engine_image"))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "engine_image"), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402 (torch does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # --smoke: must precede the first `import triton`

# Spec HBM bandwidth (bytes/s) by device-name substring; the check also measures a device-to-device copy.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40S": 0.864e12}


class Table:
    """Rows of (check, figure, target, verdict); a section that raises becomes an ERROR row, the rest still run."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, bool | None]] = []

    @contextmanager
    def section(self, name: str):
        try:
            yield
        except Exception as e:  # noqa: BLE001 (one device run: report and go on)
            traceback.print_exc()
            self.add(name, f"ERROR {type(e).__name__}: {str(e)[:120]}", "-", False)

    def add(self, check: str, figure: str, target: str, ok: bool | None) -> None:
        self.rows.append((check, figure, target, ok))
        print(f"  {check}: {figure}", flush=True)

    def ok(self) -> bool:
        return all(ok is not False for *_, ok in self.rows)

    def print(self, title: str) -> None:
        cols = [[r[0] for r in self.rows], [r[1] for r in self.rows], [r[2] for r in self.rows],
                ["PASS" if r[3] else "FAIL" if r[3] is False else "" for r in self.rows]]
        heads = ["check", "figure", "target", "verdict"]
        widths = [max([len(h)] + [len(c) for c in col]) for h, col in zip(heads, cols)]
        line = lambda cells: " | ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
        print(f"\n== {title}\n{line(heads)}\n{'-+-'.join('-' * w for w in widths)}")
        for row in zip(*cols):
            print(line(row))


# -- 1. kernel tests, compiled --------------------------------------------------------------------------------
def kernel_tests(root: Path) -> tuple[int, int, float]:
    t0 = time.monotonic()
    env = dict(os.environ, TRITON_INTERPRET="0")
    if importlib.util.find_spec("pytest") is not None:
        done = subprocess.run([sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider"],
                              cwd=root, env=env, capture_output=True, text=True)
        print(done.stdout[-4000:], done.stderr[-2000:], flush=True)
        passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", done.stdout)) else 0
        failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|error)", done.stdout))
        return passed, failed + (done.returncode not in (0, 1)), time.monotonic() - t0
    return (*tests_without_pytest(root), time.monotonic() - t0)


def tests_without_pytest(root: Path) -> tuple[int, int]:
    """pytest is not on the GPU machine: expand the tests' parametrize marks and call each case."""
    class Mark:
        @staticmethod
        def parametrize(names: str, values: list):
            def deco(fn):
                fn.__dict__.setdefault("grid", []).append((names, values))
                return fn
            return deco
    sys.modules.setdefault("pytest", types.SimpleNamespace(mark=Mark()))
    sys.path.insert(0, str(root))
    passed = failed = 0
    for name in sorted(p.stem for p in (root / "tests" / "kernels").glob("test_*.py")):
        mod = importlib.import_module(f"tests.kernels.{name}")
        for test, fn in [(k, v) for k, v in vars(mod).items() if k.startswith("test_") and callable(v)]:
            grids = [[dict(zip([n.strip() for n in names.split(",")], v if "," in names else (v,))) for v in values]
                     for names, values in getattr(fn, "grid", [])]
            for combo in itertools.product(*grids):
                kwargs = {k: v for d in combo for k, v in d.items()}
                try:
                    fn(**kwargs)
                    passed += 1
                except Exception:  # noqa: BLE001
                    failed += 1
                    print(f"FAILED {name}::{test}{kwargs}", flush=True)
                    traceback.print_exc()
    return passed, failed


# -- the model and the engine ---------------------------------------------------------------------------------
def build_model(path: Path, s: dict, device: torch.device) -> None:
    """Random Llama weights (bf16) and a word-level tokenizer: the engine core needs one, no download can give one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    cfg = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=0)  # no EOS anywhere: generate_batch runs every request to max_new_tokens
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(path)
    del model
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(s["vocab"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)


def make_engine(path: Path, s: dict, device: torch.device):
    from slofleet.engine.config import EngineConfig
    from slofleet.engine.engine import LLMEngine
    return LLMEngine(EngineConfig(model=str(path), dtype="bfloat16", device=device.type, block_size=16,
                                  kv_cache_memory_gb=s["kv_gb"], max_num_seqs=s["requests"],
                                  max_num_batched_tokens=s["batched_tokens"], max_model_len=s["max_len"],
                                  enable_prefix_caching=False, max_waiting_requests=4 * s["requests"]))


def use_backend(engine, kind: str, graph_batch: int = 0) -> None:
    """Point every layer at one backend and run steps the way the runner should once wired (see cuda_graphs.py)."""
    from slofleet.engine.backends.torch.attention import TorchAttention
    from slofleet.engine.backends.triton.attention import TritonAttention
    from slofleet.engine.backends.triton.cuda_graphs import maybe_capture
    r = engine.runner
    attn = TritonAttention(r.block_size) if kind == "triton" else TorchAttention(r.block_size)
    r.attention = r.ops.attention = attn  # the layers read it from their ops
    if hasattr(r, "graphs"):
        r.graphs = None  # graphs the runner captured itself would bypass the backend chosen here
    graphs = None
    if graph_batch:
        max_blocks = -(-engine.max_model_len // r.block_size)
        graphs = maybe_capture(r.model, r.kv_caches, attn, graph_batch, max_blocks, engine.max_model_len, r.device)

    @torch.inference_mode()
    def execute(batch):
        input_ids, positions, meta, rows = r.prepare(batch)
        if graphs is not None and graphs.can_run(meta):
            return graphs.run(input_ids, positions, meta)
        return r.model(input_ids, positions, r.kv_caches, meta, rows)
    r.execute = execute


def set_dtype(engine, dtype: torch.dtype) -> None:
    r = engine.runner
    blocks = r.kv_caches[0][0].shape[0]
    r.kv_caches = []
    r.model.to(dtype)
    r.dtype = dtype
    if r.device.type == "cuda":
        torch.cuda.empty_cache()
    r.allocate_kv(blocks)


# -- 2. teacher-forced logits ---------------------------------------------------------------------------------
def teacher_forced_logits(path: Path, s: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The same token sequences, fed in the same steps (a prefill, then decodes with a 7-token chunk every 4th
    step, so batches mix), under each backend and dtype; logits at the last token of every sequence, every step."""
    from slofleet.engine.request import Request
    from slofleet.engine.sampling_params import SamplingParams
    engine = make_engine(path, s, device)
    rng = random.Random(0)
    n, length = s["tf_seqs"], engine.max_model_len
    seqs = [[rng.randrange(1, s["vocab"]) for _ in range(length)] for _ in range(n)]
    prefill = [rng.randint(length // 8, length // 2) for _ in range(n)]

    def run() -> torch.Tensor:
        r = engine.runner  # noqa: F821 (run() is called before `del engine` below)
        per = -(-length // r.block_size)
        pool = list(range(r.kv_caches[0][0].shape[0]))
        random.Random(1).shuffle(pool)
        tables = [pool[i * per:(i + 1) * per] for i in range(n)]
        reqs = [Request(request_id=f"tf{i}", prompt_token_ids=ids, params=SamplingParams(max_tokens=1), max_tokens=1)
                for i, ids in enumerate(seqs)]
        out = []
        for step in range(s["tf_steps"] + 1):
            sizes = [prefill[i] if step == 0 else 7 if step % 4 == 0 and i == step // 4 % n else 1 for i in range(n)]
            out.append(r.execute([(req, k, t) for req, k, t in zip(reqs, sizes, tables)]).float().clone())
            for req, k in zip(reqs, sizes):
                req.num_computed_tokens += k
        return torch.cat(out).cpu()

    got = {}
    use_backend(engine, "torch")
    got["torch_bf16"] = run()
    use_backend(engine, "triton", graph_batch=n + 2)  # decode steps replay a padded graph
    got["triton_bf16"] = run()
    use_backend(engine, "torch")  # drops the graphs, which hold the bf16 caches
    set_dtype(engine, torch.float32)
    got["torch_fp32"] = run()
    use_backend(engine, "triton")
    got["triton_fp32"] = run()
    del engine
    gc.collect()
    return got


# -- 3. decode bandwidth --------------------------------------------------------------------------------------
def timed(fn, device: torch.device, iters: int = 20) -> float:
    """Seconds per call."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def kernel_registers() -> str:
    """Registers, spills and shared memory of each compiled attention kernel: what bounds occupancy."""
    from slofleet.engine.backends.triton import attention as ta
    lines = []
    for fn in (ta._store_kv, ta._paged_attention, ta._split_kv_decode, ta._merge_splits):
        try:
            for cache in fn.device_caches.values():
                for k in cache[0].values():
                    lines.append(f"  {fn.fn.__name__}: regs={k.n_regs} spills={k.n_spills} "
                                 f"shared={k.metadata.shared} warps={k.metadata.num_warps}")
        except Exception as e:  # noqa: BLE001 (metadata layout differs across triton versions)
            lines.append(f"  {getattr(fn, '__name__', fn)}: no metadata ({type(e).__name__})")
    return "\n".join(lines)


def decode_bandwidth(s: dict, device: torch.device) -> list[dict]:
    """One decode step of attention (store + attend + merge) over long contexts; bytes = K and V read once."""
    from slofleet.engine.backends.ops import AttentionMetadata
    from slofleet.engine.backends.triton.attention import TritonAttention
    heads, kvh, d, bs, dt = s["heads"], s["kv_heads"], s["hidden"] // s["heads"], 16, torch.bfloat16
    copy_src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    copy_bw = 2 * copy_src.numel() / timed(lambda: copy_dst.copy_(copy_src), device)  # noqa: F821 (timed at once)
    del copy_src, copy_dst
    rows: list[dict] = []
    for batch, ctx in s["bw"]:
        nb = batch * ctx // bs
        kc = torch.randn((nb, bs, kvh, d), device=device, dtype=dt)
        vc = torch.randn_like(kc)
        tables = torch.randperm(nb, device=device).view(batch, ctx // bs).int()
        meta = AttentionMetadata(tables[:, -1].long() * bs + (ctx - 1) % bs,
                                 torch.arange(batch + 1, dtype=torch.int32, device=device),
                                 torch.full((batch,), ctx, dtype=torch.int32, device=device), tables, 1, ctx,
                                 [1] * batch, [ctx] * batch)
        q = torch.randn((batch, heads, d), device=device, dtype=dt)
        k, v = (torch.randn((batch, kvh, d), device=device, dtype=dt) for _ in range(2))
        kv_bytes = 2 * kc.numel() * kc.element_size()
        seen = set()
        for policy in (True, False):
            attn = TritonAttention(bs)
            if not policy:
                attn.max_splits = 1
            splits = attn.num_splits(meta, batch, kvh)
            if splits in seen:
                continue
            seen.add(splits)
            fn = lambda: attn.forward(q, k, v, kc, vc, meta, d ** -0.5)  # noqa: E731, B023, F821 (timed at once)
            sec = timed(fn, device)
            row = dict(batch=batch, ctx=ctx, splits=splits, policy=policy, us=sec * 1e6,
                       bytes_per_s=kv_bytes / sec, copy_bytes_per_s=copy_bw)
            if policy and not rows and device.type == "cuda":
                row["profile"] = profile(fn) + "\n" + kernel_registers()
                row["sweep"] = sweep(attn, fn, device, kv_bytes)
            rows.append(row)
        del kc, vc
    return rows


def sweep(attn, fn, device: torch.device, kv_bytes: int) -> list[tuple[float, int, int]]:
    """Decode tile (keys per iteration) x warps, for tuning TritonAttention's defaults from this one run."""
    found, saved = [], (attn.decode_tile, attn.decode_warps)
    for tile in (32, 64, 128):
        for warps in (2, 4, 8):
            attn.decode_tile, attn.decode_warps = tile, warps
            try:
                found.append((kv_bytes / timed(fn, device) / 1e12, tile, warps))
            except Exception as e:  # noqa: BLE001 (e.g. out of shared memory: that point just drops out)
                print(f"sweep tile={tile} warps={warps}: {type(e).__name__}", flush=True)
    attn.decode_tile, attn.decode_warps = saved
    return sorted(found, reverse=True)


def profile(fn) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    return p.key_averages().table(sort_by="cuda_time_total", row_limit=8)


# -- 4. throughput --------------------------------------------------------------------------------------------
def summarise(tokens: int, wall: float, ttft: list[float], tpot: list[float]) -> dict:
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    return dict(tokens=tokens, wall=wall, tok_s=tokens / wall, ttft50=pct(ttft, 0.5), ttft99=pct(ttft, 0.99),
                tpot50=pct(tpot, 0.5))


def workload(s: dict) -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(1, s["vocab"]) for _ in range(s["prompt"])] for _ in range(s["requests"])]


def run_engine_workload(path: Path, s: dict, device: torch.device) -> dict:
    from slofleet.engine.sampling_params import SamplingParams
    engine = make_engine(path, s, device)
    use_backend(engine, "triton", graph_batch=s["requests"])
    prompts = workload(s)
    for p in prompts[:8]:  # warm up: compile the prefill and mixed-batch kernel variants
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    params = SamplingParams(temperature=0.0, max_tokens=s["output"], ignore_eos=True)
    t0 = time.monotonic()
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    wall = time.monotonic() - t0
    times = [r.timings() for r in reqs]
    out = summarise(sum(len(r.output_token_ids) for r in reqs), wall, [t["ttft_s"] for t in times],
                    [t["decode_s"] / (len(r.output_token_ids) - 1) for t, r in zip(times, reqs)
                     if len(r.output_token_ids) > 1])
    del engine
    gc.collect()
    return out


def run_hf_workload(path: Path, s: dict, device: torch.device) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    except TypeError:  # transformers 4.x
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.to(device, torch.bfloat16).eval()  # older versions may ignore the dtype keyword
    prompts = workload(s)
    gen = lambda n: GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)  # noqa: E731
    extra = {}
    if s.get("hf_blocks"):  # its cache is sized from free GPU memory by default; on a CPU that means all of RAM
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        extra["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=s["hf_blocks"], max_batch_tokens=256)
    model.generate_batch(inputs=prompts[:8], generation_config=gen(4), **extra)  # warm up
    t0 = time.perf_counter()
    try:
        res = model.generate_batch(inputs=prompts, generation_config=gen(s["output"]), record_timestamps=True, **extra)
    except TypeError:  # older generate_batch: no timestamps
        res = model.generate_batch(inputs=prompts, generation_config=gen(s["output"]), **extra)
    wall = time.perf_counter() - t0
    outs = list(res.values())
    stamps = [o for o in outs if getattr(o, "timestamps", None)]
    ttft = [o.timestamps[0] - o.created_time for o in stamps]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) for o in stamps if len(o.timestamps) > 1]
    out = summarise(sum(len(o.generated_tokens) for o in outs), wall, ttft, tpot)
    del model
    gc.collect()
    return out


SHAPES = {  # model, workload and bandwidth shapes: the real check and a CPU smoke run of the script
    "gpu": dict(layers=16, hidden=2048, heads=32, kv_heads=8, inter=8192, vocab=32000, requests=256, prompt=512,
                output=256, bw=[(32, 8192), (8, 32768), (128, 2048)], kv_gb=24.0, tf_seqs=6, tf_steps=48,
                max_len=1024, batched_tokens=8192),
    "smoke": dict(layers=2, hidden=64, heads=4, kv_heads=2, inter=128, vocab=512, requests=6, prompt=24, output=6,
                  bw=[(2, 128)], kv_gb=0.01, tf_seqs=3, tf_steps=6,
                  max_len=128, batched_tokens=64, hf_blocks=64),
}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run under the Triton interpreter")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: tests,logits,bandwidth,throughput")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    s = SHAPES["smoke" if args.smoke else "gpu"]
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    table = Table()
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke)"
    import transformers
    import triton
    print(f"device: {name}; torch {torch.__version__}, triton {triton.__version__}, "
          f"transformers {transformers.__version__}, python {sys.version.split()[0]}", flush=True)
    t_start = time.monotonic()

    with tempfile.TemporaryDirectory(prefix="slofleet-gpu-check-") as tmp:
        path = Path(tmp) / "model"
        t0 = time.monotonic()
        build_model(path, s, device)
        print(f"model built and saved in {time.monotonic() - t0:.0f}s", flush=True)

        if "logits" not in skip:
            with table.section("teacher-forced logits"):
                got = teacher_forced_logits(path, s, device)
                fp32 = rel_l2(got["triton_fp32"], got["torch_fp32"])
                table.add("logits fp32: Triton vs torch (rel L2)", f"{fp32:.2e}", "<= 1e-3", fp32 <= 1e-3)
                e_torch = rel_l2(got["torch_bf16"], got["torch_fp32"])
                e_triton = rel_l2(got["triton_bf16"], got["torch_fp32"])
                table.add("logits bf16: error vs fp32 (rel L2), Triton+graphs / torch",
                          f"{e_triton:.2e} / {e_torch:.2e}", "Triton <= 1.25x torch + 1e-3",
                          e_triton <= 1.25 * e_torch + 1e-3)
                agree = float((got["triton_bf16"].argmax(-1) == got["torch_bf16"].argmax(-1)).float().mean())
                table.add("argmax agreement bf16 Triton vs torch (info)", f"{agree:.1%}", "-", None)

        if "bandwidth" not in skip:
            with table.section("decode bandwidth"):
                peak = PEAK_BANDWIDTH.get(next((k for k in PEAK_BANDWIDTH if k in name), ""), 0.0)
                for row in decode_bandwidth(s, device):
                    frac = row["bytes_per_s"] / peak if peak else 0.0
                    table.add(f"paged decode B={row['batch']} ctx={row['ctx']} splits={row['splits']}",
                              f"{row['bytes_per_s'] / 1e12:.2f} TB/s ({frac:.0%} of {peak / 1e12:.1f} TB/s; "
                              f"copy {row['copy_bytes_per_s'] / 1e12:.2f} TB/s) {row['us']:.0f} us",
                              ">= 50% of peak" if row["ctx"] >= 8192 else "-",
                              frac >= 0.5 if peak and row["policy"] and row["ctx"] >= 8192 else None)
                    if row.get("profile"):
                        print(row["profile"], flush=True)
                    if row.get("sweep"):
                        best = row["sweep"][0]
                        print("decode tile/warps sweep (TB/s/tile/warps):",
                              ", ".join(f"{b:.2f}/{t}/{w}" for b, t, w in row["sweep"]), flush=True)
                        table.add(f"  best decode tile/warps at B={row['batch']} ctx={row['ctx']} (info)",
                                  f"{best[0]:.2f} TB/s with tile {best[1]}, {best[2]} warps", "-", None)

        if "throughput" not in skip:
            results = {}
            ours, theirs = "engine (Triton + CUDA graphs)", "transformers generate_batch"
            for label, runner in ((ours, run_engine_workload), (theirs, run_hf_workload)):
                with table.section(f"throughput: {label}"):
                    r = results[label] = runner(path, s, device)
                    table.add(f"{label}: output tok/s",
                              f"{r['tok_s']:.0f} ({r['tokens']} tokens in {r['wall']:.1f}s)", "-", None)
                    ttft = f"{r['ttft50'] * 1e3:.0f}/{r['ttft99'] * 1e3:.0f} ms"
                    table.add(f"{label}: TTFT p50/p99, TPOT p50", f"{ttft}, {r['tpot50'] * 1e3:.1f} ms", "-", None)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if len(results) == 2:
                ratio = results[ours]["tok_s"] / results[theirs]["tok_s"]
                table.add("engine / generate_batch output tok/s", f"{ratio:.2f}x", ">= 3x", ratio >= 3)

    # Last: compiling every test variant takes a minute or two, and the figures above matter more if time runs out.
    if "tests" not in skip and not args.smoke:
        with table.section("kernel tests (compiled)"):
            passed, failed, secs = kernel_tests(ROOT)
            table.add("kernel tests, compiled", f"{passed} passed, {failed} failed in {secs:.0f}s", "all pass",
                      failed == 0 and passed > 0)
    table.print(f"gpu_check on {name}, {time.monotonic() - t_start:.0f}s")
    return 0 if table.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
