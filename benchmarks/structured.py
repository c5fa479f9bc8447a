"""Structured-output overhead: a batch of 16 with half its rows under a JSON schema, beside the same batch free.

Both runs decode the same 16 chat prompts, greedy, a fixed number of tokens (EOS ignored, so every row runs to the
end and the batch stays 16 wide; a constrained row whose grammar is done may only emit EOS, which still costs its
mask every step). The schema asks for a long array of small objects, so the grammar stays busy for the whole run.
Runs alternate (free, constrained, then constrained, free, ...) so the machine's drift and any cost of going
first move both alike; the table gives the median
tokens/s of each and their ratio (the issue's bar: >= 0.9).

    .venv/bin/python benchmarks/structured.py [--runs 3] [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from slofleet.engine.engine import LLMEngine
from slofleet.engine.sampling_params import SamplingParams
from slofleet.engine.structured import Constraint

BATCH = 16
SCHEMA = {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "tag": {"type": "string", "enum": ["a", "b", "c"]}},
    "required": ["id", "tag"], "additionalProperties": False}}


def one_run(engine: LLMEngine, run: int, constrained: bool, tokens: int) -> float:
    """Tokens per second of one batch; prompts differ per run so the prefix cache serves none of them."""
    reqs = []
    for i in range(BATCH):
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Run {run}, row {i}: list {10 + i} records as JSON."}],
            add_generation_prompt=True, tokenize=True, return_dict=False)
        c = Constraint(kind="json", spec=json.dumps(SCHEMA)) if constrained and i % 2 else None
        reqs.append(engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                                              structured=c)))
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return sum(len(r.output_token_ids) for r in reqs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    engine = LLMEngine(model="default", max_num_seqs=BATCH)
    one_run(engine, -1, True, 4)  # warm-up: loads xgrammar, compiles the schema (cached from here on)
    free, cons = [], []
    for run in range(args.runs):  # each goes first every other round: the first of a pair ran slower here
        for constrained in (run % 2 == 1, run % 2 == 0):
            (cons if constrained else free).append(one_run(engine, 2 * run + constrained, constrained, args.tokens))
    f, c = statistics.median(free), statistics.median(cons)
    print(f"batch {BATCH}, {args.tokens} tokens per row, {args.runs} runs each (median tokens/s)")
    print(f"{'unconstrained':>16} {'half under schema':>18} {'ratio':>7}")
    print(f"{f:16.1f} {c:18.1f} {c / f:7.3f}")


if __name__ == "__main__":
    main()
