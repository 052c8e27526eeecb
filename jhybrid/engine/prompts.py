"""The prompts `LLM.generate` takes, as vLLM takes them, and `LLM.chat`'s conversations rendered to token ids.

A prompt is a string, a list of token ids, or a vLLM prompt dict: `{"prompt": str}` (a `TextPrompt`) or
`{"prompt_token_ids": [...]}` (a `TokensPrompt`); `generate` takes one prompt or a list of them. Host only.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

log = logging.getLogger("jhybrid.engine")

UNSUPPORTED_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds",
                    "token_type_ids", "encoder_prompt", "decoder_prompt")


def _is_token_ids(x: Any) -> bool:
    """Whether `x` is one prompt's token ids. Plain ints are checked first: the `Integral` check costs ~1.3 us a
    token (10 ms for an 8k-token prompt on a CI machine)."""
    return (not isinstance(x, (str, bytes, Mapping)) and isinstance(x, Sequence) or hasattr(x, "tolist")) and \
        len(x) > 0 and (all(type(t) is int for t in x) or all(isinstance(t, numbers.Integral) for t in x))


def int_array(x: Any) -> np.ndarray | None:
    """`x` as a 1-D integer array when it is a list or array of integers (numpy converts and checks a list in C:
    about 3x faster than `[int(t) for t in x]` for an 8k-token prompt, host time before a prefill starts), else None
    (floats, huge or mixed values: the caller's per-element path, which `int()`s them as before)."""
    if isinstance(x, np.ndarray) or type(x) is list:
        arr = np.asarray(x)
        if arr.ndim == 1 and arr.dtype.kind in "iu":
            return arr
    return None


def as_token_ids(x: Any) -> np.ndarray | list[int]:
    """x's token ids: `int_array(x)` where it applies, else `[int(t) for t in x]`. The array goes to the engine as it
    is (`LLMEngine._encode` takes an integer array without converting it again: an 8k-token prompt's list was
    converted twice, ~0.7 ms each on a CI machine, before its prefill could start)."""
    arr = int_array(x)
    return arr if arr is not None else [int(t) for t in x]


def parse_prompts(prompts: Any) -> list[tuple[str | None, str | np.ndarray | list[int]]]:
    """One prompt or a list of them -> per prompt (its text or None, what the engine takes: text or token ids).
    Raises ValueError naming what it cannot take (multi-modal data, prompt embeddings, encoder-decoder prompts)."""
    if isinstance(prompts, (str, Mapping)) or _is_token_ids(prompts):
        prompts = [prompts]
    return [_parse(p, i) for i, p in enumerate(prompts)]


def _parse(prompt: Any, i: int) -> tuple[str | None, str | np.ndarray | list[int]]:
    if isinstance(prompt, str):
        return prompt, prompt
    if isinstance(prompt, Mapping):
        for key in UNSUPPORTED_KEYS:
            if prompt.get(key) is not None:
                raise ValueError(f"prompt {i}: {key!r} is not supported by jhybrid (text-only models); give "
                                 "{'prompt': text} or {'prompt_token_ids': [...]}")
        unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", *UNSUPPORTED_KEYS}
        if unknown:
            raise ValueError(f"prompt {i}: unknown key(s) {sorted(unknown)}; a prompt dict has 'prompt' (text) or "
                             "'prompt_token_ids'")
        if prompt.get("cache_salt") is not None:
            log.info("prompt %d: cache_salt changes nothing in jhybrid (no prefix cache)", i)
        if prompt.get("prompt_token_ids") is not None:
            return prompt.get("prompt"), as_token_ids(prompt["prompt_token_ids"])
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], prompt["prompt"]
        raise ValueError(f"prompt {i}: a prompt dict needs 'prompt' (a string) or 'prompt_token_ids', got keys "
                         f"{sorted(prompt)}")
    if isinstance(prompt, Sequence) or hasattr(prompt, "tolist"):
        return None, as_token_ids(prompt)  # token ids; bad ones fail that request alone, in the engine
    raise ValueError(f"prompt {i}: expected a string, a list of token ids or a prompt dict, got {type(prompt).__name__}")


def conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """One conversation (a list of messages) or a list of them -> a list of conversations."""
    if not messages:
        return []
    first = messages[0]
    if isinstance(first, Mapping) or hasattr(first, "model_dump"):
        return [list(messages)]
    return [list(c) for c in messages]


def template_message(message: Any, content_format: str) -> dict[str, Any]:
    """A chat message as the template sees it: a plain dict; with `content_format` "auto" or "string" a content
    given as OpenAI text parts is joined into one string (as vLLM joins them, with newlines); "openai" keeps the parts.
    Raises ValueError for non-text parts (images, audio)."""
    d = dict(message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else message)
    content = d.get("content")
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text":
                raise ValueError(f"chat content part of type {kind!r} is not supported by jhybrid (text only)")
        if content_format in ("auto", "string"):
            d["content"] = "\n".join(part["text"] for part in content)
    return d


def continue_final(rendered: str, messages: list[dict[str, Any]]) -> str:
    """The rendered conversation cut right after the final message's content (HF's `continue_final_message`)."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):
        final = final[-1].get("text") if final else None
    if not isinstance(final, str) or final.strip() not in rendered:
        raise ValueError("continue_final_message: the final message does not appear in the rendered chat")
    text = final if final in rendered else final.strip()
    return rendered[: rendered.rindex(text) + len(text)]
