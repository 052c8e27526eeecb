"""Structured output: what a request asks for (`StructuredOutputsParams`) and the per-request grammar matcher
whose token bitmask the step applies to the logits (host only, no JAX).

The library is xgrammar, chosen by measurement (benchmarks/grammar_mask.py, benchmarks/RESULTS.md): at a
150k-token vocabulary it fills a row's mask in ~5 us per token on the CPU against ~60-100 us for llguidance;
it pays for that with a slower grammar compile (~70 ms for a JSON schema at 150k tokens, against ~1 ms), which
`GrammarCache` pays once per distinct grammar.

The kinds are vLLM's: `json` (a JSON schema: the output is one JSON value that validates against it),
`regex` (the whole output matches it), `choice` (the output is exactly one of the strings), `grammar` (an EBNF
grammar in xgrammar's GBNF-style syntax, `root ::= ...`) and `json_object` (any JSON object). JSON is written
without free whitespace: `", "` between items and `": "` after keys (xgrammar's `any_whitespace=False`), so a
model cannot stall in whitespace; schemas are strict (properties and items the schema does not name are not
generated).

Per request the engine makes a `Matcher` (`GrammarCache.matcher`): the compiled grammar is shared by every
request with the same grammar, the matcher state is the request's own. The matcher accepts each output token
as the host reads it (`accept`), fills the request's row of the step's `[rows, ceil(V/32)]` int32 bitmask
(`fill`; bit t of word t // 32 set: token t allowed) and says when the grammar is done (`terminated`: it
accepted a stop token). The grammar's stop tokens are the model's EOS ids and the request's `stop_token_ids`.
"""

from __future__ import annotations

import dataclasses
import json as _json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept per engine (least recently used dropped)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """What the output must be; exactly one field set (vLLM's `StructuredOutputsParams` names).

    Attributes:
      json: a JSON schema (dict or JSON string): the output is a JSON value valid under it.
      regex: the output matches this regular expression in full.
      choice: the output is exactly one of these strings (non-empty list).
      grammar: an EBNF grammar in xgrammar's syntax (GBNF style, start rule `root`, e.g.
        `root ::= "yes" | "no"`); the output is a sentence of it.
      json_object: the output is a JSON object (any keys and values).

    Invalid schemas, regexes and grammars raise ValueError naming the field (checked with xgrammar when the
    params are made, without a tokenizer).
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        given = [k for k in KINDS if (getattr(self, k) if k == "json_object" else getattr(self, k) is not None)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: give exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON: {e}") from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"structured_outputs.json: a JSON schema is an object, got {type(schema).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
        if self.choice is not None:
            choice = self.choice
            if isinstance(choice, str) or not isinstance(choice, Iterable):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {choice!r}")
            choice = tuple(choice)
            if not choice or any(not isinstance(c, str) or not c for c in choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                                 f"{list(choice)!r}")
            object.__setattr__(self, "choice", choice)
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty string, got {self.grammar!r}")
        self.to_grammar()  # the library's own check of the schema / regex / grammar (ValueError naming it)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if (getattr(self, k) if k == "json_object" else getattr(self, k) is not None))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for requests that compile to the same grammar."""
        kind = self.kind
        if kind == "json":
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, _json.dumps(schema, separators=(",", ":"))  # key order kept: it is the output's
        if kind == "choice":
            return kind, _json.dumps(list(self.choice))
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)

    def to_grammar(self):
        """The xgrammar `Grammar` (tokenizer-free); ValueError naming the field when the library refuses it."""
        xgr = _xgrammar()
        kind, text = self.key
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
            if kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return xgr.Grammar.from_regex(text)
            if kind == "choice":
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in self.choice))
            return xgr.Grammar.from_ebnf(text)
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "invalid JSON schema", "regex": "invalid regex", "grammar": "invalid EBNF grammar",
                    "choice": "the choices do not make a grammar", "json_object": "json_object"}[kind]
            raise ValueError(f"structured_outputs.{kind}: {what}: {_library_message(e)}") from None


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal (xgrammar's escapes: JSON's, which it reads)."""
    return _json.dumps(text, ensure_ascii=True)


def _library_message(e: Exception) -> str:
    """xgrammar's message without its `[time] file.cc:line:` prefix."""
    msg = str(e).strip()
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", msg).removeprefix("Check failed: (error.empty()) is false: ")


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # the `structured` extra (it brings PyTorch: not a dependency of generation)
        raise ImportError("structured output needs the xgrammar package: pip install 'jhybrid[structured]' (or "
                          f"pip install xgrammar): {e}") from e
    return xgrammar


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def new_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """`[num_rows, ceil(V/32)]` int32, every token allowed (-1: all 32 bits set)."""
    return np.full((num_rows, bitmask_width(vocab_size)), -1, np.int32)


