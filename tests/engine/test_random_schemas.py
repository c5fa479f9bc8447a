"""Greedy output under random JSON schemas validates against them (jsonschema), and most of it ends by itself.

The schemas are drawn here from a seed chosen per run (printed; SCHEMA_SEED=... replays one): nested objects,
arrays, enums, `required`, anyOf, consts, bounded numbers and string patterns. CI draws SCHEMA_COUNT (default
16) and lets each run SCHEMA_MAX_TOKENS (default 256); the issue's figure is SCHEMA_COUNT=200
SCHEMA_MAX_TOKENS=512. Every reply that ends with stop must validate; at least 90% must end with stop."""
from __future__ import annotations

import json
import os
import random

import pytest

from slofleet.engine.sampling_params import SamplingParams
from slofleet.engine.structured import Constraint

pytestmark = pytest.mark.slow
jsonschema = pytest.importorskip("jsonschema", reason="pip install jsonschema (make install: the test extra)")

WORDS = ["name", "id", "city", "score", "tags", "items", "owner", "kind", "price", "active", "notes", "level",
         "color", "size", "date", "email", "user", "team", "count", "label"]
PATTERNS = [r"^[a-z]{1,8}$", r"^[A-Z]{2}-[0-9]{3}$", r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$", r"^(yes|no)$",
            r"^[a-z]+@[a-z]+\.com$"]


def leaf(rng: random.Random) -> dict:
    pick = rng.randrange(8)
    if pick == 0:
        return {"type": "string", "maxLength": rng.randint(3, 24)}
    if pick == 1:
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "small", "large", "n/a"], 3)}
    if pick == 2:
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if pick == 3:
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 1000)}
    if pick == 4:
        return {"type": "number"}
    if pick == 5:
        return {"type": "boolean"}
    if pick == 6:
        return {"const": rng.choice(["v1", 3, True])}
    return {"type": ["string", "null"], "maxLength": 12}


def schema(rng: random.Random, depth: int = 0) -> dict:
    pick = rng.random() if depth < 3 else 1.0
    if pick < 0.35 or depth == 0:
        names = rng.sample(WORDS, rng.randint(1, 4))
        props = {n: schema(rng, depth + 1) for n in names}
        out = {"type": "object", "properties": props, "required": [n for n in names if rng.random() < 0.7]}
        return {**out, "additionalProperties": False} if rng.random() < 0.8 else out
    if pick < 0.55:
        hi = rng.randint(1, 4)
        return {"type": "array", "items": schema(rng, depth + 1), "minItems": rng.randint(0, hi), "maxItems": hi}
    if pick < 0.65:
        return {"anyOf": [schema(rng, depth + 1), leaf(rng)]}
    return leaf(rng)


def run(engine, schemas: list[dict], max_tokens: int) -> list:
    reqs = []
    for s in schemas:
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Reply with one JSON value matching this JSON schema: {json.dumps(s)}"}],
            add_generation_prompt=True, tokenize=True, return_dict=False)
        params = SamplingParams(temperature=0, max_tokens=max_tokens,
                                structured=Constraint(kind="json", spec=json.dumps(s)))
        reqs.append(engine.add_request(prompt, params))
    while engine.has_unfinished():
        engine.step()
    return reqs


def test_random_schemas_validate():
    seed = int(os.environ.get("SCHEMA_SEED") or random.SystemRandom().randrange(2**32))
    count, max_tokens = int(os.environ.get("SCHEMA_COUNT", 16)), int(os.environ.get("SCHEMA_MAX_TOKENS", 256))
    rng = random.Random(seed)
    schemas = [schema(rng) for _ in range(count)]
    print(f"SCHEMA_SEED={seed} SCHEMA_COUNT={count} SCHEMA_MAX_TOKENS={max_tokens}")
    from slofleet.engine.engine import LLMEngine
    eng = LLMEngine(model="default", max_num_seqs=64)
    reqs = run(eng, schemas, max_tokens)
    stopped = 0
    for s, r in zip(schemas, reqs):
        text = eng.tokenizer.decode([t for t in r.output_token_ids if t not in eng.eos_ids])
        if str(r.finish_reason) != "stop":
            print(f"ran on ({r.finish_reason}, {len(r.output_token_ids)} tokens): {json.dumps(s)}\n  {text[-120:]!r}")
            continue
        stopped += 1
        jsonschema.validate(json.loads(text), s)  # raises, naming the schema path, on an invalid reply
    print(f"{stopped}/{count} ended with stop within {max_tokens} tokens (seed {seed})")
    # About 1 schema in 11 makes this small model run on inside an unbounded pattern or number: the 90% is
    # judged on a large draw; a CI-sized one allows the binomial spread around that rate (5 of 16 fail ~0.2%).
    need = 0.9 if count >= 100 else 0.65
    assert stopped >= need * count, f"only {stopped}/{count} ended with stop (SCHEMA_SEED={seed})"
