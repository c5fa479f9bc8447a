"""Per-request sampling settings, with vLLM's names so users' habits carry over.

`problem(name, value)` is the one place that knows each field's type and range: SamplingParams checks itself
with it (the offline API and the prefill endpoint build it directly), and the OpenAI models in server/protocol.py
call it per field, so a bad value is refused with the same words before it can reach the engine thread."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

from .errors import InvalidRequest
from .structured import Constraint

INT32_MAX = 2**31 - 1
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes (a negative seed wraps around)
MAX_LOGPROBS = 20  # vLLM's limit
MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 256
MAX_N = 128  # samples of one request (n, best_of)
MAX_LOGIT_BIAS = 300  # entries in one logit_bias map (OpenAI's limit)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads turns an escaped lone surrogate into one; no tokenizer takes it

# name: (lowest, highest, lowest excluded); all finite.
FLOAT_RANGES = {"temperature": (0, 2, False), "top_p": (0, 1, True), "min_p": (0, 1, False),
                "presence_penalty": (-2, 2, False), "frequency_penalty": (-2, 2, False),
                # the floor keeps logits / penalty finite in float32 (a tiny penalty made them inf, then NaN)
                "repetition_penalty": (0.01, 10, False)}
INT_RANGES = {"n": (1, MAX_N), "top_k": (-1, INT32_MAX), "max_tokens": (1, INT32_MAX), "min_tokens": (0, INT32_MAX),
              "seed": SEED_RANGE, "logprobs": (0, MAX_LOGPROBS)}
OPTIONAL = {"max_tokens", "seed", "logprobs"}
BOOLS = {"include_stop_str_in_output", "ignore_eos", "skip_special_tokens"}


def unicode_problem(s: str) -> str | None:
    m = SURROGATE.search(s)
    return None if m is None else (f"contains a lone UTF-16 surrogate (\\u{ord(m.group()):04x}) at character "
                                   f"{m.start()}: send valid Unicode")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _range_problem(value, lo, hi, lo_open=False) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if (lo < value if lo_open else lo <= value) and value <= hi:
        return None
    if hi == INT32_MAX and value < lo:
        return f"must be >= {lo}, got {value}"
    return f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}"


def _stop_problem(value) -> str | None:
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        return f"must be a string or a list of at most {MAX_STOP} strings"
    if len(value) > MAX_STOP:
        return f"takes at most {MAX_STOP} strings, got {len(value)}"
    if not all(value):
        return "must not contain an empty string (it would stop at once)"
    return next(filter(None, map(unicode_problem, value)), None)


def _stop_token_ids_problem(value) -> str | None:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return "must be a list of integer token ids"
    if len(value) > MAX_STOP_TOKEN_IDS:
        return f"takes at most {MAX_STOP_TOKEN_IDS} token ids, got {len(value)}"
    bad = [t for t in value if not 0 <= t <= INT32_MAX]
    return f"must be token ids >= 0, got {bad[:5]}" if bad else None


def _logit_bias_problem(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return 'must be a map of token id to bias, e.g. {"50256": -100}'
    if len(value) > MAX_LOGIT_BIAS:
        return f"takes at most {MAX_LOGIT_BIAS} entries, got {len(value)}"
    lo, hi = LOGIT_BIAS_RANGE
    for key, bias in value.items():
        tok = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.isascii() and key.isdigit():
            tok = int(key)
        if tok is None or tok > INT32_MAX:
            return f"keys must be token ids (integers >= 0 as strings), got {str(key)[:40]!a}"
        if not _is_number(bias) or not (isinstance(bias, int) or math.isfinite(bias)) or not lo <= bias <= hi:
            return f"values must be numbers in [{lo:g}, {hi:g}], got {bias!a} for token {tok}"
    return None


def problem(name: str, value) -> str | None:
    """What is wrong with `value` for SamplingParams field `name`, as a phrase for the user; None if nothing."""
    if value is None and name in OPTIONAL:
        return None
    if name in FLOAT_RANGES:
        return _range_problem(value, *FLOAT_RANGES[name]) if _is_number(value) else "must be a number"
    if name in INT_RANGES:
        if not isinstance(value, int) or isinstance(value, bool):
            return "must be an integer" + (" or null" if name in OPTIONAL else "")
        msg = _range_problem(value, *INT_RANGES[name])
        return f"must be -1 or 0 (off) or a count >= 1, got {value}" if msg and name == "top_k" else msg
    if name in BOOLS:
        return None if isinstance(value, bool) else "must be a boolean (true or false)"
    if name == "stop":
        return _stop_problem(value)
    if name == "stop_token_ids":
        return _stop_token_ids_problem(value)
    if name == "logit_bias":
        return _logit_bias_problem(value)
    return None


def order_problem(min_tokens, max_tokens) -> str | None:
    if max_tokens is not None and min_tokens > max_tokens:
        return f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})"
    return None


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off (the sampler filters only when top_k > 0)
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N log-probabilities per generated token
    n: int = 1  # samples from one prompt, which share its KV blocks (engine.add_request forks them)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)
    skip_special_tokens: bool = True  # leave special tokens (other than a stopping EOS) out of the text
    structured: Constraint | None = None  # what the output must match (structured.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.structured = Constraint.of(self.structured)
        for f in fields(self):
            msg = problem(f.name, getattr(self, f.name))
            if msg:
                raise InvalidRequest(f"{f.name} {msg}", f.name)
            if f.name in FLOAT_RANGES:  # the sampler builds tensors from these: an int one would make them Long
                setattr(self, f.name, float(getattr(self, f.name)))
        if self.logit_bias:  # JSON (an HTTP hand-off of these fields) spells the ids as strings
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        msg = order_problem(self.min_tokens, self.max_tokens)
        if msg:
            raise InvalidRequest(msg, "min_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1