class Matcher:
    """One request's grammar state (see the module docstring). `keep` (`[W]` int32 or None) is ANDed into every
    mask it fills (JSON kinds: no token with a raw control byte, see `GrammarCache`)."""

    def __init__(self, matcher, keep: np.ndarray | None = None, stop_token_ids: Sequence[int] = ()):
        self._m, self._keep = matcher, keep
        self._stops = np.asarray(stop_token_ids, np.int64)
        self.num_accepted = 0  # output tokens taken so far
        self.rejected = False  # a token was refused: the request ends with an error

    def accept(self, token: int) -> bool:
        """Advances past `token`; False when the grammar does not allow it (the matcher is unchanged)."""
        ok = bool(self._m.accept_token(int(token)))
        self.num_accepted += ok
        self.rejected |= not ok
        return ok

    def undo(self, accepted: bool) -> None:
        """Takes back the last `accept` (that returned `accepted`): its step was dropped unread."""
        if accepted:
            self._m.rollback(1)
            self.num_accepted -= 1
        else:
            self.rejected = False

    def fill(self, bitmask: np.ndarray, row: int, hold_stop: bool = False) -> None:
        """Writes the tokens allowed next into `bitmask[row]` (`[rows, W]` int32, C-contiguous). `hold_stop`
        (before `min_tokens`): the stop tokens are left out unless the grammar allows nothing else (it must end)."""
        import torch

        self._m.fill_next_token_bitmask(torch.from_numpy(bitmask), row)
        self._finish(bitmask, row, hold_stop)

    def _finish(self, bitmask: np.ndarray, row: int, hold_stop: bool) -> None:
        if self._keep is not None:
            bitmask[row] &= self._keep
        if hold_stop and len(self._stops):
            held = bitmask[row].copy()
            np.bitwise_and.at(held, self._stops // 32, ~(np.int32(1) << (self._stops % 32).astype(np.int32)))
            if held.any():
                bitmask[row] = held

    @property
    def terminated(self) -> bool:
        """The grammar is complete and accepted a stop token: nothing more can follow."""
        return bool(self._m.is_terminated())


_batch_filler = None


def fill_bitmask(bitmask: np.ndarray, rows: Sequence[tuple[int, Matcher, bool]]) -> None:
    """`Matcher.fill` for many rows at once, `(row, matcher, hold_stop)` each: the grammar library fills them on
    its own threads (C++, without the GIL; half the host's cores), so a step's mask costs about one row's time
    per thread rather than one per row (what row-by-row filling cost: benchmarks/RESULTS.md, session 11)."""
    global _batch_filler
    if len(rows) == 1:
        row, matcher, hold = rows[0]
        matcher.fill(bitmask, row, hold)
        return
    import torch

    if _batch_filler is None:
        _batch_filler = _xgrammar().BatchGrammarMatcher("auto")
    _batch_filler.batch_fill_next_token_bitmask([m._m for _, m, _ in rows], torch.from_numpy(bitmask),
                                                [row for row, _, _ in rows])
    for row, matcher, hold in rows:
        matcher._finish(bitmask, row, hold)


class GrammarCache:
    """Compiles grammars for one tokenizer and vocabulary, keeping the last `MAX_CACHED_GRAMMARS` (by
    `StructuredOutputsParams.key`). The tokenizer's xgrammar description is built on first use (`warm()` builds
    it at start-up: about 2 s at a 150k vocabulary). `compile_async` compiles on a thread of its own (xgrammar
    releases the GIL: ~70 ms for a JSON schema at 150k tokens that the engine loop does not wait for)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int]):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = sorted(set(stop_token_ids))
        self._compiler = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.num_compiled = 0

    def warm(self) -> None:
        self._get_compiler()

    def _get_compiler(self):
        if self._compiler is None:
            xgr = _xgrammar()
            info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
            self._no_control = _tokens_without_control_bytes(info.decoded_vocab, self.vocab_size, self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler

    def compile(self, params: StructuredOutputsParams):
        key = params.key
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        compiler = self._get_compiler()
        try:
            compiled = compiler.compile_grammar(params.to_grammar())
        except RuntimeError as e:
            raise ValueError(f"structured_outputs.{params.kind}: cannot compile it for this tokenizer: "
                             f"{_library_message(e)}") from None
        with self._lock:
            self._compiled[key] = compiled
            self.num_compiled += 1
            while len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """A future of `compile(params)`: done already when the grammar is cached; one compile per grammar however
        many requests wait for it."""
        key = params.key
        with self._lock:
            if key in self._compiled:
                done: Future = Future()
                done.set_result(self._compiled[key])
                self._compiled.move_to_end(key)
                return done
            future = self._pending.get(key)
            if future is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="jhybrid-grammar")
                future = self._pending[key] = self._pool.submit(self._compile_pending, params)
            return future

    def _compile_pending(self, params: StructuredOutputsParams):
        try:
            return self.compile(params)
        finally:
            with self._lock:
                self._pending.pop(params.key, None)

    def matcher(self, params: StructuredOutputsParams, stop_token_ids: Iterable[int] = (), compiled=None) -> Matcher:
        """A fresh matcher for `params` (of `compiled`, the grammar `compile(params)` made, when given); its stop
        tokens are the model's EOS ids and `stop_token_ids`."""
        xgr = _xgrammar()
        stops = sorted(set(self.stop_token_ids) | {t for t in stop_token_ids if t < self.vocab_size})
        compiled = self.compile(params) if compiled is None else compiled
        # JSON without free whitespace holds no raw byte below 0x20; xgrammar 0.2.9's rule for strings with
        # minLength / maxLength admits them (and a strict JSON parser then refuses the output): masked out here
        keep = self._no_control if params.kind in ("json", "json_object") else None
        return Matcher(xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                          terminate_without_stop_token=not stops), keep, stops)


