"""Moves a preempted sequence between the device state and the host tier: its KV pages in every full layer
and its state slot (conv + recurrent) in every linear layer, always together.

Swap out (`Swapper.swap_out`): one jitted gather of the sequence's pages and slot is dispatched *before*
the step that reuses them (JAX orders it after the step that last wrote them), and its copy to the host
starts at once. With `transfer="pageable"` that is `copy_to_host_async`, and `flush()` stores the arrived
data into the host tier's NumPy arrays (the engine flushes after it has read the previous step, and always
before a swap in). With `transfer="pinned"` it is a device_put into JAX's page-locked pinned_host memory,
and the entry's data *stays* there as JAX arrays until it is swapped in (`num_resident`). The NumPy
arrays are not touched: reading pinned memory into NumPy is much slower than the pinned transfers
themselves (benchmarks/RESULTS.md, host tier, session 5). The host tier's allocator still accounts for the
entry's blocks and slot, so `host_kv_memory_gb` bounds both paths.

Swap in (`Swapper.swap_in`): the entry's data (copied out of the NumPy arrays, or its pinned arrays put
back on the device) is written into the sequence's new pages and slot by one jitted scatter, and the entry
is freed; the slot is not zeroed (a restored slot is not a new one).

Block lists are padded to a power of two with page 0, the null page, to bound compilation: padded gathers
read it, padded scatters write zeros into it (it is a write target for padding anyway).

`measure_transfer_bandwidth` and `measure_prefill_rate` are the start-up probes of the swap-or-recompute
cost model (`jhybrid.cache.host_tier.SwapCostModel`).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np
from jaxtyping import Array, Int

from jhybrid.cache.host_tier import HostEntry, HostTier
from jhybrid.cache.state import HybridState
from jhybrid.engine.sampling import SamplingParams
from jhybrid.engine.scheduler import ScheduledRow, SchedulerOutput, SwapOp
from jhybrid.engine.sequence import Sequence


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _check(op: SwapOp) -> None:
    if op.device_slot <= 0 or op.entry.slot <= 0:
        raise ValueError(f"swap of {op.seq} names no state slot ({op.device_slot=}, host slot {op.entry.slot}): "
                         "KV is never moved without its sequence's state")
    if len(op.device_blocks) != len(op.entry.blocks) or not op.device_blocks or 0 in op.device_blocks:
        raise ValueError(f"swap of {op.seq}: device blocks {op.device_blocks} do not match host blocks "
                         f"{op.entry.blocks}: state is never moved without all of its sequence's KV")


@jax.jit
def gather_sequence(state: HybridState, block_ids: Int[Array, "N"], slot: Int[Array, ""]):
    """One sequence's data: `k[i]`, `v[i]` `[N, BS, KVH, hd]`, `conv[j]` `[C, W-1]`, `ssm[j]` `[HV, K, V]`."""
    return (tuple(k[block_ids] for k in state.k_pages), tuple(v[block_ids] for v in state.v_pages),
            tuple(c[slot] for c in state.conv), tuple(s[slot] for s in state.ssm))


@functools.partial(jax.jit, donate_argnums=0)
def scatter_sequence(state: HybridState, block_ids: Int[Array, "N"], slot: Int[Array, ""], k, v, conv, ssm) -> HybridState:
    """Writes `gather_sequence`'s output into pages `block_ids` and state slot `slot`."""
    return dataclasses.replace(
        state,
        k_pages=tuple(p.at[block_ids].set(x.astype(p.dtype)) for p, x in zip(state.k_pages, k)),
        v_pages=tuple(p.at[block_ids].set(x.astype(p.dtype)) for p, x in zip(state.v_pages, v)),
        conv=tuple(c.at[slot].set(x) for c, x in zip(state.conv, conv)),
        ssm=tuple(s.at[slot].set(x) for s, x in zip(state.ssm, ssm)),
    )


@dataclasses.dataclass
class SwapStats:
    num_swap_out: int = 0
    num_swap_in: int = 0
    bytes_out: int = 0  # device -> host
    bytes_in: int = 0  # host -> device
    seconds_out: float = 0.0  # host time spent dispatching + flushing swap outs
    seconds_in: float = 0.0


