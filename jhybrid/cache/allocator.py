"""Host-side allocators for KV blocks and linear-layer state slots (no JAX: plain Python, unit-tested).

Both reserve index 0 as the null target padding writes into; they share the verbs
`can_allocate` / `allocate` / `free` and count what is free.
"""

from __future__ import annotations

from collections import deque


class _IndexPool:
    kind = "index"

    def __init__(self, capacity: int):
        if capacity < 2:
            raise ValueError(f"{self.kind} pool needs capacity >= 2 (index 0 is reserved), got {capacity}")
        self.capacity = capacity
        self._free: deque[int] = deque(range(1, capacity))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if not self.can_allocate(n):
            raise MemoryError(f"cannot allocate {n} {self.kind}s: {len(self._free)} free of {self.capacity - 1}")
        out = [self._free.popleft() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise ValueError(f"{self.kind} {i} is not allocated (double free?)")
            self._used.remove(i)
            self._free.append(i)


class BlockAllocator(_IndexPool):
    """KV pages; block tables of all full-attention layers share one allocation per sequence."""

    kind = "block"

    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks)
        self.block_size = block_size

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


class SlotAllocator(_IndexPool):
    """Linear-layer state slots: one per running sequence. Callers zero a slot on the device when they
    allocate it (`jhybrid.cache.state.zero_slots`)."""

    kind = "slot"
