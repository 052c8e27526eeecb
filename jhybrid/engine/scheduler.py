"""Which sequences run this step and how many tokens each (host only, no JAX).

Continuous batching in the vLLM V1 style: one step is a ragged batch mixing decode rows (one token) and
prefill chunks. Running sequences go first: those decoding (one pending token to feed), then those still
prefilling, each group in arrival order; each takes the tokens it still has to feed up to the step's token
budget, `max_num_batched_tokens`; once the step has decode rows, its prefill rows together take at most
`max_prefill_tokens_with_decodes` tokens (then up to the end of the runner's token bucket that this lands the
step in, `token_bucket`: the program runs over the whole bucket, so its padding is free prefill), so prompts are
fed in chunks beside running decodes instead of stalling every running request for one long step (inter-token
latency against time to first token). When a sequence needs a block and none
is free, the newest running sequence not yet scheduled this step is preempted: its blocks and slot are
freed and it re-enters the waiting queue at the front. It is either *recomputed* (it keeps its generated
tokens as part of what it will re-prefill) or, with a host tier, *swapped*: its KV and state move to host
memory (a `SwapOp` in `swap_out`, which the engine executes before the step) and come back into new
blocks and a new slot when it is admitted again (`swap_in`), so it resumes where it stopped.
`preemption_mode` picks: "recompute", "swap" (whenever the host tier has room, else recompute) or "auto"
(swap when `SwapCostModel` estimates it is cheaper than recomputing, and the host tier has room).
Waiting sequences are admitted while a slot, row and budget are left and their first chunk's blocks fit.

Offloaded attention (`kv_offload` "cpu" or "copy", with a host tier): instead of preempting, a step ends by
moving the oldest full KV blocks (all full layers) of the longest *decoding* sequences to host blocks (an
`OffloadOp`) until the next step's decode rows fit, so that no running sequence is preempted. With
`offload_admission` it also offloads to admit the first waiting sequence's first chunk; that is off by
default: on the H200 it was slower than running such requests in waves (benchmarks/RESULTS.md, session 4). The sequence keeps running: its state slot and its newest
blocks stay on the GPU and new tokens are always written there; its decode attention becomes a GPU part over
`block_table` plus a host part over `host_blocks` (`jhybrid.cache.host_attention`). An op is executed in two
phases so that the host copy is in place before anything reads it: the engine dispatches the gather of the
device blocks before this step (which still reads them on the device) and stores it in the host arrays after
reading the previous step; the next `schedule()` *commits* it (the blocks move from `block_table` to
`host_blocks` and the device blocks are freed for reuse). A sequence with host blocks is only ever fed one
token per step (it was decoding when chosen, and decoding stays decoding), so prefill never sees host KV; when
it finishes or is preempted (always by recompute: its KV is split between tiers) its host blocks are freed
with it.
Preemption stays the fallback when nothing can be offloaded or the host tier is full.

Multi-step decode (`num_scheduler_steps` > 1): a step whose rows all decode output tokens, with nothing waiting and
nothing preempted, may become a burst (`SchedulerOutput.burst`): one program runs several decode steps, each row
`ScheduledRow.steps` of them (capped by its length limit and the blocks it holds or can get), and the host's view
advances by them at once (that many positions computed, tokens pending). `can_burst` is the runner's say (row
count, programs compiled); rows under a grammar, with multi-token banned words or host KV never burst.

Prefix caching (`prefix_cache`, `jhybrid.cache.prefix_cache`): a waiting sequence with nothing computed is
looked up when admitted; on a hit it starts with the shared KV blocks, its slot is loaded from the snapshot
(`restores`, copied before the step; it is then not zeroed) and its prefill starts at the hit. Prefill chunks
are cut at snapshot points; after each step the rows that end at one are copied into snapshot slots
(`snapshots`, copied after the step). The rows' full blocks are registered in the trie at the end of
`schedule()`, after this step's admissions, and when a sequence leaves the device. With `offload_policy`
"cost" (the engine's default) an offload must also pay: per device block freed, the cost model prices the
sequence's host attention for the rest of its decode (`SwapCostModel.offload_seconds`, its steps left x the
bytes / H2D) against the preemption it avoids (the newest running sequence, swapped or recomputed as the
mode would, over the blocks that frees); where offloading costs more it is declined
(`num_offloads_declined`) and the preemption happens. On the H200, offloading whenever a sequence would be
preempted ("always") ran far slower than recomputing (benchmarks/RESULTS.md, session 5).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable

from jhybrid.cache.allocator import BlockAllocator, SlotAllocator
from jhybrid.cache.host_tier import HostAllocator, HostEntry, SwapCostModel
from jhybrid.cache.prefix_cache import PrefixCache, TierOps
from jhybrid.engine.sequence import Sequence, Status


@dataclasses.dataclass
class ScheduledRow:
    seq: Sequence
    start: int  # first position fed this step
    num_tokens: int
    samples: bool  # the row reaches the end of the known tokens: its sampled token is kept
    steps: int = 1  # in a multi-step decode step (`SchedulerOutput.burst`): the decode steps this row runs


@dataclasses.dataclass
class SwapOp:
    """Move one sequence's KV and state between device pages/slot and a host entry: both halves always."""

    seq: Sequence
    device_blocks: list[int]  # in block-table order, as many as entry.blocks
    device_slot: int
    entry: HostEntry


