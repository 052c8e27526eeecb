"""Randomised property test of the scheduler and allocators (host only, no model).

Hypothesis drives synthetic arrivals, engine steps (read one step behind, as the engine does, through the
engine's own token handling (`LLMEngine._read`: `_take_tokens` and `_finish_lit`) on random "sampled" tokens: EOS, length and
max_model_len stops), aborts and the preemptions a small pool forces, and checks the invariants after every step: no block or
slot held twice, used counts equal what sequences hold, every fed token has KV room, every row's tokens
are known on the host or sampled by the previous step, and in the end every request finished (with a
reason) and everything is free. With a host tier (swap preemption), also: a swapped-out sequence holds
exactly one host entry (slot + blocks for the tokens it had computed) and no device memory, resumes at the
position it stopped, and the host allocators agree with the entries.
"""

from __future__ import annotations

import collections
import random
from types import SimpleNamespace

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jhybrid.cache.allocator import BlockAllocator, SlotAllocator
from jhybrid.cache.host_tier import HostAllocator, SwapCostModel
from jhybrid.engine.llm_engine import LLMEngine
from jhybrid.engine.sampling import SamplingParams
from jhybrid.engine.scheduler import Scheduler, SchedulerOutput
from jhybrid.engine.sequence import Sequence, Status

EOS = 0  # the token id that stops a sequence (unless it ignores EOS)


class HostEngine(LLMEngine):
    """The engine's host half without a model: its own read (`LLMEngine._read`: append each sampling row's token
    unless the sequence finished meanwhile, stop on EOS / stop ids / `max_tokens` / `max_model_len`) reads a
    step's tokens, drawn at random from `vocab` ids (EOS among them) in place of a device's."""

    def __init__(self, scheduler: Scheduler, max_model_len: int, rng: random.Random, vocab: int = 20):
        self.scheduler, self.max_model_len, self.eos_token_ids = scheduler, max_model_len, frozenset({EOS})
        self.rng, self.vocab = rng, vocab
        self.timing = collections.defaultdict(float)

    def read(self, step: SchedulerOutput) -> None:
        """Reads `step`; a multi-step one (`burst` > 1) with `[burst, rows]` tokens, as the runner returns them."""
        shape = (step.burst, len(step.rows)) if step.burst > 1 else (len(step.rows),)
        tokens = np.array([self.rng.randrange(self.vocab) for _ in range(int(np.prod(shape)))]).reshape(shape)
        logp = np.zeros(shape, np.float32)
        self._read(SimpleNamespace(sched=step, plp_rows=(), fetch_tokens=lambda: (tokens, logp), burst=step.burst,
                                   num_rows=len(step.rows),
                                   fetch=lambda: (tokens, logp, None, None), fetch_prompt_logprobs=lambda: None))


