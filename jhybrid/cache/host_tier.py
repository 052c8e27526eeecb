"""The host tier: KV blocks and state slots of swapped-out sequences, in host memory (NumPy, no JAX).

    k[i], v[i]   [HP, BS, KVH, hd]   full-attention layer i, the device pool's KV dtype
    conv[j]      [HS, C, W-1]        linear layer j, fp32 (the device layout, `jhybrid.cache.state`)
    ssm[j]       [HS, HV, K, V]      linear layer j, fp32

A sequence's swapped copy is one *entry*: a host slot plus the host blocks holding its KV, reserved
together (`HostAllocator.reserve`). The tier never holds KV without its sequence's state or state without
its KV (fail closed): a hybrid model's KV is useless without the recurrent state computed over the same
tokens, so every move takes or returns both halves, and a request naming only one half, or a half that
does not belong to the entry, raises.

Sizing (`plan_host_tier`): slots first (`max_num_seqs` of them, or fewer if the budget is small), then as
many KV blocks as the rest of `host_kv_memory_gb` holds; when the tier is full, preemption recomputes. Block 0 and slot 0
are reserved (unused) so the host pool shares its allocator classes with the device pool. The arrays are
allocated with `np.zeros` (lazily paged in by the OS), so an unused host tier costs no resident memory.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jhybrid.cache.allocator import BlockAllocator, SlotAllocator
from jhybrid.cache.state import CacheConfig
from jhybrid.config import ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostTierConfig:
    num_blocks: int  # host KV blocks, block 0 included (reserved)
    num_slots: int  # host state slots, slot 0 included (reserved)
    block_size: int
    kv_dtype: str

    def __post_init__(self):
        if self.num_blocks < 2 or self.num_slots < 2:
            raise ValueError(f"a host tier needs >= 2 blocks and slots (index 0 is reserved), got {self.num_blocks=} "
                             f"{self.num_slots=}: raise host_kv_memory_gb")


def plan_host_tier(cfg: ModelConfig, cache: CacheConfig, *, host_kv_memory_gb: float, max_num_seqs: int,
                   prefix_snapshots: bool = False) -> HostTierConfig:
    """Splits `host_kv_memory_gb` into state slots (one per swappable sequence; with `prefix_snapshots`, also up
    to half the budget in slots for the prefix cache's demoted snapshots) and KV blocks."""
    if host_kv_memory_gb <= 0:
        raise ValueError(f"{host_kv_memory_gb=} must be > 0 to build a host tier")
    budget = int(host_kv_memory_gb * 2**30)
    kv_itemsize = np.dtype(_np_dtype(cache.kv_dtype)).itemsize
    block_bytes = max(1, cache.block_size * cfg.kv_bytes_per_token(kv_itemsize))
    slot_bytes = cfg.state_bytes_per_sequence()
    # each swapped sequence needs a slot and at least one block
    wanted = max_num_seqs + (budget // 2 // max(slot_bytes, 1) if prefix_snapshots and cfg.num_linear_layers else 0)
    num_slots = min(wanted, budget // (slot_bytes + block_bytes)) + 1
    num_blocks = (budget - (num_slots - 1) * slot_bytes) // block_bytes + 1
    if cfg.num_full_layers == 0:
        num_blocks = cache.num_blocks  # no KV bytes: block bookkeeping mirrors the device pool
    if num_slots < 2 or num_blocks < 2:
        raise ValueError(
            f"{host_kv_memory_gb=} GiB cannot hold one state slot ({slot_bytes} bytes) and one KV block "
            f"({block_bytes} bytes): raise host_kv_memory_gb or leave it 0 (no host tier)"
        )
    return HostTierConfig(num_blocks=int(num_blocks), num_slots=int(num_slots), block_size=cache.block_size,
                          kv_dtype=cache.kv_dtype)


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


@dataclasses.dataclass
class HostEntry:
    """One swapped-out sequence: its host slot and host blocks (in block-table order), bound together."""

    slot: int
    blocks: list[int]
    num_tokens: int  # tokens whose KV / state the entry holds


@dataclasses.dataclass(frozen=True)
class SwapCostModel:
    """Swap or recompute a preempted sequence, by estimated time.

    swap: `bytes / d2h + bytes / h2d` (out now, back in later); recompute: `num_tokens / prefill rate`
    (its prompt and generated tokens are prefilled again). Rates come from `jhybrid.engine.swap.measure_*`
    at engine start or from the engine options `swap_bandwidth_gbps` / `prefill_tokens_per_s`.
    """

    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    prefill_tokens_per_s: float

    def __post_init__(self):
        if min(self.h2d_bytes_per_s, self.d2h_bytes_per_s, self.prefill_tokens_per_s) <= 0:
            raise ValueError(f"swap cost rates must be > 0, got {self}")

    def swap_seconds(self, nbytes: int) -> float:
        return nbytes / self.d2h_bytes_per_s + nbytes / self.h2d_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def prefers_swap(self, num_tokens: int, nbytes: int) -> bool:
        return self.swap_seconds(nbytes) < self.recompute_seconds(num_tokens)

    def offload_seconds(self, nbytes: int, num_steps: int) -> float:
        """Offloaded attention over `nbytes` of host KV for `num_steps` decode steps, priced as copying them to
        the device every step (kv_offload "copy"; on the H200 the CPU path was slower than that at every size
        measured, benchmarks/RESULTS.md, so for "cpu" this is a lower bound)."""
        return num_steps * nbytes / self.h2d_bytes_per_s


class HostAllocator:
    """Host bookkeeping only: the block and slot allocators and the entries that bind them (the scheduler's
    view; `HostTier` adds the arrays). `block_bytes` / `slot_bytes` feed the cost model and the metrics."""

    def __init__(self, num_blocks: int, num_slots: int, block_size: int, *, block_bytes: int = 0, slot_bytes: int = 0):
        self.blocks = BlockAllocator(num_blocks, block_size)
        self.slots = SlotAllocator(num_slots)
        self.block_bytes, self.slot_bytes = block_bytes, slot_bytes
        self.entries: dict[int, HostEntry] = {}  # host slot -> entry
        # callable(num_blocks, num_slots): the prefix cache gives back host blocks and slots it holds (its demoted
        # blocks and snapshots) until that many are free, for swapping and offloading (None: no prefix host tier)
        self.reclaim = None

    def entry_bytes(self, num_blocks: int) -> int:
        return num_blocks * self.block_bytes + self.slot_bytes

    @property
    def bytes_used(self) -> int:
        return self.blocks.num_used * self.block_bytes + self.slots.num_used * self.slot_bytes

    @property
    def bytes_total(self) -> int:
        return (self.blocks.capacity - 1) * self.block_bytes + (self.slots.capacity - 1) * self.slot_bytes

    def can_hold(self, num_tokens: int) -> bool:
        """Whether an entry of `num_tokens` fits (the prefix cache's host blocks and slots give way to it)."""
        need = self.blocks.blocks_needed(num_tokens)
        if self.reclaim is not None and not (self.slots.can_allocate(1) and self.blocks.can_allocate(need)):
            self.reclaim(need, 1)
        return self.slots.can_allocate(1) and self.blocks.can_allocate(need)

    def reserve(self, num_tokens: int) -> HostEntry:
        """Allocates a slot and the blocks for `num_tokens` tokens of KV, bound as one entry."""
        if not self.can_hold(num_tokens):
            raise MemoryError(f"the host tier cannot hold {num_tokens} tokens: {self.blocks.num_free} blocks and "
                              f"{self.slots.num_free} slots free")
        (slot,) = self.slots.allocate(1)
        blocks = self.blocks.allocate(self.blocks.blocks_needed(num_tokens))
        entry = HostEntry(slot, blocks, num_tokens)
        self.entries[slot] = entry
        return entry

    def release(self, slot: int) -> None:
        """Frees an entry's slot and blocks together."""
        entry = self.entries.pop(slot)
        self.blocks.free(entry.blocks)
        self.slots.free([entry.slot])

    def check_entry(self, slot: int, blocks: list[int]) -> HostEntry:
        """The entry of host `slot`, whose blocks must be exactly `blocks` (fail closed)."""
        entry = self.entries.get(slot)
        if entry is None:
            raise ValueError(f"host slot {slot} holds no swapped sequence: state is never moved without its KV")
        if list(blocks) != entry.blocks:
            raise ValueError(f"host blocks {list(blocks)} are not those of host slot {slot} ({entry.blocks}): KV is "
                             "never moved without its own sequence's state")
        return entry


class HostTier(HostAllocator):
    """Host pools plus their bookkeeping; `write` / `read` move an entry's data (both halves, always)."""

    def __init__(self, cfg: ModelConfig, tier: HostTierConfig):
        self.config = tier
        kv_shape = (tier.num_blocks, tier.block_size, cfg.num_kv_heads, cfg.head_dim)
        dt = _np_dtype(tier.kv_dtype)
        self.k = tuple(np.zeros(kv_shape, dt) for _ in range(cfg.num_full_layers))
        self.v = tuple(np.zeros(kv_shape, dt) for _ in range(cfg.num_full_layers))
        shapes = [cfg.linear_state_shapes(kind) for kind in cfg.linear_layer_kinds]
        self.conv = tuple(np.zeros((tier.num_slots, *c), np.float32) for c, _ in shapes)
        self.ssm = tuple(np.zeros((tier.num_slots, *s), np.float32) for _, s in shapes)
        super().__init__(tier.num_blocks, tier.num_slots, tier.block_size,
                         block_bytes=sum(a[0].nbytes for a in self.k + self.v),
                         slot_bytes=sum(a[0].nbytes for a in self.conv + self.ssm))

    # --------------------------------------------------------------- data
    def write(self, slot: int, blocks: list[int], k, v, conv, ssm) -> None:
        """Stores one entry's data: `k[i]`/`v[i]` `[n, BS, KVH, hd]` (n >= len(blocks); extra rows are padding),
        `conv[j]` `[C, W-1]`, `ssm[j]` `[HV, K, V]`."""
        self.check_entry(slot, blocks)
        _check_halves(k, v, conv, ssm, len(self.k), len(self.conv))
        n = len(blocks)
        for dst, src in zip(self.k + self.v, tuple(k) + tuple(v)):
            dst[blocks] = np.asarray(src)[:n]
        for dst, src in zip(self.conv + self.ssm, tuple(conv) + tuple(ssm)):
            dst[slot] = np.asarray(src)

    def read(self, slot: int, blocks: list[int], pad_to: int | None = None):
        """One entry's data as fresh arrays (copies, so the entry may be freed right after): KV rows padded
        with zeros to `pad_to` blocks."""
        self.check_entry(slot, blocks)
        n = len(blocks)
        rows = n if pad_to is None else pad_to
        if rows < n:
            raise ValueError(f"{pad_to=} < {n} blocks")

        def kv(a):
            out = np.zeros((rows, *a.shape[1:]), a.dtype)
            out[:n] = a[blocks]
            return out

        return (tuple(kv(a) for a in self.k), tuple(kv(a) for a in self.v),
                tuple(c[slot].copy() for c in self.conv), tuple(s[slot].copy() for s in self.ssm))


def _check_halves(k, v, conv, ssm, num_full: int, num_linear: int) -> None:
    if len(k) != num_full or len(v) != num_full:
        raise ValueError(f"expected KV of {num_full} full layers, got {len(k)} K and {len(v)} V: KV is never moved "
                         "without all its layers")
    if len(conv) != num_linear or len(ssm) != num_linear:
        raise ValueError(f"expected conv + recurrent state of {num_linear} linear layers, got {len(conv)} conv and "
                         f"{len(ssm)} recurrent: KV is never moved without its sequence's state")
