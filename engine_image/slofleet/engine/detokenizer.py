"""Incremental, UTF-8-safe detokenization with stop strings that never leak partially into a stream."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


def decoder(tokenizer, skip_special: bool = True) -> Callable[[list[int]], str]:
    """ids -> text, without special tokens unless asked. A transformers fast tokenizer's decode only forwards to its
    Rust tokenizer (unless it cleans up spaces), at several times the cost of calling that directly, twice per token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special)
    return lambda ids: backend.decode(ids, skip_special_tokens=skip_special)


@dataclass
class Detokenizer:
    tokenizer: object
    stop: list[str] = field(default_factory=list)
    include_stop: bool = False
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # all text decoded so far (held-back tail included)
    emitted: int = 0  # characters of `text` already handed out
    prefix_offset: int = 0
    read_offset: int = 0
    skip_special: bool = True

    def __post_init__(self) -> None:
        self.decode = decoder(self.tokenizer, self.skip_special)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append one token; return (new text safe to emit, whether a stop string was hit)."""
        self.token_ids.append(token_id)
        # Decode a small window so byte-level merges and leading spaces come out right; a trailing
        # U+FFFD means the token ends inside a multi-byte character, so wait for the next one.
        prefix = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.token_ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return self._release()

    def _release(self) -> tuple[str, bool]:
        if self.stop:
            # Search from just before the unemitted text, so a stop spanning the boundary is found.
            start = max(0, self.emitted - max(len(s) for s in self.stop) + 1)
            hits = [(self.text.find(s, start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                end = i + len(s) if self.include_stop else i
                self.text = self.text[:end]
                return self._take(len(self.text)), True
            # Hold back a tail that could still grow into a stop string.
            hold = max(len(s) for s in self.stop) - 1
            return self._take(max(self.emitted, len(self.text) - hold)), False
        return self._take(len(self.text)), False

    def _take(self, upto: int) -> str:
        out = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return out

    def flush(self) -> str:
        """At the end of a request without a stop hit, the held-back tail is real output."""
        return self._take(len(self.text))
