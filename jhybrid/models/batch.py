"""Per-step metadata of a ragged batch: an explicit argument of every jitted step.

A step processes B rows (sequences); row b contributes the tokens `cu_seqlens[b]:cu_seqlens[b+1]` of the
packed token array, which continue its sequence at `start_pos[b]`. Decode is the case of one token per
row. Shapes are padded to buckets by the caller: padding rows have zero tokens, slot 0 and a block table of
zeros; padding tokens sit after `cu_seqlens[B]`, write their KV into page 0 and belong to the last row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from jaxtyping import Array, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    token_ids: Int[Array, "T"]
    positions: Int[Array, "T"]  # position of each token in its sequence
    token_seq: Int[Array, "T"]  # batch row of each token
    slot_mapping: Int[Array, "T"]  # flat KV cache index page * BS + offset where the token's K/V goes
    cu_seqlens: Int[Array, "B+1"]
    block_tables: Int[Array, "B M"]
    slot_ids: Int[Array, "B"]  # linear-layer state slot of each row; 0 = null slot
    logits_index: Int[Array, "B"]  # packed index of each row's last token


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """Host-side description of one row: the new tokens, where they start, and where state lives."""

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    slot_id: int


def make_batch(
    rows: Sequence[RowSpec],
    *,
    block_size: int,
    max_blocks_per_seq: int,
    num_tokens: int | None = None,
    num_rows: int | None = None,
) -> Batch:
    """Packs rows into a `Batch`, padded to `num_tokens` tokens and `num_rows` rows (buckets)."""
    lengths = [len(r.token_ids) for r in rows]
    total = sum(lengths)
    num_tokens = total if num_tokens is None else num_tokens
    num_rows = len(rows) if num_rows is None else num_rows
    if total > num_tokens or len(rows) > num_rows or not rows:
        raise ValueError(f"{len(rows)} rows / {total} tokens do not fit the bucket {num_rows=} {num_tokens=}")
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    token_seq = np.full(num_tokens, len(rows) - 1, np.int32)
    slot_mapping = np.arange(num_tokens, dtype=np.int32) % block_size  # padding -> page 0 (null page)
    cu = np.zeros(num_rows + 1, np.int32)
    tables = np.zeros((num_rows, max_blocks_per_seq), np.int32)
    slots = np.zeros(num_rows, np.int32)
    offset = 0
    for b, r in enumerate(rows):
        n = len(r.token_ids)
        end_pos = r.start_pos + n
        if -(-end_pos // block_size) > len(r.block_table):
            raise ValueError(f"row {b}: {end_pos} tokens need more than its {len(r.block_table)} blocks")
        if len(r.block_table) > max_blocks_per_seq:
            raise ValueError(f"row {b}: {len(r.block_table)} blocks exceed {max_blocks_per_seq=}")
        pos = np.arange(r.start_pos, end_pos, dtype=np.int32)
        table = np.asarray(r.block_table, np.int32)
        token_ids[offset : offset + n] = r.token_ids
        positions[offset : offset + n] = pos
        token_seq[offset : offset + n] = b
        slot_mapping[offset : offset + n] = table[pos // block_size] * block_size + pos % block_size
        tables[b, : len(table)] = table
        slots[b] = r.slot_id
        offset += n
        cu[b + 1] = offset
    cu[len(rows) + 1 :] = offset
    logits_index = np.maximum(cu[1:] - 1, 0)
    return Batch(
        token_ids=token_ids,
        positions=positions,
        token_seq=token_seq,
        slot_mapping=slot_mapping,
        cu_seqlens=cu,
        block_tables=tables,
        slot_ids=slots,
        logits_index=logits_index.astype(np.int32),
    )