TRANSFERS = ("pageable", "pinned")


def check_transfer(transfer: str) -> None:
    """Raises ValueError unless `transfer` names a device -> host path this backend has."""
    if transfer not in TRANSFERS:
        raise ValueError(f"unknown swap_transfer={transfer!r}; choose one of {TRANSFERS}")
    if transfer == "pinned" and "pinned_host" not in {m.kind for m in jax.devices()[0].addressable_memories()}:
        raise ValueError(f"swap_transfer='pinned' needs JAX's pinned_host memory, which {jax.devices()[0]} lacks")


def _to_pinned(data):
    """Starts the copy of device arrays into page-locked host memory (same sharding, memory kind
    "pinned_host")."""
    return jax.device_put(data, jax.tree.map(lambda x: x.sharding.with_memory_kind("pinned_host"), data))


def _to_device(data):
    """Starts the copy of pinned_host arrays back into device memory (same sharding)."""
    return jax.device_put(data, jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), data))


class Swapper:
    """`transfer`: how swapped-out data reaches the host: "pageable" (`copy_to_host_async`, then the host
    tier's NumPy arrays) or "pinned" (a device_put into JAX's pinned_host memory, where it stays)."""

    def __init__(self, host: HostTier, transfer: str = "pageable"):
        check_transfer(transfer)
        self.host, self.transfer = host, transfer
        self.stats = SwapStats()
        self._pending: list[tuple[HostEntry, tuple]] = []
        self._resident: dict[int, tuple[HostEntry, tuple]] = {}  # host slot -> (entry, pinned arrays)

    @property
    def num_resident(self) -> int:
        """Entries whose data is held in pinned host memory (`transfer="pinned"`)."""
        self._drop_released()
        return len(self._resident)

    def _drop_released(self) -> None:
        """Frees the pinned data of entries the host tier no longer holds (their sequence was aborted)."""
        for slot in [s for s, (e, _) in self._resident.items() if self.host.entries.get(s) is not e]:
            del self._resident[slot]

    def swap_out(self, state: HybridState, ops: list[SwapOp]) -> None:
        """Dispatches the gathers (reading `state` as it stands now) and starts their host copies."""
        t0 = time.perf_counter()
        for op in ops:
            _check(op)
            self.host.check_entry(op.entry.slot, op.entry.blocks)
            n = len(op.device_blocks)
            ids = np.zeros(_pow2(n), np.int32)
            ids[:n] = op.device_blocks
            data = gather_sequence(state, ids, np.int32(op.device_slot))
            if self.transfer == "pinned":
                self._resident[op.entry.slot] = (op.entry, _to_pinned(data))
            else:
                for leaf in jax.tree.leaves(data):
                    leaf.copy_to_host_async()
                self._pending.append((op.entry, data))
            self.stats.num_swap_out += 1
            self.stats.bytes_out += self.host.entry_bytes(n)
        self.stats.seconds_out += time.perf_counter() - t0

    def flush(self) -> None:
        """Stores arrived pageable swap-out data into the host arrays (waits for it)."""
        self._drop_released()
        t0 = time.perf_counter()
        for entry, (k, v, conv, ssm) in self._pending:
            if self.host.entries.get(entry.slot) is not entry:
                continue  # the sequence finished (abort) while its data was in flight; the entry is gone
            self.host.write(entry.slot, entry.blocks, k, v, conv, ssm)
        had = bool(self._pending)
        self._pending.clear()
        if had:
            self.stats.seconds_out += time.perf_counter() - t0

    def swap_in(self, state: HybridState, ops: list[SwapOp]) -> HybridState:
        """Scatters each entry into its new pages and slot and frees the entry; returns the new state."""
        self.flush()
        t0 = time.perf_counter()
        for op in ops:
            _check(op)
            n = len(op.entry.blocks)
            resident = self._resident.pop(op.entry.slot, None)
            if resident is not None:
                entry, data = resident
                self.host.check_entry(op.entry.slot, op.entry.blocks)
                assert entry is op.entry, f"{op.seq}: pinned data of another entry in host slot {op.entry.slot}"
                k, v, conv, ssm = _to_device(data)
            else:
                k, v, conv, ssm = self.host.read(op.entry.slot, op.entry.blocks, pad_to=_pow2(n))
            ids = np.zeros(_pow2(n), np.int32)
            ids[:n] = op.device_blocks
            state = scatter_sequence(state, ids, np.int32(op.device_slot), k, v, conv, ssm)
            self.host.release(op.entry.slot)
            self.stats.num_swap_in += 1
            self.stats.bytes_in += self.host.entry_bytes(n)
        self.stats.seconds_in += time.perf_counter() - t0
        return state


