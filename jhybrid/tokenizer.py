"""Tokenizers behind one interface (HF `tokenizer.json`, sentencepiece `tokenizer.model`) and an
incremental detokenizer for streaming.

    tok = load_tokenizer("path/to/checkpoint")          # None when the directory has no tokenizer
    ids = tok.encode("Hello")                            # list[int], with BOS etc. per the tokenizer
    detok = IncrementalDetokenizer(tok, prompt_ids=ids)
    for t in new_ids: print(detok.add(t), end="")        # text deltas, never a half UTF-8 character
    print(detok.flush())

Special token ids come from `tokenizer_config.json` (`bos_token`, `eos_token`, `add_bos_token`,
`add_eos_token`) and `generation_config.json` (`bos_token_id`, `eos_token_id`: int or list); all eos ids
found are merged, tokenizer first.
"""

from __future__ import annotations

import abc
import json
import os
from typing import Any, Iterable, Sequence

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(abc.ABC):
    """The interface the engine uses. `eos_token_ids` may hold several ids (e.g. `<|im_end|>` and
    `<|endoftext|>`); `bos_token_id` is None when the tokenizer has none."""

    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_str(value: Any) -> str | None:
    """`"<s>"` or `{"content": "<s>", ...}` (tokenizer_config.json styles) -> `"<s>"`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class _SpecialTokens:
    """bos / eos ids from a checkpoint directory's tokenizer_config.json and generation_config.json."""

    def __init__(self, path: str, token_to_id):
        tok_cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen_cfg = _read_json(os.path.join(path, "generation_config.json"))
        self.config = tok_cfg

        def lookup(key: str) -> int | None:
            text = _token_str(tok_cfg.get(key))
            return None if text is None else token_to_id(text)

        self.bos = lookup("bos_token")
        if self.bos is None and gen_cfg.get("bos_token_id") is not None:
            self.bos = int(gen_cfg["bos_token_id"])
        eos = [lookup("eos_token")] + _as_ids(gen_cfg.get("eos_token_id"))
        self.eos = [e for e in eos if e is not None]


def _dedupe(ids: Iterable[int | None]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(i for i in ids if i is not None and i >= 0))


class HFTokenizer(Tokenizer):
    """A `tokenizer.json` (HF `tokenizers` library): the post-processor in the file decides which
    special tokens `encode(add_special_tokens=True)` adds."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _Tok

        self.path = path
        self._tok = _Tok.from_file(os.path.join(path, "tokenizer.json"))
        special = _SpecialTokens(path, self._tok.token_to_id)
        self.bos_token_id = special.bos
        self.eos_token_ids = _dedupe(special.eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `tokenizer.model`. `encode(add_special_tokens=True)` prepends BOS unless
    tokenizer_config.json says `add_bos_token: false`, and appends EOS when it says `add_eos_token: true`."""

    def __init__(self, path: str):
        import sentencepiece as spm

        self.path = path
        self._sp = spm.SentencePieceProcessor(model_file=os.path.join(path, "tokenizer.model"))

        def piece_to_id(text: str) -> int | None:
            i = self._sp.piece_to_id(text)
            return None if i == self._sp.unk_id() and text != self._sp.id_to_piece(i) else i

        special = _SpecialTokens(path, piece_to_id)
        own_bos = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.bos_token_id = special.bos if special.bos is not None else own_bos
        self.eos_token_ids = _dedupe(special.eos or [self._sp.eos_id()])
        self.add_bos = bool(special.config.get("add_bos_token", True)) and self.bos_token_id is not None
        self.add_eos = bool(special.config.get("add_eos_token", False)) and bool(self.eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(self._sp.encode(text))
        if add_special_tokens:
            ids = [self.bos_token_id] * self.add_bos + ids + [self.eos_token_ids[0]] * self.add_eos
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            return self._sp.decode(ids)
        # sentencepiece always drops control pieces (<s>, </s>); render them as their piece text.
        out, run = [], []
        for i in ids:
            if self._sp.is_control(i) or self._sp.is_unknown(i):
                out += [self._sp.decode(run), self._sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(out + [self._sp.decode(run)])

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()


def load_tokenizer(path: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory: `tokenizer.json` if present, else `tokenizer.model`,
    else None (a tokenizer-less checkpoint: callers pass token ids)."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return HFTokenizer(path)
    if os.path.isfile(os.path.join(path, "tokenizer.model")):
        return SentencePieceTokenizer(path)
    return None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Text is decoded over a short sliding window of recent ids (so each step costs O(window), and
    tokenizers that drop a leading space at the start of a decode still see context). A delta never ends
    in U+FFFD: a multi-byte UTF-8 character split over several tokens is held back until its last byte
    arrives (or until `flush`).

    Args:
      tokenizer: any `Tokenizer`.
      prompt_ids: the prompt, used only as left context (its text is not emitted).
      skip_special_tokens: as in `Tokenizer.decode`.
      context: ids kept as left context when the window slides.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True, context: int = 4):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.context = context
        self.ids: list[int] = [int(i) for i in prompt_ids[-context:]] if len(prompt_ids) else []
        self._start = 0  # window start in self.ids
        self._emitted = len(self._decode())  # chars of decode(ids[start:]) already emitted (or context)
        self.text = ""  # everything emitted so far

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids[self._start :], skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Feeds one id; returns the newly finalised text (possibly "")."""
        self.ids.append(int(token_id))
        text = self._decode()
        stable = text.rstrip(REPLACEMENT_CHAR)
        delta = stable[self._emitted :]
        self._emitted = max(self._emitted, len(stable))
        if len(stable) == len(text) and len(self.ids) - self._start > 2 * self.context:
            self._start = len(self.ids) - self.context  # slide; everything decoded so far was emitted
            self._emitted = len(self._decode())
        self.text += delta
        return delta

    def add_many(self, ids: Iterable[int]) -> str:
        return "".join(self.add(i) for i in ids)

    def flush(self) -> str:
        """Emits whatever is still held back (unresolved bytes appear as U+FFFD)."""
        delta = self._decode()[self._emitted :]
        self._emitted += len(delta)
        self.text += delta
        return delta
