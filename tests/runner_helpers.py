"""`SequenceRunner`: drives one sequence through the state pytree step by step (block tables, a slot zeroed
on assignment, bucketed shapes) and can return every token's logits. The parity tests compare models with it;
`benchmarks/decode_step.py` and `benchmarks/generate.py` time it. The engine does not use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jhybrid.cache import BlockAllocator, CacheConfig, SlotAllocator, init_state, zero_slots
from jhybrid.config import ModelConfig
from jhybrid.models import RowSpec, forward, make_batch
from jhybrid.models.params import pack_params

_step = jax.jit(
    forward, static_argnames=("cfg", "decode", "all_logits", "kernel_impl", "interpret"), donate_argnames=("state",)
)


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


class SequenceRunner:
    """Runs one sequence at a time through the paged KV cache and one state slot."""

    def __init__(self, cfg: ModelConfig, params: Any, *, max_len: int, block_size: int = 16, kv_dtype=None,
                 kernel_impl: str = "auto", interpret: bool = False):
        self.kernels = dict(kernel_impl=kernel_impl, interpret=interpret)
        self.cfg, self.params = cfg, pack_params(params)
        self.block_size = block_size
        self.max_blocks = _bucket(-(-max_len // block_size), minimum=1)
        kv_dtype = kv_dtype or params["embed"].dtype
        self.cache = CacheConfig(
            num_blocks=self.max_blocks + 1, block_size=block_size, num_slots=2, kv_dtype=jnp.dtype(kv_dtype).name
        )
        self.state = init_state(cfg, self.cache)
        self.blocks = BlockAllocator(self.cache.num_blocks, block_size)
        self.slots = SlotAllocator(self.cache.num_slots)

    def start(self) -> tuple[list[int], int]:
        """Takes the blocks and a (zeroed) slot for a new sequence."""
        table = self.blocks.allocate(self.max_blocks)
        (slot,) = self.slots.allocate(1)
        self.state = zero_slots(self.state, jnp.asarray([slot], jnp.int32))
        return table, slot

    def finish(self, table: list[int], slot: int) -> None:
        self.blocks.free(table)
        self.slots.free([slot])

    def step(self, token_ids: Sequence[int], start: int, table: list[int], slot: int, *, all_logits=False):
        """Feeds `token_ids` at positions `start..`; returns logits of the last (or every) token."""
        n = len(token_ids)
        if start + n > self.max_blocks * self.block_size:
            raise ValueError(f"sequence of {start + n} tokens exceeds this runner's {self.max_blocks * self.block_size}")
        decode = n == 1 and not all_logits
        batch = make_batch(
            [RowSpec(list(token_ids), start, table, slot)],
            block_size=self.block_size,
            max_blocks_per_seq=self.max_blocks,
            num_tokens=1 if decode else _bucket(n),
            num_rows=1,
        )
        batch = jax.tree.map(jnp.asarray, batch)
        logits, self.state = _step(
            self.cfg, self.params, self.state, batch, decode=decode, all_logits=all_logits, **self.kernels
        )
        return logits[:n] if all_logits else logits[0]
