"""The per-state-slot sampling tables on the device, and the host bookkeeping that keeps each slot's rows those
of the sequence in it.

A request's logit bias, banned token sequences (bad words; EOS and stop ids before `min_tokens`) and allowed
tokens are written into its slot's rows when it takes the slot (`SlotTables`, read by `sample`); a slot whose
rows belong to the sequence already is not written again, and a row's flags say which tables it reads, so the
rows of sequences that use none are never written. The token history of requests with penalties
(`TokenHistory`: output-token counts and a prompt-token mask) is state: each step adds the tokens it feeds
(`record_fed_tokens`, inside the step), so chunked prefill and re-prefill after a recompute preemption rebuild it
as they feed the tokens; when a sequence takes a slot its rows are reset, and a sequence that resumes with tokens
already fed (swapped back in from the host tier) gets them written from its tokens on the host, which knows them
all then (a sequence is admitted only with no token pending on the device). A holding is keyed by
(sequence, preemptions), so a sequence that comes back to the same slot is rebuilt too.

Each write is one of a few fixed-shape programs (padded with the null slot 0), compiled at warm-up.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.engine.sampling import (
    FLAG_ALLOWED,
    FLAG_BANS,
    FLAG_PENALTIES,
    INT32_MAX,
    MAX_BAN_TOKENS,
    MAX_BANS,
    MAX_LOGIT_BIAS,
    SamplingParams,
    SlotTables,
    TokenHistory,
)

HISTORY_CHUNK = 256  # tokens per row of one history write (a resumed sequence's tokens, a chunk at a time)
ALLOWED_ROWS = 4  # allowed-token rows (`[V]` bools each) per write


def ban_rows(params: SamplingParams, bad_words_ids: list[list[int]], eos_token_ids: Iterable[int],
             vocab_size: int) -> np.ndarray:
    """A request's `bans` entries (`[n, MAX_BAN_TOKENS + 1]`, see `SlotTables`): its bad words' token sequences,
    and with `min_tokens` its stop ids (EOS unless ignored, and `stop_token_ids`) until then. Raises ValueError
    naming the field when they do not fit."""
    for ids in bad_words_ids:
        if len(ids) > MAX_BAN_TOKENS:
            raise ValueError(f"bad_words: a bad word of {len(ids)} tokens; at most {MAX_BAN_TOKENS} are supported")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise ValueError(f"bad_words: token ids outside the vocabulary [0, {vocab_size}): {ids}")
    entries = [(ids, INT32_MAX) for ids in bad_words_ids]
    # under a grammar the matcher holds the stop ids back instead, unless they are all the grammar allows
    # (`jhybrid.engine.structured_output.Matcher.fill`)
    if params.min_tokens > 0 and params.structured_outputs is None:
        entries += [([t], params.min_tokens) for t in params.stop_ids(eos_token_ids) if t < vocab_size]
    if len(entries) > MAX_BANS:
        field = "bad_words" if params.bad_words else "stop_token_ids"
        raise ValueError(f"{field}: {len(entries)} banned token sequences (bad words with and without a leading "
                         f"space, and the stop ids while min_tokens holds); at most {MAX_BANS} are supported")
    rows = np.full((len(entries), MAX_BAN_TOKENS + 1), -1, np.int32)
    for i, (ids, until) in enumerate(entries):
        rows[i, MAX_BAN_TOKENS - len(ids) : MAX_BAN_TOKENS] = ids
        rows[i, MAX_BAN_TOKENS] = until
    return rows


def recent_window(seq, end: int, known: int, out: np.ndarray | None = None) -> np.ndarray:
    """The last MAX_BAN_TOKENS - 1 output tokens of `seq` at position `end` (right-aligned; -2 where the output
    is shorter; -3 for the token at `known`, sampled by the previous step and not read yet: the step puts the
    row's last fed token there), written into `out` (a row of -2s; a new one when None)."""
    width = MAX_BAN_TOKENS - 1
    if out is None:
        out = np.full(width, -2, np.int32)
    first = max(len(seq.prompt_ids), end - width)
    ids = seq.token_ids[first : min(end, known)]
    if end > known:
        ids.append(-3)
    if ids:
        out[width - len(ids) :] = ids
    return out


def init_tables(num_slots: int, vocab_size: int) -> tuple[SlotTables, TokenHistory]:
    tables = SlotTables(bias_ids=jnp.zeros((num_slots, MAX_LOGIT_BIAS), jnp.int32),
                        bias_values=jnp.zeros((num_slots, MAX_LOGIT_BIAS), jnp.float32),
                        bans=jnp.full((num_slots, MAX_BANS, MAX_BAN_TOKENS + 1), -1, jnp.int32),
                        allowed=jnp.ones((num_slots, vocab_size), jnp.bool_))
    history = TokenHistory(output_counts=jnp.zeros((num_slots, vocab_size), jnp.int32),
                           prompt_mask=jnp.zeros((num_slots, vocab_size), jnp.bool_))
    return tables, history


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_bias(tables: SlotTables, slots, ids, values) -> SlotTables:
    """Writes the logit-bias rows of `slots [K]` (`ids`, `values [K, NB]`); padding entries target slot 0."""
    return SlotTables(bias_ids=tables.bias_ids.at[slots].set(ids), bias_values=tables.bias_values.at[slots].set(values),
                      bans=tables.bans, allowed=tables.allowed)


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_bans(tables: SlotTables, slots, rows) -> SlotTables:
    """Writes the ban rows of `slots [K]` (`rows [K, NW, W]`)."""
    return SlotTables(bias_ids=tables.bias_ids, bias_values=tables.bias_values, bans=tables.bans.at[slots].set(rows),
                      allowed=tables.allowed)


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_allowed(tables: SlotTables, slots, rows) -> SlotTables:
    """Writes the allowed-token rows of `slots [ALLOWED_ROWS]` (`rows [ALLOWED_ROWS, V]` bool)."""
    return SlotTables(bias_ids=tables.bias_ids, bias_values=tables.bias_values, bans=tables.bans,
                      allowed=tables.allowed.at[slots].set(rows))


@functools.partial(jax.jit, donate_argnums=(0,))
def _write_history(history: TokenHistory, slots, reset, tokens, is_output) -> TokenHistory:
    """Resets (where `reset [K]`) the history rows of `slots [K]` and adds `tokens [K, C]` (-1: none) to them,
    as output tokens where `is_output [K, C]`, else as prompt tokens. A slot appears at most once a call
    (padding: slot 0)."""
    vocab = history.output_counts.shape[1]
    counts = jnp.where(reset[:, None], 0, history.output_counts[slots])  # [K, V]
    mask = jnp.where(reset[:, None], False, history.prompt_mask[slots])
    rows = jnp.arange(slots.shape[0])[:, None]
    counts = counts.at[rows, jnp.where((tokens >= 0) & is_output, tokens, vocab)].add(1, mode="drop")
    mask = mask.at[rows, jnp.where((tokens >= 0) & ~is_output, tokens, vocab)].set(True, mode="drop")
    return TokenHistory(output_counts=history.output_counts.at[slots].set(counts),
                        prompt_mask=history.prompt_mask.at[slots].set(mask))


class SlotTableKeeper:
    """The device tables (`tables`, `history`) and which sequence each slot's rows belong to. `replicate`
    places new arrays (over a tensor-parallel mesh: replicated)."""

    def __init__(self, num_slots: int, vocab_size: int, max_rows: int, replicate: Callable = lambda make: make()):
        self.vocab_size, self.max_rows = vocab_size, max_rows
        self.tables, self.history = replicate(lambda: init_tables(num_slots, vocab_size))
        self._bias_owner: list[int | None] = [None] * num_slots
        self._bans_owner: list[int | None] = [None] * num_slots
        self._allowed_owner: list[int | None] = [None] * num_slots
        self._history_owner: list[tuple[int, int] | None] = [None] * num_slots

    def sync(self, rows) -> None:
        """Before a step: writes the rows of each scheduled sequence's slot that hold another's (or stale) data."""
        bias, bans, allowed, history = [], [], [], []
        for r in rows:
            seq = r.seq
            slot = seq.slot
            want = seq.seq_id if seq.params.logit_bias else None
            if self._bias_owner[slot] != want:  # the bias is always added: a slot without one holds zeros
                bias.append((slot, seq.params.logit_bias or {}))
                self._bias_owner[slot] = want
            flags = seq.flags
            if not flags:
                continue
            if flags & FLAG_BANS and self._bans_owner[slot] != seq.seq_id:
                bans.append((slot, seq.bans))
                self._bans_owner[slot] = seq.seq_id
            if flags & FLAG_ALLOWED and self._allowed_owner[slot] != seq.seq_id:
                allowed.append((slot, seq.params.allowed_token_ids))
                self._allowed_owner[slot] = seq.seq_id
            if flags & FLAG_PENALTIES and self._history_owner[slot] != (key := (seq.seq_id, seq.num_preemptions)):
                if r.start > len(seq.token_ids):
                    raise AssertionError(f"{seq}: resumes at {r.start} with tokens the host has not read")
                history.append((slot, seq.token_ids[: r.start], len(seq.prompt_ids)))
                self._history_owner[slot] = key
        if bias:
            self._bias(bias)
        if bans:
            self._bans(bans)
        if allowed:
            self._allowed(allowed)
        if history:
            self._history(history)

    def _bias(self, updates) -> None:
        for start in range(0, len(updates), self.max_rows):
            slots = np.zeros(self.max_rows, np.int32)
            ids = np.zeros((self.max_rows, MAX_LOGIT_BIAS), np.int32)
            values = np.zeros((self.max_rows, MAX_LOGIT_BIAS), np.float32)
            for i, (slot, bias) in enumerate(updates[start : start + self.max_rows]):
                slots[i] = slot
                ids[i, : len(bias)] = list(bias)
                values[i, : len(bias)] = list(bias.values())
            self.tables = _write_bias(self.tables, slots, ids, values)

    def _bans(self, updates) -> None:
        for start in range(0, len(updates), self.max_rows):
            slots = np.zeros(self.max_rows, np.int32)
            rows = np.full((self.max_rows, MAX_BANS, MAX_BAN_TOKENS + 1), -1, np.int32)
            for i, (slot, entries) in enumerate(updates[start : start + self.max_rows]):
                slots[i] = slot
                rows[i, : len(entries)] = entries
            self.tables = _write_bans(self.tables, slots, rows)

    def _allowed(self, updates) -> None:
        for start in range(0, len(updates), ALLOWED_ROWS):
            slots = np.zeros(ALLOWED_ROWS, np.int32)
            rows = np.ones((ALLOWED_ROWS, self.vocab_size), np.bool_)  # padding: slot 0, all allowed
            for i, (slot, ids) in enumerate(updates[start : start + ALLOWED_ROWS]):
                slots[i] = slot
                rows[i] = False
                rows[i, [t for t in ids if t < self.vocab_size]] = True
            self.tables = _write_allowed(self.tables, slots, rows)

    def _history(self, updates) -> None:
        """Resets each slot's history and adds the tokens fed before its row (chunks of HISTORY_CHUNK: the k-th
        chunks of all slots in one round, so that a slot appears at most once a call)."""
        pieces = []  # per slot: its chunks of (tokens, is_output)
        for slot, ids, num_prompt in updates:
            ids = np.asarray(ids, np.int32)
            is_output = np.arange(len(ids)) >= num_prompt
            chunks = [(ids[i : i + HISTORY_CHUNK], is_output[i : i + HISTORY_CHUNK])
                      for i in range(0, len(ids), HISTORY_CHUNK)]
            pieces.append((slot, chunks or [(ids, is_output)]))
        for k in range(max(len(c) for _, c in pieces)):
            todo = [(slot, k == 0, chunks[k]) for slot, chunks in pieces if k < len(chunks)]
            for start in range(0, len(todo), self.max_rows):
                slots = np.zeros(self.max_rows, np.int32)
                reset = np.zeros(self.max_rows, np.bool_)
                tokens = np.full((self.max_rows, HISTORY_CHUNK), -1, np.int32)
                is_output = np.zeros((self.max_rows, HISTORY_CHUNK), np.bool_)
                for i, (slot, first, (ids, out)) in enumerate(todo[start : start + self.max_rows]):
                    slots[i], reset[i] = slot, first
                    tokens[i, : len(ids)], is_output[i, : len(ids)] = ids, out
                self.history = _write_history(self.history, slots, reset, tokens, is_output)

    def warm(self) -> None:
        """Compiles (and runs, on the null slot only) the write programs."""
        zeros = np.zeros(self.max_rows, np.int32)
        self.tables = _write_bias(self.tables, zeros, np.zeros((self.max_rows, MAX_LOGIT_BIAS), np.int32),
                                  np.zeros((self.max_rows, MAX_LOGIT_BIAS), np.float32))
        self.tables = _write_bans(self.tables, zeros, np.full((self.max_rows, MAX_BANS, MAX_BAN_TOKENS + 1), -1, np.int32))
        self.tables = _write_allowed(self.tables, np.zeros(ALLOWED_ROWS, np.int32),
                                     np.ones((ALLOWED_ROWS, self.vocab_size), np.bool_))
        self.history = _write_history(self.history, zeros, np.ones(self.max_rows, np.bool_),
                                      np.full((self.max_rows, HISTORY_CHUNK), -1, np.int32),
                                      np.zeros((self.max_rows, HISTORY_CHUNK), np.bool_))