def warm_swap_programs(swapper: Swapper, state: HybridState, max_blocks: int) -> HybridState:
    """Compiles the swap gather and scatter for every padded block count up to `max_blocks` (a sequence's most
    blocks), run on the null page and slot only (padding reads and writes them anyway), with the data in the form
    a swap in passes it (NumPy arrays from the host tier, or pinned arrays put back on the device); returns the
    state. Without it the first swap of each size compiled on the request path."""
    n = 1
    while True:
        ids, slot = np.zeros(n, np.int32), np.int32(0)  # (as swaps pass them: NumPy, no device staging)
        data = gather_sequence(state, ids, slot)
        data = _to_device(_to_pinned(data)) if swapper.transfer == "pinned" else jax.device_get(data)
        state = scatter_sequence(state, ids, slot, *data)
        if n >= max_blocks:
            return jax.block_until_ready(state)
        n *= 2


def measure_transfer_bandwidth(nbytes: int = 16 << 20, repeats: int = 3, transfer: str = "pageable") -> tuple[float, float]:
    """(host->device, device->host) bytes/s: median of `repeats` copies of `nbytes` by the `Swapper`'s
    `transfer` path: "pageable" from and into NumPy arrays, "pinned" into and out of pinned_host arrays."""
    check_transfer(transfer)
    host = np.ones(nbytes // 4, np.float32)
    h2d, d2h = [], []
    for _ in range(repeats + 1):  # the first is a warm-up
        if transfer == "pinned":
            dev = jax.device_put(host).block_until_ready()
            t0 = time.perf_counter()
            pinned = _to_pinned(dev).block_until_ready()
            t1 = time.perf_counter()
            back = _to_device(pinned).block_until_ready()
            t2 = time.perf_counter()
            d2h.append(nbytes / max(t1 - t0, 1e-9))
            h2d.append(nbytes / max(t2 - t1, 1e-9))
            del back, pinned
            continue
        t0 = time.perf_counter()
        dev = jax.device_put(host)
        dev.block_until_ready()
        t1 = time.perf_counter()
        back = np.array(dev, copy=True)  # a copy even on a CPU device
        t2 = time.perf_counter()
        h2d.append(nbytes / max(t1 - t0, 1e-9))
        d2h.append(nbytes / max(t2 - t1, 1e-9))
        del back
    return float(np.median(h2d[1:])), float(np.median(d2h[1:]))


def measure_prefill_rate(runner, num_tokens: int, repeats: int = 2) -> float:
    """Prefill tokens/s of `runner`'s model: one row of `num_tokens` tokens written into the null slot and
    the null page (which padding writes anyway), timed after a warm-up (compile) run."""
    block_size = runner.cache.block_size
    seq = Sequence("prefill-probe", [0] * num_tokens, SamplingParams(max_tokens=1))
    seq.block_table = [0] * (-(-num_tokens // block_size))  # slot 0 / page 0: the null targets
    times = []
    for _ in range(repeats + 1):
        sched = SchedulerOutput([ScheduledRow(seq, 0, num_tokens, True)], [], [])
        t0 = time.perf_counter()
        runner.execute(sched, None).fetch()
        times.append(time.perf_counter() - t0)
    return num_tokens / max(float(np.median(times[1:])), 1e-9)
