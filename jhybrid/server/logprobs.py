"""Log-probabilities in OpenAI's two shapes, from the engine's per-token values.

- completions (legacy): `{"tokens": [str], "token_logprobs": [float | None], "top_logprobs": [{str: float} |
  None], "text_offset": [int]}`, one entry per returned token (with `echo`, the prompt's first: its logprob and
  top ones null). Each top dict holds the token itself and the `logprobs` most likely ones, as vLLM's does.
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`, the
  top list the `top_logprobs` most likely tokens.

A token's text is decoded after the few tokens before it, so a SentencePiece piece keeps its leading space (a
token decoded alone loses it); without a tokenizer it is `token_id:<id>`, as vLLM's `return_tokens_as_token_ids`.
Log-probabilities are clamped at -9999 (JSON has no -inf), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_LOGPROB = -9999.0
CONTEXT = 4  # tokens decoded before a token to get its text in context


def _lp(x: float) -> float:
    return max(float(x), MIN_LOGPROB)


class TokenTexts:
    """The text of a token at a position of a token sequence (`tokenizer`: `jhybrid.tokenizer.Tokenizer` or None)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def at(self, ids: Sequence[int], i: int, tokens: Sequence[int]) -> list[str]:
        """The text of each of `tokens` if it stood at position `i` of `ids` (after `ids[i - CONTEXT : i]`)."""
        if self.tokenizer is None:
            return [f"token_id:{t}" for t in tokens]
        decode = self.tokenizer.decode
        ctx = list(ids[max(0, i - CONTEXT) : i])
        before = decode(ctx, skip_special_tokens=False) if ctx else ""
        out = []
        for t in tokens:
            text = decode(ctx + [t], skip_special_tokens=False)
            out.append(text[len(before) :] if text.startswith(before) else decode([t], skip_special_tokens=False))
        return out


def completion_logprobs(texts: TokenTexts, ids: Sequence[int], start: int, entries: Sequence[dict[int, float] | None],
                        text_offset: int = 0) -> dict:
    """The completions shape for `ids[start:]`; `entries[j]` is position `start + j`'s {token id: logprob}
    (the token itself first, then the top ones; None: no logprob, e.g. a prompt's first token)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for j, entry in enumerate(entries):
        i = start + j
        token = ids[i]
        if entry is None:
            (text,) = texts.at(ids, i, [token])
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            alternatives = list(entry)
            strings = texts.at(ids, i, alternatives)
            text = strings[alternatives.index(token)] if token in entry else texts.at(ids, i, [token])[0]
            token_logprobs.append(_lp(entry[token]))
            top = {}
            for s, t in zip(strings, alternatives):
                top.setdefault(s, _lp(entry[t]))
            top_logprobs.append(top)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, ids: Sequence[int], start: int, token_logprobs: Sequence[float],
                  tops: Sequence[dict[int, float]] | None, k: int) -> list[dict]:
    """The chat shape's `content` for `ids[start:]`: each token's logprob and the `k` most likely of `tops[j]`."""
    out = []
    for j, lp in enumerate(token_logprobs):
        i = start + j
        top = list(tops[j].items())[:k] if tops is not None and j < len(tops) and k else []
        strings = texts.at(ids, i, [ids[i]] + [t for t, _ in top])
        out.append({"token": strings[0], "logprob": _lp(lp), "bytes": list(strings[0].encode("utf-8", "replace")),
                    "top_logprobs": [{"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8", "replace"))}
                                     for s, (_, v) in zip(strings[1:], top)]})
    return out