def check_invariants(sched: Scheduler, blocks: BlockAllocator, slots: SlotAllocator, all_seqs: list[Sequence],
                     host: HostAllocator | None = None):
    held_blocks, held_slots = [], []
    if host is not None:
        assert set(host.entries) == {e.slot for e in sched.swapped.values()}, "host entries != swapped sequences"
        host_blocks = [b for e in host.entries.values() for b in e.blocks]
        assert len(host_blocks) == len(set(host_blocks)) == host.blocks.num_used, "a host block is held twice or leaked"
        assert len(host.entries) == host.slots.num_used, "a host slot leaked"
        assert host.blocks.num_used + host.blocks.num_free == host.blocks.capacity - 1
    for seq in all_seqs:
        entry = sched.swapped.get(seq.seq_id)
        if entry is not None:
            assert seq.status is Status.WAITING and seq in sched.waiting, f"{seq} swapped but not waiting"
            assert entry.num_tokens == seq.num_computed > 0 and len(entry.blocks) == blocks.blocks_needed(seq.num_computed)
        elif seq.status is Status.WAITING:
            assert seq.num_computed == 0, f"{seq} waits to be recomputed but claims computed tokens"
    for seq in all_seqs:
        if seq.status is Status.RUNNING:
            assert seq in sched.running
            assert seq.slot != 0 and 0 not in seq.block_table
            assert blocks.blocks_needed(seq.num_computed) <= len(seq.block_table), f"{seq}: fed tokens without KV room"
            held_blocks += seq.block_table
            held_slots.append(seq.slot)
        else:
            assert seq.block_table == [] and seq.slot == 0, f"{seq} holds memory while {seq.status}"
        assert 0 <= seq.num_pending <= 2 * sched.num_scheduler_steps
        # (a sequence that stopped inside a multi-step decode step has computed positions past its end)
        assert seq.num_computed <= seq.num_tokens or seq.is_finished
    assert len(held_blocks) == len(set(held_blocks)) == blocks.num_used, "a block is held twice or leaked"
    assert len(held_slots) == len(set(held_slots)) == slots.num_used, "a slot is held twice or leaked"
    assert blocks.num_used + blocks.num_free == blocks.capacity - 1
    assert slots.num_used + slots.num_free == slots.capacity - 1
    assert len(sched.running) <= sched.max_num_seqs


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    block_size=st.integers(1, 8),
    extra_blocks=st.integers(0, 8),
    num_slots=st.integers(2, 7),
    budget=st.integers(1, 64),
    events=st.lists(st.tuples(st.sampled_from(["arrive", "arrive", "step", "step", "step", "abort"]), st.integers(0, 10**6)),
                    min_size=20, max_size=120),
    seed=st.integers(0, 2**16),
    mode=st.sampled_from(["recompute", "swap", "swap", "auto"]),
    host_blocks=st.integers(2, 24),
    host_slots=st.integers(2, 5),
    burst=st.sampled_from([1, 1, 3]),
)
def test_scheduler_invariants(block_size, extra_blocks, num_slots, budget, events, seed, mode, host_blocks, host_slots,
                              burst):
    """`burst` > 1: multi-step decode (`num_scheduler_steps`): its steps' rows may run several decode steps, each
    grown the blocks it runs and stopped by its length limit; the read then ends each sequence at its first stop
    among them (checked at the end)."""
    rng = random.Random(seed)
    max_model_len = 4 * block_size + rng.randrange(1, 40)
    num_blocks = -(-max_model_len // block_size) + 1 + extra_blocks  # always fits one full sequence
    blocks, slots = BlockAllocator(num_blocks, block_size), SlotAllocator(num_slots)
    host = None if mode == "recompute" else HostAllocator(host_blocks, host_slots, block_size, block_bytes=100, slot_bytes=300)
    cost = SwapCostModel(h2d_bytes_per_s=1e3, d2h_bytes_per_s=1e3, prefill_tokens_per_s=rng.choice([1.0, 10.0, 1e3]))
    sched = Scheduler(blocks, slots, max_num_seqs=rng.randrange(1, num_slots), max_num_batched_tokens=budget,
                      max_model_len=max_model_len, host=host, preemption_mode=mode, cost_model=cost,
                      num_scheduler_steps=burst)
    engine = HostEngine(sched, max_model_len, rng)
    seqs: list[Sequence] = []
    prev = None
    bursts = 0

    def step():
        nonlocal prev, bursts
        out = sched.schedule() if sched.has_work() else None
        if out is not None:
            assert out.num_tokens <= budget and len(out.rows) <= sched.max_num_seqs
            sampled_last = {id(r.seq): r.steps for r in prev.rows if r.samples} if prev is not None else {}
            for row in out.rows:
                assert row.num_tokens >= 1 and row.seq.status is Status.RUNNING
                known = len(row.seq.token_ids) + sampled_last.get(id(row.seq), 0)
                assert row.start + row.num_tokens <= known, f"{row.seq}: row needs tokens nobody sampled"
                assert 1 <= row.steps <= out.burst and (row.steps == 1 or row.num_tokens == 1)
                limit = min(row.seq.params.max_tokens + len(row.seq.prompt_ids), max_model_len)
                assert row.seq.num_tokens <= limit, f"{row.seq}: steps past its length limit"
            bursts += out.burst > 1
            assert len({id(r.seq) for r in out.rows}) == len(out.rows), "a sequence got two rows"
            resumed = {id(op.seq): op for op in out.swap_in}
            for row in out.rows:
                op = resumed.get(id(row.seq))
                assert row.start == (op.entry.num_tokens if op else row.start), f"{row.seq} resumed elsewhere"
            for op in out.swap_out:  # what the engine's swapper checks and does
                assert len(op.device_blocks) == len(op.entry.blocks) and op.device_slot > 0 and 0 not in op.device_blocks
            for op in out.swap_in:
                assert op.seq.slot == op.device_slot and op.device_blocks == op.seq.block_table[: len(op.entry.blocks)]
                assert op.device_slot not in out.new_slots, "a restored slot would be zeroed"
                host.release(op.entry.slot)
        if prev is not None:
            engine.read(prev)
        prev = out if out is not None and out.rows else None
        check_invariants(sched, blocks, slots, seqs, host)

    for kind, value in events:
        if kind == "arrive":
            prompt = [value % 97] * (1 + value % (max_model_len - 1))
            stop_ids = (value % 20,) if value % 3 == 0 else ()
            seqs.append(Sequence(len(seqs), prompt, SamplingParams(max_tokens=1 + value % 12, stop_token_ids=stop_ids)))
            sched.add(seqs[-1])
        elif kind == "abort" and seqs:
            sched.finish(seqs[value % len(seqs)], "abort")
        else:
            step()
    for _ in range(20_000):  # drain: every request must finish
        if not sched.has_work() and prev is None:
            break
        step()
    assert all(s.is_finished and s.finish_reason in ("stop", "length", "abort") for s in seqs)
    for s in seqs:  # each ended where the engine's stop rules say: at its first stop token, or at its length limit
        out = s.output_ids
        stops = [i for i, t in enumerate(out) if t == EOS or t in s.params.stop_token_ids]
        if s.finish_reason == "stop":
            assert stops == [len(out) - 1], f"{s}: stopped at {stops} of {out}"
        elif s.finish_reason == "length":
            assert not stops and (len(out) == s.params.max_tokens or len(s.token_ids) == max_model_len), (s, out)
    assert blocks.num_used == 0 and slots.num_used == 0
    assert all(s.num_pending == 0 for s in seqs)
    assert burst > 1 or not bursts
    if host is not None:
        assert host.blocks.num_used == 0 and host.slots.num_used == 0 and not host.entries and not sched.swapped


def test_preemption_happens_and_recovers():
    """A pool too small for all running sequences preempts (recompute) and still finishes every request."""
    blocks, slots = BlockAllocator(12, 4), SlotAllocator(5)
    sched = Scheduler(blocks, slots, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=40)
    seqs = [Sequence(i, [1] * 10, SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    engine, prev, preempted = HostEngine(sched, 40, random.Random(0)), None, 0
    while sched.has_work() or prev is not None:
        out = sched.schedule() if sched.has_work() else None
        preempted += len(out.preempted) if out else 0
        if prev is not None:
            engine.read(prev)
        prev = out if out is not None and out.rows else None
        check_invariants(sched, blocks, slots, seqs)
    assert preempted > 0
    assert all(s.finish_reason == "length" and len(s.output_ids) == 20 for s in seqs)
    assert any(s.num_preemptions for s in seqs)


def test_swap_preemption_resumes_without_refeeding():
    """With room on the host, preempted sequences swap out and resume where they stopped: no token is fed twice."""
    blocks, slots = BlockAllocator(12, 4), SlotAllocator(5)
    host = HostAllocator(64, 5, 4, block_bytes=100, slot_bytes=300)
    sched = Scheduler(blocks, slots, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=40, host=host,
                      preemption_mode="swap")
    seqs = [Sequence(i, [1] * 10, SamplingParams(max_tokens=20, ignore_eos=True)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    engine, prev, fed = HostEngine(sched, 40, random.Random(0)), None, {s.seq_id: 0 for s in seqs}
    while sched.has_work() or prev is not None:
        out = sched.schedule() if sched.has_work() else None
        if out:
            for row in out.rows:
                fed[row.seq.seq_id] += row.num_tokens
            for op in out.swap_in:
                host.release(op.entry.slot)
        if prev is not None:
            engine.read(prev)
        prev = out if out is not None and out.rows else None
        check_invariants(sched, blocks, slots, seqs, host)
    assert sched.num_swap_preemptions > 0 and sched.num_recompute_preemptions == 0
    assert all(s.finish_reason == "length" and len(s.output_ids) == 20 for s in seqs)
    for s in seqs:  # the prompt and every output but the last, once (a row after the stop may feed one more)
        assert len(s.token_ids) - 1 <= fed[s.seq_id] <= len(s.token_ids), (s, fed[s.seq_id])
    assert host.blocks.num_used == host.slots.num_used == 0


def test_prefill_beside_decodes_is_capped():
    """With `max_prefill_tokens_with_decodes`, the prefill rows of a step that has decode rows take at most that
    many tokens, decode rows first; a step without decode rows gives a prompt the whole budget. Checked to
    fail: without the cap the second step feeds 255 prompt tokens."""
    blocks, slots = BlockAllocator(200, 16), SlotAllocator(9)
    sched = Scheduler(blocks, slots, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
                      max_prefill_tokens_with_decodes=64)
    short = Sequence("short", [1, 2, 3], SamplingParams(max_tokens=4))
    long = Sequence("long", list(range(1000)), SamplingParams(max_tokens=4))
    sched.add(short)
    sched.add(long)
    first = sched.schedule()  # no decode rows yet: the whole budget
    assert [(r.seq, r.num_tokens) for r in first.rows] == [(short, 3), (long, 253)]
    short.num_pending -= 1  # its sampled token reaches the host: one token to feed
    short.token_ids.append(7)
    second = sched.schedule()
    assert [(r.seq, r.num_tokens) for r in second.rows] == [(short, 1), (long, 64)]


def test_prefill_beside_decodes_fills_the_token_bucket():
    """With the runner's token buckets (`token_bucket`), a step with decode rows takes prompt tokens up to the end
    of the bucket its cap lands it in: the program runs over the whole bucket anyway, so its padding is free
    prefill (1 decode + 64 capped = 65 tokens -> the 128-token bucket: 127 prompt tokens). Checked to fail with
    the fill removed from `_decode_budget_left` (64 prompt tokens)."""
    blocks, slots = BlockAllocator(200, 16), SlotAllocator(9)
    sched = Scheduler(blocks, slots, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048,
                      max_prefill_tokens_with_decodes=64, token_bucket=lambda n: max(64, 1 << (n - 1).bit_length()))
    short = Sequence("short", [1, 2, 3], SamplingParams(max_tokens=4))
    long = Sequence("long", list(range(1000)), SamplingParams(max_tokens=4))
    sched.add(short)
    sched.add(long)
    first = sched.schedule()
    assert [(r.seq, r.num_tokens) for r in first.rows] == [(short, 3), (long, 253)]
    short.num_pending -= 1
    short.token_ids.append(7)
    second = sched.schedule()
    assert [(r.seq, r.num_tokens) for r in second.rows] == [(short, 1), (long, 127)]
    assert second.num_tokens == 128
