"""Which sequences run this step and how many tokens each (host only, no JAX).

Continuous batching in the vLLM V1 style: one step is a ragged batch mixing decode rows (one token) and
prefill chunks. Running sequences go first, in arrival order; each takes the tokens it still has to feed
(its remaining prompt, or the one pending token) up to the step's token budget. When a sequence needs a
block and none is free, the most recently admitted running sequence is preempted: its blocks and slot are
freed and it re-enters the waiting queue at the front. It is either *recomputed* (it keeps its generated
tokens as part of what it will re-prefill) or, with a host tier, *swapped*: its KV and state move to host
memory (a `SwapOp` in `swap_out`, which the engine executes before the step) and come back into new
blocks and a new slot when it is admitted again (`swap_in`), so it resumes where it stopped.
`preemption_mode` picks: "recompute", "swap" (whenever the host tier has room, else recompute) or "auto"
(swap when `SwapCostModel` estimates it is cheaper than recomputing, and the host tier has room).
Waiting sequences are admitted while a slot, row and budget are left and their first chunk's blocks fit.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from jhybrid.cache.allocator import BlockAllocator, SlotAllocator
from jhybrid.cache.host_tier import HostAllocator, HostEntry, SwapCostModel
from jhybrid.engine.sequence import Sequence, Status


@dataclasses.dataclass
class ScheduledRow:
    seq: Sequence
    start: int  # first position fed this step
    num_tokens: int
    samples: bool  # the row reaches the end of the known tokens: its sampled token is kept


@dataclasses.dataclass
class SwapOp:
    """Move one sequence's KV and state between device pages/slot and a host entry: both halves always."""

    seq: Sequence
    device_blocks: list[int]  # in block-table order, as many as entry.blocks
    device_slot: int
    entry: HostEntry


@dataclasses.dataclass
class SchedulerOutput:
    rows: list[ScheduledRow]
    preempted: list[Sequence]
    new_slots: list[int]  # slots handed out this step: the runner zeroes them before the step
    swap_out: list[SwapOp] = dataclasses.field(default_factory=list)  # gather before the step (pages reused)
    swap_in: list[SwapOp] = dataclasses.field(default_factory=list)  # scatter before the step; frees the entry

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def is_decode(self) -> bool:
        return all(r.num_tokens == 1 for r in self.rows)


PREEMPTION_MODES = ("auto", "swap", "recompute")


class Scheduler:
    def __init__(
        self,
        blocks: BlockAllocator,
        slots: SlotAllocator,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        host: HostAllocator | None = None,
        preemption_mode: str = "recompute",
        cost_model: SwapCostModel | None = None,
    ):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"need {max_num_seqs=} >= 1 and {max_num_batched_tokens=} >= 1")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown {preemption_mode=}; choose one of {PREEMPTION_MODES}")
        if preemption_mode != "recompute" and host is None:
            raise ValueError(f"{preemption_mode=} needs a host tier: set host_kv_memory_gb > 0")
        if preemption_mode == "auto" and cost_model is None:
            raise ValueError("preemption_mode='auto' needs a cost model (measured bandwidth and prefill rate)")
        self.host, self.preemption_mode, self.cost_model = host, preemption_mode, cost_model
        self.swapped: dict[int, HostEntry] = {}  # seq_id -> host entry of a swapped-out waiting sequence
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self.num_swap_fallbacks = 0  # swap wanted but the host tier was full
        self.blocks, self.slots = blocks, slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # ----------------------------------------------------------------- queue
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Ends a sequence (stop, length, abort, error) and returns its blocks and slot."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.blocks.free(seq.block_table)
            seq.block_table = []
        if seq.slot:
            self.slots.free([seq.slot])
            seq.slot = 0
        entry = self.swapped.pop(seq.seq_id, None)
        if entry is not None:  # finished (aborted) while swapped out
            self.host.release(entry.slot)

    def _preempt(self, seq: Sequence, swap_out: list[SwapOp]) -> None:
        self.running.remove(seq)
        entry = self._reserve_swap(seq)
        if entry is not None:
            swap_out.append(SwapOp(seq, seq.block_table[: len(entry.blocks)], seq.slot, entry))
            self._release(seq)
            self.swapped[seq.seq_id] = entry  # keeps num_computed: it resumes where it stopped
            self.num_swap_preemptions += 1
        else:
            self._release(seq)
            seq.num_computed = 0
            self.num_recompute_preemptions += 1
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _reserve_swap(self, seq: Sequence) -> HostEntry | None:
        """A host entry for `seq`'s KV and state when the mode and the cost model say swap and it fits."""
        n = seq.num_computed
        if self.preemption_mode == "recompute" or n == 0:
            return None
        if self.preemption_mode == "auto":
            nbytes = self.host.entry_bytes(self.blocks.blocks_needed(n))
            if not self.cost_model.prefers_swap(n, nbytes):
                return None
        if not self.host.can_hold(n):
            self.num_swap_fallbacks += 1
            return None
        return self.host.reserve(n)

    def _grow(self, seq: Sequence, upto: int) -> bool:
        """Gives `seq` blocks for positions < upto; False when none are left."""
        need = self.blocks.blocks_needed(upto) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        seq.block_table += self.blocks.allocate(need)
        return True

    # ----------------------------------------------------------------- step
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted: list[Sequence] = []
        new_slots: list[int] = []
        swap_out: list[SwapOp] = []
        swap_in: list[SwapOp] = []
        # 1. running sequences, oldest first; preempt the newest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            if n <= 0:  # everything fed; its token is pending on the device
                i += 1
                continue
            while not self._grow(seq, seq.num_computed + n) and self.running[-1] is not seq:
                victim = self.running[-1]  # newest; not scheduled yet this step (we go oldest first)
                self._preempt(victim, swap_out)
                preempted.append(victim)
            if self.blocks.blocks_needed(seq.num_computed + n) <= len(seq.block_table):
                rows.append(ScheduledRow(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens))
                budget -= n
                i += 1
            elif rows or len(self.running) > 1:
                self._preempt(seq, swap_out)  # the newest itself; the others keep running
                preempted.append(seq)
            else:  # the engine sizes the pool for one max_model_len sequence, so this cannot happen
                raise AssertionError(f"{seq} does not fit in the KV pool alone")
        # 2. admit waiting sequences
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted this step with a token still on the device
                break
            if not self.slots.can_allocate(1):
                break
            start = seq.num_computed  # > 0 only for a swapped-out sequence, which resumes there
            n = min(seq.num_uncomputed, budget)
            assert n >= 1, f"{seq}: waiting with nothing to feed"
            if not self._grow(seq, start + n):
                break
            self.waiting.popleft()
            (seq.slot,) = self.slots.allocate(1)
            entry = self.swapped.pop(seq.seq_id, None)
            if entry is not None:
                assert entry.num_tokens == start, f"{seq}: host entry holds {entry.num_tokens} tokens"
                swap_in.append(SwapOp(seq, seq.block_table[: len(entry.blocks)], seq.slot, entry))
            else:
                new_slots.append(seq.slot)
            seq.status = Status.RUNNING
            self.running.append(seq)
            rows.append(ScheduledRow(seq, start, n, start + n == seq.num_tokens))
            budget -= n
        # the host advances its view now: fed tokens are computed, sampled ones pending
        for row in rows:
            row.seq.num_computed += row.num_tokens
            if row.samples:
                row.seq.num_pending += 1
        return SchedulerOutput(rows, preempted, new_slots, swap_out, swap_in)
