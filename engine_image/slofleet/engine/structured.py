"""Structured outputs: a request's output constrained by a JSON schema, a regex, a choice or a grammar.

xgrammar compiles each constraint into a grammar over the model's vocabulary (its compiler caches by constraint,
so the same schema compiles once). The server compiles before it queues the request, in a worker thread
(`Grammars.check`), so a schema that cannot compile is a 400 and a slow one never holds up the step loop; the
sampler then only fetches the cached grammar, keeps one matcher per request, writes the matcher's allowed tokens
into a bitmask row and masks that row's logits, so constrained and free rows share the batch. A constrained row
never drafts (speculative.can_draft): each step advances its matcher by exactly the one token it sampled.

xgrammar silently ignores some JSON-schema keywords; a schema using one is refused by name rather than served
output that does not validate."""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from .errors import InvalidRequest

if TYPE_CHECKING:
    from .request import Request

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]
log = logging.getLogger("slofleet.engine.structured")
KINDS: tuple[str, ...] = ("json", "json_object", "regex", "choice", "grammar")
# Keywords that change what validates but that xgrammar does not enforce: refused, never silently dropped.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentSchemas", "dependentRequired", "dependencies", "contains", "minContains",
    "maxContains", "multipleOf", "propertyNames", "unevaluatedProperties", "unevaluatedItems", "$dynamicRef",
    "$recursiveRef", "patternProperties"})
SCHEMA_CHILDREN = ("properties", "$defs", "definitions")  # keywords whose values map names to schemas
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_VALUES = ("items", "additionalProperties")


@dataclass(frozen=True, slots=True, kw_only=True)
class Constraint:
    """What a request's output must match. `spec`: the schema (JSON text), regex, grammar (EBNF as xgrammar takes
    it) or the choices (a JSON list of strings); unused for json_object."""
    kind: Kind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @classmethod
    def of(cls, value: Constraint | dict | None) -> Constraint | None:
        """From itself or its dict (SamplingParams as asdict() carries it between engines)."""
        return cls(**value) if isinstance(value, dict) else value


def schema_problem(schema, where: str = "#") -> str | None:
    """The first part of a JSON schema that constrained decoding would not enforce, as a phrase naming it."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where} must be an object (a schema) or a boolean, got {type(schema).__name__}"
    bad = sorted(UNSUPPORTED_KEYWORDS & schema.keys())
    if bad:
        return f"{where} uses {bad[0]!r}, which constrained decoding does not support"
    if schema.get("uniqueItems") is True:
        return f"{where} uses 'uniqueItems', which constrained decoding does not support"
    for key in SCHEMA_CHILDREN:
        for name, sub in (schema.get(key) or {}).items():
            if (msg := schema_problem(sub, f"{where}/{key}/{name}")) is not None:
                return msg
    for key in SCHEMA_LISTS:
        for i, sub in enumerate(schema.get(key) or []):
            if (msg := schema_problem(sub, f"{where}/{key}/{i}")) is not None:
                return msg
    for key in SCHEMA_VALUES:
        if key in schema and (msg := schema_problem(schema[key], f"{where}/{key}")) is not None:
            return msg
    return None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly the choices: each a JSON-escaped literal, which EBNF reads, with
    non-ASCII characters kept raw (EBNF takes no surrogate pairs)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(e: Exception) -> str:
    """xgrammar's message without its source location prefix ("[time] file.cc:line: ")."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class Grammars:
    """The compiler (one per engine: vocabulary-bound) and each running request's matcher."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self.xgr = self.info = self.built = None  # built on first use: an engine nobody constrains never pays it
        self.matchers: dict[str, object] = {}  # by request id; touched by the engine thread only
        self.lock = threading.Lock()  # the first compile may come from the server's thread and the engine's at once

    @property
    def compiler(self):
        with self.lock:
            if self.built is None:
                import xgrammar as xgr  # the engine extra's
                self.info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=sorted(self.stop_ids))
                self.xgr, self.built = xgr, xgr.GrammarCompiler(self.info, max_threads=2)
            return self.built

    def compile(self, c: Constraint):
        """The compiled grammar (from the compiler's cache after the first time); InvalidRequest naming the part
        that cannot compile."""
        try:
            if c.kind == "json_object":
                return self.compiler.compile_builtin_json_grammar()
            if c.kind == "json":
                msg = schema_problem(json.loads(c.spec))
                if msg:
                    raise InvalidRequest(f"json schema: {msg}")
                return self.compiler.compile_json_schema(c.spec, any_whitespace=False, strict_mode=True)
            if c.kind == "regex":
                return self.compiler.compile_regex(c.spec)
            if c.kind == "choice":
                return self.compiler.compile_grammar(choice_grammar(json.loads(c.spec)))
            return self.compiler.compile_grammar(c.spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequest(f"{c.kind} constraint does not compile: {_first_line(e)}") from None

    def matcher(self, req: Request):
        """The request's matcher, made on its first constrained step from the tokens it already holds (a decode
        engine continues a first token that the prefill engine sampled under the same constraint)."""
        m = self.matchers.get(req.request_id)
        if m is None:
            grammar = self.compile(req.params.structured)
            m = self.xgr.GrammarMatcher(grammar)
            for tok in req.output_token_ids:
                m.accept_token(tok)
            self.matchers[req.request_id] = m
        return m

    def forget(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
        """Set to -inf, in rows of float32 CPU logits, every token the row's grammar does not allow next. A row
        whose grammar is done (it took a stop token that ignore_eos let through) may only stop again."""
        self.compiler  # noqa: B018 -- built: self.xgr and self.info are set from here on
        bitmask = self.xgr.allocate_token_bitmask(len(rows), self.info.vocab_size)  # all allowed
        for j, req in enumerate(reqs):
            try:  # one request's grammar fault must not fail the batch's step
                m = self.matcher(req)
                if m.is_terminated():
                    bitmask[j] = self.stop_row()
                else:
                    m.fill_next_token_bitmask(bitmask, j)
            except (RuntimeError, InvalidRequest) as e:
                log.error("request %s: constraint not applied this step: %s", req.request_id, _first_line(e))
        width = min(logits.shape[1], self.info.vocab_size)
        sub = logits[rows, :width].contiguous()
        self.xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=width)
        logits[rows, :width] = sub

    def stop_row(self) -> torch.Tensor:
        """A bitmask row (32 tokens per int32, bit set: allowed) that allows the stop tokens only."""
        words = [0] * self.xgr.get_bitmask_shape(1, self.info.vocab_size)[1]
        for t in self.stop_ids:
            words[t // 32] |= 1 << (t % 32)
        return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)

    def advance(self, reqs: list[Request], tokens: list[int]) -> None:
        """Each constrained row's matcher takes the token its row sampled."""
        for req, tok in zip(reqs, tokens):
            m = self.matchers.get(req.request_id)
            if m is not None and not m.is_terminated():
                m.accept_token(tok)
