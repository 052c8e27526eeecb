"""What `LLM.generate` / `LLM.chat` return, in vLLM's shapes: a `RequestOutput` per prompt holding a
`CompletionOutput` per completion (`n` of them), log-probabilities as `Logprob`s.

    out = llm.generate({"prompt": "Hello"}, SamplingParams(n=2, logprobs=1))[0]
    out.outputs[0].text, out.outputs[0].token_ids, out.outputs[0].cumulative_logprob, out.outputs[0].stop_reason
    out.outputs[0].logprobs[0][token_id].logprob     # or as a float: out.outputs[0].logprobs[0][token_id]
    out.text, out.token_ids, out.finish_reason       # jhybrid's older names: the first completion's

Host only (no JAX).
"""

from __future__ import annotations

import dataclasses
from typing import Any


class Logprob(float):
    """A log-probability: a float (as jhybrid's logprob dicts always held), with vLLM's `Logprob` attributes.

    Attributes:
      logprob: the value, as a plain float.
      rank: 1 for the most likely token, 2 for the next, ...; None where the engine did not keep it (a sampled or
        prompt token outside the requested top-k).
      decoded_token: the token's text (None without a tokenizer).
    """

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    def __getnewargs__(self):
        return (float(self), self.rank, self.decoded_token)

    @property
    def logprob(self) -> float:
        return float(self)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's `CompletionOutput`).

    Attributes:
      index: the candidate it is: 0..best_of-1 (its seed, when the request has one, is `seed + index`).
      text: the generated text (cut before a stop string); None when the checkpoint has no tokenizer.
      token_ids: the generated token ids (a stop token included).
      cumulative_logprob: the sum of the generated tokens' log-probabilities (the model's, before temperature,
        bias and filtering); what `best_of` ranks by.
      logprobs: with `SamplingParams.logprobs = k`, per generated position {token id: Logprob}: the top-k (ranks
        1..k, most likely first), then the generated token if it is not among them.
      finish_reason: "stop" | "length" | "abort" | "error".
      stop_reason: the stop string or stop token id that ended it; None otherwise (EOS, length).
      error: why the request failed (finish_reason "error").
      num_preemptions: times the engine preempted it.
    """

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_preemptions: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """The output of one prompt (vLLM's `RequestOutput`): `outputs` holds its `n` completions, in index order, or
    with `best_of > n` the n of highest `cumulative_logprob`, highest first. The first completion's fields are
    also read here under jhybrid's older names (`text`, `token_ids`, `finish_reason`, `logprobs`, ...).

    Attributes:
      prompt: the prompt's text (a chat's rendered template); None for a prompt given as token ids.
      prompt_logprobs: with `SamplingParams.prompt_logprobs = k`: None at position 0, then per prompt position
        {token id: Logprob}: the prompt token and the top-k.
      num_cached_tokens: prompt tokens reused from the prefix cache (`enable_prefix_caching`; None when it is
        off or the request was never admitted).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int | None = None

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def cumulative_logprob(self) -> float | None:
        return self.outputs[0].cumulative_logprob

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self.outputs[0].logprobs

    @property
    def error(self) -> str | None:
        return self.outputs[0].error

    @property
    def num_preemptions(self) -> int:
        return self.outputs[0].num_preemptions


class _Decoder:
    """Token texts for `Logprob.decoded_token`, each decoded once."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token: int) -> str | None:
        if self.tokenizer is None:
            return None
        if token not in self.cache:
            self.cache[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return self.cache[token]


def completion_output(seq, index: int, eos_token_ids, decode: _Decoder) -> CompletionOutput:
    """The `CompletionOutput` of a finished engine sequence."""
    logprobs = None
    if seq.params.logprobs is not None:
        logprobs = []
        for top, token, lp in zip(seq.logprobs, seq.output_ids, seq.token_logprobs):
            entry = {t: Logprob(v, rank, decode(t)) for rank, (t, v) in enumerate(top.items(), 1)}
            if token not in entry:
                entry[token] = Logprob(lp, None, decode(token))
            logprobs.append(entry)
    return CompletionOutput(
        index=index, text=seq.text if seq.detok is not None else None, token_ids=list(seq.output_ids),
        cumulative_logprob=float(sum(seq.token_logprobs)), logprobs=logprobs, finish_reason=seq.finish_reason,
        stop_reason=stop_reason(seq, eos_token_ids), error=seq.error, num_preemptions=seq.num_preemptions)


def stop_reason(seq, eos_token_ids) -> int | str | None:
    """What ended a sequence that finished with "stop", checked in the engine's order (`LLMEngine._check_stop`):
    EOS (None), a stop token id (the id), a stop string: the one the text was cut at (or, with
    `include_stop_str_in_output`, after), the earliest if several fit, as the engine picks them."""
    if seq.finish_reason != "stop" or not seq.output_ids:
        return None
    p, last = seq.params, seq.output_ids[-1]
    if not p.ignore_eos and last in eos_token_ids:
        return None
    if last in p.stop_token_ids:
        return last
    if not p.stop or seq.detok is None:
        return None
    full, text = seq.detok.text, seq.text  # everything decoded; what was kept
    if p.include_stop_str_in_output:
        hits = [(len(text) - len(s), s) for s in p.stop if text.endswith(s)]
    else:
        hits = [(len(text), s) for s in p.stop if full.startswith(s, len(text))]
    return min(hits)[1] if hits else None


def prompt_logprobs(entries: list[dict[int, float] | None] | None, prompt_ids: list[int], k: int,
                    decode: _Decoder) -> list[dict[int, Logprob] | None] | None:
    """The engine's prompt log-probabilities ({prompt token, then the top-k not already there}) as `Logprob`s,
    ranked: the top-k by value; the prompt token too when it is one of them (the entry has no more than k)."""
    if entries is None:
        return None
    out: list[dict[int, Logprob] | None] = []
    for pos, entry in enumerate(entries):
        if entry is None:
            out.append(None)
            continue
        token = prompt_ids[pos]
        ranked = [t for t in entry if t != token or len(entry) <= k]  # the entry's top-k
        order = sorted(ranked, key=lambda t: -entry[t])
        ranks: dict[int, Any] = {t: i for i, t in enumerate(order, 1)}
        out.append({t: Logprob(v, ranks.get(t), decode(t)) for t, v in entry.items()})
    return out
