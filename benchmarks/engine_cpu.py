"""Engine CPU benchmark: one fixed workload through transformers and slofleet, printed side by side.

Workload: 16 chat prompts of 20-300 words through the chat template, 32 output tokens each, greedy,
fixed length (EOS ignored). Each system runs it --runs times, in rounds of one run per system; the table
shows the median tokens/s and the ratio to transformers generate_batch(). llama.cpp (llama-cpp-python,
sequential, on the same GGUF) is included when installed.

    .venv/bin/python benchmarks/engine_cpu.py [--runs 3] [--skip generate]
"""
from __future__ import annotations

import argparse
import importlib.metadata as md
import platform
import random
import statistics
import sys
import time

import torch

WORDS = ("river mountain signal engine quiet garden window market theory planet music letter forest "
         "winter machine story bridge lantern harbor circuit memory ocean desert village candle rhythm").split()
N_PROMPTS, OUT_TOKENS = 16, 32


def prompts() -> list[str]:
    rng = random.Random(0)
    lengths = [round(20 + i * (300 - 20) / (N_PROMPTS - 1)) for i in range(N_PROMPTS)]
    rng.shuffle(lengths)
    return ["Summarise the following notes in one sentence: " + " ".join(rng.choice(WORDS) for _ in range(n))
            for n in lengths]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def chat_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts]


def timed(fn) -> float:
    t0 = time.perf_counter()
    n = fn()
    return n / (time.perf_counter() - t0)


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


def run_slofleet(engine, ids) -> int:
    from slofleet.engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
    engine.kv.pool.reset_cache()  # each run prefills from scratch, like the others
    reqs = [engine.add_request(x, params) for x in ids]
    while engine.has_unfinished():
        engine.step()
    return sum(len(r.output_token_ids) for r in reqs)


def run_llama_cpp(llm, texts) -> int:
    n = 0
    for t in texts:
        out = llm.create_chat_completion([{"role": "user", "content": t}], max_tokens=OUT_TOKENS, temperature=0)
        n += out["usage"]["completion_tokens"]
    return n


def versions() -> str:
    pkgs = ["torch", "transformers", "llama_cpp_python"]
    found = []
    for p in pkgs:
        try:
            found.append(f"{p} {md.version(p)}")
        except md.PackageNotFoundError:
            pass
    flags = open("/proc/cpuinfo").read()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return (f"python {platform.python_version()}; {'; '.join(found)}; cpu flags: {' '.join(isa)}; "
            f"threads {torch.get_num_threads()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--skip", nargs="*", default=[],
                    help="systems to skip: generate, generate_batch, fp32, bf16, llama.cpp")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from slofleet.engine import LLMEngine, loader

    path = loader.resolve("default")
    tok = loader.load_tokenizer(path)
    texts = prompts()
    ids = chat_ids(tok, texts)
    log(f"workload: {len(ids)} prompts, {sum(map(len, ids))} prompt tokens "
        f"({min(map(len, ids))}-{max(map(len, ids))}), {OUT_TOKENS} output tokens each")
    systems = []
    if {"generate", "generate_batch"} - set(args.skip):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if "generate" not in args.skip:
            systems.append(("transformers generate() one by one, fp32", lambda: run_hf_generate(hf, ids)))
        if "generate_batch" not in args.skip:
            systems.append(("transformers generate_batch(), fp32", lambda: run_hf_generate_batch(hf, ids)))
    for dtype, key in (("float32", "fp32"), ("bfloat16", "bf16")):
        if key not in args.skip:
            engine = LLMEngine(dtype=dtype, max_num_batched_tokens=2048)
            systems.append((f"slofleet, {key}", lambda e=engine: run_slofleet(e, ids)))
    if "llama.cpp" not in args.skip:
        try:
            from llama_cpp import Llama
            llm = Llama(str(loader.embedded_gguf()), n_ctx=2048, n_threads=torch.get_num_threads(), verbose=False)
            systems.append(("llama.cpp sequential, GGUF Q4_1", lambda: run_llama_cpp(llm, texts)))
        except ImportError:
            log("llama-cpp-python not installed: llama.cpp row skipped")

    for _, fn in systems:
        fn()  # warm-up, not timed
    # Rounds of one run per system rather than all runs of one system in a row: this machine's speed drifts over
    # minutes, and a drift should move every system's figure alike instead of favouring the one that ran last.
    rates: dict[str, list[float]] = {name: [] for name, _ in systems}
    for i in range(args.runs):
        for name, fn in systems:
            rates[name].append(timed(fn))
            log(f"{name}: run {i + 1}/{args.runs}: {rates[name][-1]:.1f} tok/s")
    results = {name: statistics.median(r) for name, r in rates.items()}
    print(versions())
    base = results.get("transformers generate_batch(), fp32")
    print(f"{'system':45s} {'tok/s (median)':>15s} {'x generate_batch':>17s}")
    for name, rate in results.items():
        ratio = f"{rate / base:.2f}x" if base else "-"
        print(f"{name:45s} {rate:15.1f} {ratio:>17s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