@dataclasses.dataclass
class OffloadOp:
    """Move the oldest full device blocks of a running sequence to host blocks (KV of all full layers)."""

    seq: Sequence
    device_blocks: list[int]  # the first len(device_blocks) entries of seq.block_table, in order
    host_blocks: list[int]  # as many, appended to seq.host_blocks when committed


@dataclasses.dataclass
class SchedulerOutput:
    rows: list[ScheduledRow]
    preempted: list[Sequence]
    new_slots: list[int]  # slots handed out this step: the runner zeroes them before the step
    swap_out: list[SwapOp] = dataclasses.field(default_factory=list)  # gather before the step (pages reused)
    swap_in: list[SwapOp] = dataclasses.field(default_factory=list)  # scatter before the step; frees the entry
    offload: list[OffloadOp] = dataclasses.field(default_factory=list)  # gather before the step; commit next step
    # prefix caching: (snapshot slot, sequence slot) to copy before the step (instead of zeroing the slot), and
    # (sequence slot, snapshot slot) to copy after it
    restores: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    snapshots: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # the prefix cache's moves to and from the host tier (`TierOps`: demotions gathered before the step, then
    # promoted blocks and host snapshots written before it); None: nothing to move
    tier: TierOps | None = None
    # > 1: a multi-step decode step, this many decode steps in one program, each row's sampled token fed to the
    # next on the device; row i runs `rows[i].steps` of them (its length limit or its blocks may stop it early)
    burst: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def is_decode(self) -> bool:
        return all(r.num_tokens == 1 for r in self.rows)