def _tokens_without_control_bytes(decoded_vocab: Sequence[bytes], vocab_size: int, keep_ids: Iterable[int]):
    """`[ceil(V/32)]` int32 bitmask: the tokens whose bytes have none below 0x20, and `keep_ids`."""
    ok = np.zeros(bitmask_width(vocab_size) * 32, bool)
    for i, piece in enumerate(decoded_vocab[:vocab_size]):
        ok[i] = not any(b < 0x20 for b in piece)
    ok[[t for t in keep_ids if t < vocab_size]] = True
    return np.packbits(ok.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32).view(np.int32).ravel()


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
    """xgrammar's description of a jhybrid tokenizer: a `tokenizer.json` one (`HFTokenizer`) through
    transformers' fast tokenizer, a sentencepiece one from its pieces (byte fallback)."""
    xgr = _xgrammar()
    backend = getattr(tokenizer, "_tok", None)
    stops = list(stop_token_ids) or None
    if backend is not None and hasattr(backend, "to_str"):  # tokenizers.Tokenizer
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_object=backend)
        return xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size, stop_token_ids=stops)
    sp = getattr(tokenizer, "_sp", None)
    if sp is not None:  # sentencepiece.SentencePieceProcessor
        pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        return xgr.TokenizerInfo(pieces, xgr.VocabType.BYTE_FALLBACK, vocab_size=vocab_size, stop_token_ids=stops,
                                 add_prefix_space=True)
    raise ValueError(f"structured_outputs: this tokenizer ({type(tokenizer).__name__}) cannot be described to the "
                     "grammar library; use a tokenizer.json or sentencepiece checkpoint")
