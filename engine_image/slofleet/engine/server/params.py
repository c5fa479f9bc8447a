"""Which of vLLM's and OpenAI's request parameters this server takes, and why it refuses the others by name.

One table for the refusals, read by the request models (protocol.py) before their unknown-field check, so that a
parameter users do send gets its reason rather than "unknown field". docs/api-parameters.md lists both sides."""
from __future__ import annotations

from dataclasses import dataclass

# Sampling parameters taken on /v1/completions and /v1/chat/completions (SamplingParams' names).
TAKEN = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
         "repetition_penalty", "max_tokens", "min_tokens", "seed", "stop", "stop_token_ids", "ignore_eos",
         "include_stop_str_in_output", "skip_special_tokens", "logit_bias", "logprobs", "echo")


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    why: str
    harmless: tuple = (None, False)  # values that ask for nothing, taken silently (clients send defaults)


REFUSED = {
    "use_beam_search": Refused(why="beam search is not implemented; use n or best_of"),
    "length_penalty": Refused(why="applies to beam search, which is not implemented", harmless=(None, 1, 1.0)),
    "prompt_logprobs": Refused(why="prompt log-probabilities are not computed"),
    "bad_words": Refused(why="not implemented; ban single tokens with logit_bias -100", harmless=(None, [])),
    "allowed_token_ids": Refused(why="not implemented; steer tokens with logit_bias"),
    "logits_processors": Refused(why="the server runs no client-supplied code", harmless=(None, [])),
    "truncate_prompt_tokens": Refused(why="prompts are never truncated; send a shorter one"),
    "spaces_between_special_tokens": Refused(why="special tokens are joined as the tokenizer decodes them",
                                             harmless=(None, True)),
    "return_tokens_as_token_ids": Refused(why="tokens are returned as text"),
}


def refusals(data: dict) -> str | None:
    """The refused parameters a request body asks for, with their reasons, as one phrase; None when none."""
    bad = [f"{name} ({r.why})" for name, r in REFUSED.items()
           if name in data and not any(data[name] == h and type(data[name]) is type(h) for h in r.harmless)]
    return f"unsupported parameter(s): {'; '.join(bad)}" if bad else None