PREEMPTION_MODES = ("auto", "swap", "recompute")
KV_OFFLOAD_MODES = ("off", "cpu", "copy")
OFFLOAD_POLICIES = ("cost", "always")


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
        kv_offload: str = "off",
        offload_admission: bool = False,
        offload_policy: str = "cost",
        max_prefill_tokens_with_decodes: int | None = None,
        prefix_cache: PrefixCache | None = None,
        token_bucket: Callable[[int], int] | None = None,
        snapshot_budget: Callable[[bool, int, int], int] | None = None,
        num_scheduler_steps: int = 1,
        can_burst: Callable[[list[ScheduledRow]], bool] | None = None,
    ):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"need {max_num_seqs=} >= 1 and {max_num_batched_tokens=} >= 1")
        if max_prefill_tokens_with_decodes is not None and max_prefill_tokens_with_decodes < 1:
            raise ValueError(f"need {max_prefill_tokens_with_decodes=} >= 1 (or None: no limit)")
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"unknown {preemption_mode=}; choose one of {PREEMPTION_MODES}")
        if preemption_mode != "recompute" and host is None:
            raise ValueError(f"{preemption_mode=} needs a host tier: set host_kv_memory_gb > 0")
        if preemption_mode == "auto" and cost_model is None:
            raise ValueError("preemption_mode='auto' needs a cost model (measured bandwidth and prefill rate)")
        if kv_offload not in KV_OFFLOAD_MODES:
            raise ValueError(f"unknown {kv_offload=}; choose one of {KV_OFFLOAD_MODES}")
        if kv_offload != "off" and host is None:
            raise ValueError(f"{kv_offload=} needs a host tier: set host_kv_memory_gb > 0")
        if offload_policy not in OFFLOAD_POLICIES:
            raise ValueError(f"unknown {offload_policy=}; choose one of {OFFLOAD_POLICIES}")
        if kv_offload != "off" and offload_policy == "cost" and cost_model is None:
            raise ValueError("offload_policy='cost' needs a cost model (measured bandwidth and prefill rate)")
        if isinstance(num_scheduler_steps, bool) or not isinstance(num_scheduler_steps, int) or num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps must be an integer >= 1, got {num_scheduler_steps!r}")
        if prefix_cache is not None and prefix_cache.blocks is not blocks:
            raise ValueError("prefix caching needs the prefix cache's block allocator")
        self.prefix = prefix_cache
        self.host, self.preemption_mode, self.cost_model = host, preemption_mode, cost_model
        self.kv_offload, self.offload_admission, self.offload_policy = kv_offload, offload_admission, offload_policy
        self.num_offloads_declined = 0  # offloads the cost model priced above the preemption they would avoid
        self._offloading: dict[int, OffloadOp] = {}  # seq_id -> op decided last step, committed next step
        self.num_offloaded_blocks = 0  # blocks moved to the host so far
        self.num_offload_ops = 0
        self.swapped: dict[int, HostEntry] = {}  # seq_id -> host entry of a swapped-out waiting sequence
        self.num_swap_preemptions = 0
        self.num_recompute_preemptions = 0
        self.num_swap_fallbacks = 0  # swap wanted but the host tier was full
        self.blocks, self.slots = blocks, slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # prefill tokens a step that carries decode rows may take beside them (chunks are cut to fit)
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes or max_num_batched_tokens
        # the token count of the program a mixed step of n tokens runs in (the runner's buckets): a step that
        # carries decodes fills its bucket's padding with prompt tokens, which cost about what padding costs
        self.token_bucket = token_bucket
        # prefix caching: the snapshots the program of a step (decode?, rows, tokens) takes in itself
        # (`ModelRunner.step_snapshots`); a decode row's rolling snapshot beyond them is skipped, not copied by a
        # program call of its own (None: never skipped)
        self.snapshot_budget = snapshot_budget
        self.num_rolling_snapshots_skipped = 0
        # multi-step decode: decode steps per program when every row decodes and nothing waits (1: off), and the
        # runner's check that a step's rows may run so (`ModelRunner.can_burst`; None: any may)
        self.num_scheduler_steps = num_scheduler_steps if kv_offload == "off" else 1
        self.can_burst = can_burst
        self.num_bursts = 0
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # ----------------------------------------------------------------- queue
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _tokens_left(self, seq: Sequence) -> int:
        """Tokens `seq` may still generate beyond those it has or has in flight (max_tokens, max_model_len)."""
        return min(seq.params.max_tokens - seq.num_generated, self.max_model_len - seq.num_tokens)

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether `seq`'s tokens in flight already reach its length limit (max_tokens or max_model_len): the
        read that brings them ends it (by length, or earlier by a stop), so a step that feeds them is wasted."""
        return bool(seq.num_pending) and self._tokens_left(seq) <= 0

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Ends a sequence (stop, length, abort, error) and returns its blocks and slot."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.matcher = None  # a structured-output request's grammar state (host memory) goes with it
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error

    def _release(self, seq: Sequence) -> None:
        if self.prefix is not None:  # its computed blocks stay cached; its unattached snapshots are freed
            self.prefix.release(seq.prefix, seq.token_ids, _cache_table(seq), seq.num_computed)
        op = self._offloading.pop(seq.seq_id, None)
        if op is not None:  # finished before its offload was committed: its device blocks are still in the table
            self.host.blocks.free(op.host_blocks)
        if seq.host_blocks:
            self.host.blocks.free(seq.host_blocks)
            seq.host_blocks = []
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
        if self.preemption_mode == "recompute" or n == 0 or seq.host_blocks:  # offloaded KV: recompute
            return None
        if self.preemption_mode == "auto":
            nbytes = self.host.entry_bytes(self.blocks.blocks_needed(n))
            if not self.cost_model.prefers_swap(n, nbytes):
                return None
        if not self.host.can_hold(n):
            self.num_swap_fallbacks += 1
            return None
        return self.host.reserve(n)

    def _victim(self, seq: Sequence, scheduled: set[int]) -> Sequence | None:
        """The newest running sequence other than `seq` that this step has not scheduled yet."""
        for other in reversed(self.running):
            if other is not seq and other.seq_id not in scheduled:
                return other
        return None

    def _decode_budget_left(self, num_decodes: int, num_prefill: int) -> int:
        """Prefill tokens a step with `num_decodes` decode rows and `num_prefill` prompt tokens so far may still
        take: `max_prefill_tokens_with_decodes` beside its decode rows, so that such a step stays near a decode
        step's length; with `token_bucket`, up to the end of the token bucket that cap lands the step in (the
        program runs over the whole bucket either way)."""
        cap = self.max_prefill_tokens_with_decodes
        if self.token_bucket is not None and cap < self.max_num_batched_tokens:
            bucket = min(self.token_bucket(num_decodes + cap), self.max_num_batched_tokens)
            cap = max(cap, bucket - num_decodes)
        return max(cap - num_prefill, 0)

    def _grow(self, seq: Sequence, upto: int) -> bool:
        """Gives `seq` blocks for positions < upto; False when none are left."""
        need = self.blocks.blocks_needed(upto) - _num_blocks(seq)
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
        scheduled: set[int] = set()
        num_decodes = num_prefill = 0  # this step's decode rows and prompt tokens so far (running sequences)
        self._commit_offloads()
        restores: list[tuple[int, int]] = []
        if self.prefix is not None:
            self.prefix.begin_step()
        # 1. running sequences: decoding ones (one token to feed) first, then those still prefilling, each group
        # in arrival order; when blocks run out, preempt the newest running sequence not scheduled yet
        # (one whose pending tokens reach its max_tokens or max_model_len ends once they are read: no step for it)
        decoding = [s for s in self.running if s.num_uncomputed == 1 and not self._ends_by_length(s)]
        prefilling = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decoding + prefilling:
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, budget)
            if self.prefix is not None and n > 1:
                n = self.prefix.cut(seq.num_tokens, seq.num_computed, n, seq.prefix.branch)
            while not self._grow(seq, seq.num_computed + n) and (victim := self._victim(seq, scheduled)) is not None:
                self._preempt(victim, swap_out)
                preempted.append(victim)
            if self.blocks.blocks_needed(seq.num_computed + n) <= _num_blocks(seq):
                rows.append(ScheduledRow(seq, seq.num_computed, n, seq.num_computed + n == seq.num_tokens))
                scheduled.add(seq.seq_id)
                budget -= n
                if n > 1:
                    num_prefill += n
                elif seq.num_uncomputed == 1:  # a decode row: the rest of the step's budget shrinks
                    num_decodes += 1
                    budget = min(budget, self._decode_budget_left(num_decodes, num_prefill))
            elif rows or len(self.running) > 1:
                self._preempt(seq, swap_out)  # the newest unscheduled itself; the others keep running
                preempted.append(seq)
            else:  # the engine sizes the pool for one max_model_len sequence, so this cannot happen
                raise AssertionError(f"{seq} does not fit in the KV pool alone")
        # 2. admit waiting sequences (with the prefix cache on, one whose prompt shares more with a prompt still
        # being prefilled than the cache holds waits for it, and the ones behind it go first)
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted this step with a token still on the device
                break
            if not self.slots.can_allocate(1):
                break
            if len(deferred) < self.max_num_seqs:  # (a bounded scan per step)
                freed = self._defer(seq, rows)
                if freed is not None:
                    deferred.append(self.waiting.popleft())
                    budget += freed
                    continue
            hit = self._lookup(seq)
            start = seq.num_computed  # > 0 for a swapped-out sequence, which resumes there, or a prefix hit
            n = min(seq.num_uncomputed, budget)
            if self.prefix is not None and n > 1:
                n = self.prefix.cut(seq.num_tokens, start, n, seq.prefix.branch)
            assert n >= 1, f"{seq}: waiting with nothing to feed"
            if not self._grow(seq, start + n):
                if hit is not None:  # give the shared blocks back
                    self.blocks.free(seq.block_table)
                    seq.block_table, seq.num_computed = [], 0
                    self.prefix.start_from(seq.prefix, None)
                break
            self.waiting.popleft()
            (seq.slot,) = self.slots.allocate(1)
            entry = self.swapped.pop(seq.seq_id, None)
            if entry is not None:
                assert entry.num_tokens == start, f"{seq}: host entry holds {entry.num_tokens} tokens"
                swap_in.append(SwapOp(seq, seq.block_table[: len(entry.blocks)], seq.slot, entry))
            elif hit is not None and hit.snapshot is not None:
                restores.append((hit.snapshot, seq.slot))  # every row of the slot is overwritten: not zeroed
            elif hit is not None and hit.host_snapshot is not None:
                self.prefix.ops.host_restores.append((hit.host_snapshot, seq.slot))  # from the host: not zeroed
            else:
                new_slots.append(seq.slot)
            if self.prefix is not None and entry is None:
                self.prefix.count(len(seq.prompt_ids), hit)
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = hit.num_tokens if hit is not None else 0
            seq.status = Status.RUNNING
            self.running.append(seq)
            rows.append(ScheduledRow(seq, start, n, start + n == seq.num_tokens))
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        burst = self._burst(rows) if self.num_scheduler_steps > 1 and rows and not self.waiting and not preempted else 1
        # the host advances its view now: fed tokens are computed, sampled ones pending (a burst's row: its steps)
        for row in rows:
            row.seq.num_computed += row.num_tokens + row.steps - 1
            if row.samples:
                row.seq.num_pending += row.steps
        offload = self._plan_offload(rows) if self.kv_offload != "off" else []
        snapshots = self._register(rows) if self.prefix is not None else []
        tier = self.prefix.take_ops() if self.prefix is not None and self.prefix.host is not None else None
        return SchedulerOutput(rows, preempted, new_slots, swap_out, swap_in, offload, restores, snapshots,
                               tier or None, burst)

    def _burst(self, rows: list[ScheduledRow]) -> int:
        """Makes the step a multi-step decode step when it may be one, and returns its decode steps (1: a plain
        step). It may when every row decodes an output token of a sequence that needs nothing of the host between
        its tokens (no grammar, no multi-token banned word, no host KV) and the runner can run them so. Each row
        runs as many steps as its length limit leaves and the blocks it holds or can get hold (never preempting
        for them); a step where no row would run two stays plain."""
        if self.can_burst is not None and not self.can_burst(rows):
            return 1
        for row in rows:
            seq = row.seq
            if (row.num_tokens != 1 or not row.samples or row.start < len(seq.prompt_ids) or seq.matcher is not None
                    or seq.ban_window or seq.host_blocks):
                return 1
        k, bs = self.num_scheduler_steps, self.blocks.block_size
        steps = []
        for row in rows:
            want = min(k, self._tokens_left(row.seq))
            self._grow(row.seq, row.start + want)  # as many as it can get
            steps.append(max(1, min(want, _num_blocks(row.seq) * bs - row.start)))
        if max(steps) < 2:
            return 1
        for row, n in zip(rows, steps):
            row.steps = n
        self.num_bursts += 1
        return k

    # ----------------------------------------------------------------- prefix caching
    def _lookup(self, seq: Sequence):
        """A prefix hit for a waiting sequence with nothing computed (None: no cache, no hit, a swapped-out
        sequence, or one that wants prompt log-probabilities, which need every prompt position computed). On a
        hit the sequence holds the shared blocks and starts there."""
        if (self.prefix is None or seq.num_computed or seq.seq_id in self.swapped
                or seq.params.prompt_logprobs is not None):
            return None
        hit, matched = self.prefix.lookup(seq.token_ids, seq.prefix)
        # KV matched deeper than the deepest snapshot: snapshot there this time, for the next request
        seq.prefix.branch = matched if matched > (hit.num_tokens if hit else 0) else 0
        if hit is not None:
            hit, seq.block_table = self.prefix.acquire(hit)  # (its fallback when host blocks cannot come back)
        if hit is not None:
            seq.num_computed = hit.num_tokens
            self.prefix.start_from(seq.prefix, hit)
        return hit

    def _defer(self, seq: Sequence, rows: list[ScheduledRow]) -> int | None:
        """Whether a waiting sequence should wait for a running one that is still prefilling a prefix they share
        (several requests with one system prompt that arrive together): admitted now, each would compute the
        shared part itself; a step or a few later it is a hit. It waits (an int: the tokens of `rows` given back)
        when a running sequence has not yet computed, at the start of this step, a shared prefix at least one
        block deeper than the cache's hit for `seq`; that sequence's chunk then ends where the prompts part
        (this step's row is cut there, later chunks by `PrefixCursor.branch`), so that a snapshot is taken there.
        A sequence waits only while another makes progress on its prefill, so it cannot wait forever. None: no
        reason to wait."""
        if (self.prefix is None or seq.num_computed or seq.seq_id in self.swapped
                or seq.params.prompt_logprobs is not None):
            return None
        bs = self.blocks.block_size
        limit = (len(seq.prompt_ids) - 1) // bs * bs  # a hit leaves the last token to feed
        freed, hit = None, None
        for other in self.running:
            start = other.num_computed  # where this step's row begins (the host advances it at the end)
            if start >= len(other.prompt_ids) or start + bs > limit:  # done with its prompt, or nothing to gain
                continue
            shared = _shared_prefix(seq.prompt_ids, other.prompt_ids, limit) // bs * bs
            if shared <= start:
                continue
            if hit is None:
                found, _ = self.prefix.lookup(seq.token_ids, seq.prefix)
                hit = found.num_tokens if found is not None else 0
            if shared < hit + bs:
                continue
            freed = freed or 0
            if not start < other.prefix.branch <= shared:
                other.prefix.branch = shared
            for i, row in enumerate(rows):
                if row.seq is other and row.start < shared < row.start + row.num_tokens:
                    rows[i] = ScheduledRow(other, row.start, shared - row.start, False)
                    freed += row.start + row.num_tokens - shared
        return freed

    def _register(self, rows: list[ScheduledRow]) -> list[tuple[int, int]]:
        """Registers the rows' full blocks (ids known on the host) and picks the rows whose state is snapshotted
        after this step: (sequence slot, snapshot slot) pairs. A prompt's snapshots are always taken. A decode row's
        rolling snapshot is taken only while the step's program has room for it (`snapshot_budget`), the rows whose
        last one lies furthest behind first: one skipped leaves the sequence's last one (a block or more behind), so
        a chat's next turn resumes a little earlier, where a program call of its own would have cost every step."""
        out, rolling = [], []
        bs = self.blocks.block_size
        for row in rows:
            seq, end = row.seq, row.start + row.num_tokens + row.steps - 1
            start = end - row.num_tokens  # a burst's row: its last inner step's
            if row.steps > 1 and self.prefix.has_state:  # block ends inside a burst have no state to snapshot
                self.num_rolling_snapshots_skipped += (end - 1) // bs - row.start // bs
            upto = min(end, len(seq.token_ids))
            if end % bs and upto // bs <= seq.prefix.num_blocks:
                continue  # no block to register, no snapshot point: 15 of 16 decode rows (host time per step)
            self.prefix.register(seq.prefix, seq.token_ids, _cache_table(seq), upto)
            want = self.prefix.wants_snapshot(len(seq.token_ids), len(seq.prompt_ids), start, end)
            if want == "rolling":
                rolling.append((seq.prefix.rolling_depth, end, seq))
            elif want:
                slot = self.prefix.snapshot(seq.prefix, end // bs, rolling=False, keep=end == seq.prefix.branch)
                if slot is not None:
                    out.append((seq.slot, slot))
        if rolling:
            room = len(rolling)
            if self.snapshot_budget is not None:
                room = max(0, self.snapshot_budget(all(r.num_tokens == 1 for r in rows), len(rows),
                                                   sum(r.num_tokens for r in rows)) - len(out))
                rolling.sort(key=lambda c: c[0])  # the oldest last snapshot first
            self.num_rolling_snapshots_skipped += max(0, len(rolling) - room)
            for _, end, seq in rolling[:room]:
                slot = self.prefix.snapshot(seq.prefix, end // bs, rolling=True)
                if slot is not None:
                    out.append((seq.slot, slot))
        return out

    # ----------------------------------------------------------------- offloading
    def _commit_offloads(self) -> None:
        """Last step's offloads: their data is on the host now; the device blocks become free."""
        for op in self._offloading.values():
            seq, n = op.seq, len(op.device_blocks)
            assert seq.block_table[:n] == op.device_blocks, f"{seq}: offloaded blocks moved"
            seq.host_blocks += op.host_blocks
            seq.block_table = seq.block_table[n:]
            self.blocks.free(op.device_blocks)
        self._offloading.clear()

    def _plan_offload(self, rows: list[ScheduledRow]) -> list[OffloadOp]:
        """Offloads old blocks of the longest decoding sequences until the next step fits every running
        sequence's next token (so that none is preempted), and with `offload_admission` also the first
        waiting sequence's first chunk when it could be admitted."""
        bs = self.blocks.block_size
        want = sum(self.blocks.blocks_needed(s.num_computed + 1) > _num_blocks(s) for s in self.running)
        if (self.offload_admission and self.waiting and len(self.running) < self.max_num_seqs
                and not self.waiting[0].num_pending):
            head = self.waiting[0]
            want += self.blocks.blocks_needed(head.num_computed + min(head.num_uncomputed, self.max_num_batched_tokens))
        deficit = want - self.blocks.num_free
        if deficit <= 0:
            return []
        fed = {r.seq.seq_id: r.num_tokens for r in rows}
        ops: list[OffloadOp] = []
        candidates = []
        for seq in self.running:
            if seq.num_uncomputed > 1:  # still in prefill
                continue
            # full blocks written before this step (the gather runs before it), not yet on the host
            full = (seq.num_computed - fed.get(seq.seq_id, 0)) // bs - len(seq.host_blocks)
            if full > 0:
                candidates.append((full, seq))
        candidates.sort(key=lambda c: -c[0])  # longest device-resident part first
        if candidates and self.host.reclaim is not None:  # the prefix cache's host blocks give way
            self.host.reclaim(deficit, 0)
        for full, seq in candidates:
            if deficit <= 0:
                break
            n = min(full, deficit, self.host.blocks.num_free)
            if n <= 0:
                break
            if self.offload_policy == "cost" and not self._offload_pays(seq):
                self.num_offloads_declined += 1
                continue
            op = OffloadOp(seq, seq.block_table[:n], self.host.blocks.allocate(n))
            self._offloading[seq.seq_id] = op
            ops.append(op)
            deficit -= n
            self.num_offloaded_blocks += n
            self.num_offload_ops += 1
        return ops

    def _offload_pays(self, seq: Sequence) -> bool:
        """Whether keeping `seq`'s blocks on the host for the rest of its decode frees device blocks more cheaply
        than the preemption it avoids: that of the newest running sequence (the one `schedule()` preempts first),
        priced as swap or recompute as the preemption mode and the cost model would pick. Both are compared per
        device block freed: a preemption frees all of the victim's blocks at once (a long victim covers many
        steps of growth), an offload only the blocks it moves."""
        cost = self.cost_model
        steps = self._tokens_left(seq)
        victim = self.running[-1]
        tokens = victim.num_computed
        preempt = cost.recompute_seconds(tokens)
        if self.preemption_mode != "recompute" and not victim.host_blocks:
            swap = cost.swap_seconds(self.host.entry_bytes(self.blocks.blocks_needed(tokens)))
            preempt = swap if self.preemption_mode == "swap" else min(preempt, swap)
        per_block_offload = cost.offload_seconds(self.host.block_bytes, max(steps, 1))  # at least the next step
        return per_block_offload < preempt / max(len(victim.block_table), 1)

    @property
    def num_host_resident_blocks(self) -> int:
        """Blocks of running sequences held in the host tier now (offloaded attention)."""
        return sum(len(s.host_blocks) for s in self.running)


def _cache_table(seq: Sequence) -> list[int | None]:
    """The sequence's block table by position for the prefix cache: its offloaded blocks (`kv_offload`, at the
    front) are None, as they are no longer device blocks. They were registered before they moved (a block is
    registered when the step that completes it is scheduled; one a decode step completed may still be pending:
    the cache then stops following the sequence there)."""
    return [None] * len(seq.host_blocks) + seq.block_table if seq.host_blocks else seq.block_table


def _num_blocks(seq: Sequence) -> int:
    """KV blocks the sequence holds, in both tiers."""
    return len(seq.host_blocks) + len(seq.block_table)


def _shared_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the common prefix of `a` and `b`, at most `limit` (compared a slice at a time, in C)."""
    n = min(len(a), len(b), limit)
    i, step = 0, 256
    while i < n:
        j = min(i + step, n)
        if a[i:j] != b[i:j]:
            while a[i] == b[i]:
                i += 1
            return i
        i = j
    return n
