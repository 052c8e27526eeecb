"""Offloaded attention (`kv_offload`): running sequences keep their oldest KV blocks in the host tier and
attend over them on the CPU ("cpu") or over per-step copies on the GPU ("copy"), merged with the GPU part
by LSE. Greedy outputs under forced offloading equal outputs without memory pressure, everything is freed,
and the two-part attention equals attention over the whole context."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid import LLM, SamplingParams
from tests.conftest import GREEDY
from tests.test_engine import assert_all_free


def decode_heavy_prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 128, size=n).tolist() for n in (10, 30, 25, 14, 20)]


PARAMS = SamplingParams(max_tokens=24, **GREEDY)
# a pool of 8 blocks of 8 tokens: one sequence of up to 54 tokens fits, four do not
SIZES = dict(dtype=None, max_num_seqs=4, max_model_len=64, block_size=8, num_kv_blocks=9, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def reference(tiny):
    """Each prompt run alone (no memory pressure: no offloading, no preemption) on an engine of the same
    shapes, whose programs the offloading engines share."""
    llm = LLM(tiny[1], **SIZES)
    outs = [llm.generate([p], PARAMS)[0] for p in decode_heavy_prompts()]
    assert llm.engine.num_preemptions == 0
    return [o.token_ids for o in outs]


def run_with_abort(llm: LLM):
    """Runs every prompt; once a sequence holding host blocks exists after a preemption, aborts it."""
    eng = llm.engine
    seqs = [eng.add_request(f"r{i}", p, PARAMS) for i, p in enumerate(decode_heavy_prompts())]
    aborted = None
    while eng.has_unfinished():
        eng.step()
        if aborted is None and eng.num_preemptions > 0:
            aborted = next((s for s in eng.scheduler.running if s.host_blocks), None)
            if aborted is not None:
                eng.abort(aborted.request_id)
    return seqs, aborted


@pytest.mark.parametrize("mode,overlap", [("cpu", False), pytest.param("cpu", True, marks=pytest.mark.slow),
                                          pytest.param("copy", False, marks=pytest.mark.slow)])
def test_forced_offloading_equals_no_pressure(tiny, reference, mode, overlap):
    """4 sequences of up to 54 tokens need up to 28 blocks of 8; 8 blocks and a host tier of a few blocks
    force offloading, and preemption (recompute) of sequences holding host blocks when the host is full.
    One sequence is aborted while it holds host blocks. The others' greedy tokens equal the reference."""
    llm = LLM(tiny[1], **SIZES, host_kv_memory_gb=1e-5, preemption_mode="recompute",
              kv_offload=mode, offload_overlap=overlap, offload_threads=2, offload_policy="always")
    seqs, aborted = run_with_abort(llm)
    st = llm.engine.stats()
    assert aborted is not None and aborted.finish_reason == "abort", "no sequence held host blocks after a preemption"
    for i, (seq, want) in enumerate(zip(seqs, reference)):
        if seq is not aborted:
            assert seq.output_ids == want, f"prompt {i}: {mode} offloading changed the greedy tokens"
            assert seq.finish_reason == "length"
    assert st["num_offloaded_blocks"] > 0 and st["num_steps_host"] > 0 and st["num_host_rows"] > 0, st
    assert st["num_recompute_preemptions"] > 0 and st["num_swap_preemptions"] == 0, st
    assert st["offload_bytes"] == st["num_offloaded_blocks"] * llm.engine.host.block_bytes
    if mode == "cpu":
        calls = st["num_steps_host"] * llm.model.cfg.num_full_layers  # the pipeline: one per half in decode steps
        assert calls < st["num_cpu_calls"] <= 2 * calls if overlap else st["num_cpu_calls"] == calls, st
        assert st["cpu_attention_seconds"] > 0 and st["copy_bytes"] == 0, st
        # waiting starts after submitting and ends a thread wake-up after the last result
        assert 0 <= st["cpu_wait_seconds"] <= st["cpu_job_seconds"] + 2e-3 * st["num_cpu_calls"], st
    else:
        assert st["copy_bytes"] > 0 and st["num_cpu_calls"] == 0, st
    assert_all_free(llm)
    host = llm.engine.host
    assert host.blocks.num_used == 0 and host.slots.num_used == 0, "host tier leaked"
    assert st["host_resident_blocks"] == 0


@pytest.mark.slow
def test_cost_policy_declines_offloads_that_cost_more_than_recomputing(tiny, reference):
    """The engine's default policy with given rates: prefill at 1e9 tokens/s makes every recompute cheaper
    than copying blocks for the steps left, so nothing is offloaded, sequences are recomputed instead, and the
    greedy tokens equal the reference."""
    llm = LLM(tiny[1], **SIZES, host_kv_memory_gb=1e-5, preemption_mode="recompute",
              kv_offload="copy", swap_bandwidth_gbps=1.0, prefill_tokens_per_s=1e9)
    outs = llm.generate(decode_heavy_prompts(), PARAMS)
    st = llm.engine.stats()
    assert [o.token_ids for o in outs] == reference
    assert st["num_offloaded_blocks"] == 0 and st["num_offloads_declined"] > 0, st
    assert st["num_recompute_preemptions"] > 0 and st["num_steps_host"] == 0, st
    assert_all_free(llm)


def test_bad_offload_configs_are_refused(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="host_kv_memory_gb"):
        LLM(model, dtype=None, max_num_seqs=2, max_model_len=64, kv_offload="cpu")
    with pytest.raises(ValueError, match="kv_offload"):
        LLM(model, dtype=None, max_num_seqs=2, max_model_len=64, host_kv_memory_gb=0.01, kv_offload="gpu")
    with pytest.raises(ValueError, match="offload_policy"):
        LLM(model, dtype=None, max_num_seqs=2, max_model_len=64, host_kv_memory_gb=0.01, kv_offload="copy",
            offload_policy="sometimes")


# ---------------------------------------------------------------- the two parts of one layer's attention
@pytest.mark.parametrize("impl", ["reference", "pallas"])
@pytest.mark.parametrize("decode", [True, False])
def test_two_part_attention_equals_whole(impl, decode):
    """Rows whose first `n_host` blocks are in host arrays: the device part (compacted block table, positions
    shifted by -n_host * BS; NaN-poisoned pages nobody owns) merged with the CPU part (threaded, through
    `HostAttention`) equals attention over the whole context in one table. Rows with nothing on the host
    (n_host = 0) and with only the current block on the device are included."""
    from jhybrid.cache.host_attention import host_paged_attention  # noqa: F401 (what HostAttention runs)
    from jhybrid.engine.offload import HostAttention
    from pallas_kernels.paged_attention import merge_attention, paged_attention, paged_attention_reference

    rng = np.random.default_rng(5 + decode)
    bs, kvh, group, hd = 4, 2, 3, 16
    h = kvh * group
    lengths = np.array([1, 5, 9, 17, 32, 33, 12])  # context of each row, its query included
    n_host = np.array([0, 1, 2, 4, 7, 0, 2])  # full blocks before the query's block
    rows = len(lengths)
    pages = 64
    k_all = rng.normal(size=(pages, bs, kvh, hd)).astype(np.float32)
    v_all = rng.normal(size=(pages, bs, kvh, hd)).astype(np.float32)
    perm = rng.permutation(np.arange(1, pages))
    m = 10
    full_tables = np.zeros((rows, m), np.int32)
    pos = 0
    for b, n in enumerate(lengths):
        nb = -(-n // bs)
        full_tables[b, :nb] = perm[pos : pos + nb]
        pos += nb
    assert np.all(n_host * bs < lengths)  # the query's own block is always on the device
    # device pool: only the device blocks hold data, the host blocks' device copies are poisoned
    k_dev, v_dev = k_all.copy(), v_all.copy()
    dev_tables = np.zeros_like(full_tables)
    host_tables = np.zeros_like(full_tables)
    owned = set()
    for b in range(rows):
        nb = -(-lengths[b] // bs)
        host_tables[b, : n_host[b]] = full_tables[b, : n_host[b]]
        dev_tables[b, : nb - n_host[b]] = full_tables[b, n_host[b] : nb]
        owned.update(dev_tables[b, : nb - n_host[b]].tolist())
    poison = [p for p in range(pages) if p not in owned]
    k_dev[poison] = np.nan
    v_dev[poison] = np.nan
    k_host, v_host = np.full_like(k_all, np.nan), np.full_like(v_all, np.nan)  # only host blocks are valid
    for b in range(rows):
        k_host[host_tables[b, : n_host[b]]] = k_all[host_tables[b, : n_host[b]]]
        v_host[host_tables[b, : n_host[b]]] = v_all[host_tables[b, : n_host[b]]]
    # queries: one per row (decode) or the last 3 positions of each row with >= 3 keys on the device (ragged)
    q_rows, q_pos = [], []
    for b in range(rows):
        last = lengths[b] - 1
        firsts = [last] if decode else list(range(max(n_host[b] * bs, last - 2), last + 1))
        q_rows += [b] * len(firsts)
        q_pos += firsts
    q_rows, q_pos = np.array(q_rows), np.array(q_pos)
    cu = np.concatenate([[0], np.cumsum(np.bincount(q_rows, minlength=rows))])
    q = rng.normal(size=(len(q_rows), h, hd)).astype(np.float32)
    kw = dict(impl=impl, interpret=impl == "pallas", decode=decode, cu_seqlens=jnp.asarray(cu), return_lse=True)
    o_all, lse_all = paged_attention_reference(jnp.asarray(q), jnp.asarray(k_all), jnp.asarray(v_all),
                                               jnp.asarray(full_tables), jnp.asarray(q_rows), jnp.asarray(q_pos),
                                               return_lse=True)
    shifted = q_pos - n_host[q_rows] * bs
    o_dev, lse_dev = paged_attention(jnp.asarray(q), jnp.asarray(k_dev), jnp.asarray(v_dev), jnp.asarray(dev_tables),
                                     jnp.asarray(q_rows), jnp.asarray(shifted), **kw)

    class Host:  # what HostAttention reads of the host tier
        k, v = (k_host,), (v_host,)

    class Cfg:
        attention_scale = None

    attn = HostAttention(Cfg(), Host(), "cpu", num_threads=3)
    step = attn.register_step(host_tables[q_rows])  # the tables stay on the host; the step id travels
    o_host, lse_host = attn.attend(0, step, 0, q, n_host[q_rows] * bs)
    assert np.all(np.isneginf(lse_host[n_host[q_rows] == 0]))
    o, lse = merge_attention(o_dev, lse_dev, jnp.asarray(o_host), jnp.asarray(lse_host))
    o, lse = np.asarray(o), np.asarray(lse)
    assert np.isfinite(o).all(), "a poisoned page or an empty part leaked NaN"
    err = np.abs(o - np.asarray(o_all)).max()
    rel = np.sqrt(np.mean((o - np.asarray(o_all)) ** 2) / np.mean(np.asarray(o_all) ** 2))
    assert err < 2e-5, f"{impl} decode={decode}: merged output max abs err {err:.2e}, rel rms {rel:.2e}"
    np.testing.assert_allclose(lse, np.asarray(lse_all), rtol=1e-5, atol=1e-5)
    # and the parts are not trivially equal to the whole: the host part matters for rows that have one
    has_host = n_host[q_rows] > 0
    assert np.abs(np.asarray(o_dev)[has_host] - np.asarray(o_all)[has_host]).max() > 1e-2


def test_host_attention_widens_bfloat16_exactly():
    """The host tier's bf16 pages are widened by bit shifts (not ml_dtypes' cast): same result as fp32 pages."""
    import ml_dtypes

    from jhybrid.cache.host_attention import host_paged_attention

    rng = np.random.default_rng(1)
    k, v = (rng.standard_normal((9, 4, 2, 16), np.float32).astype(ml_dtypes.bfloat16) for _ in range(2))
    q = rng.standard_normal((3, 4, 16), np.float32)
    tables, lengths = np.array([[1, 2, 3], [4, 5, 0], [6, 7, 8]]), np.array([10, 6, 0])
    o_bf16, lse_bf16 = host_paged_attention(q, k, v, tables, lengths)
    o_f32, lse_f32 = host_paged_attention(q, k.astype(np.float32), v.astype(np.float32), tables, lengths)
    np.testing.assert_array_equal(o_bf16, o_f32)
    np.testing.assert_array_equal(lse_bf16, lse_f32)
    assert np.isneginf(lse_bf16[2]).all() and np.isfinite(lse_bf16[:2]).all()


def test_scheduler_offloads_oldest_full_blocks_of_the_longest_decoding_sequence():
    """Host bookkeeping only: the plan takes the longest decoding sequence's oldest full blocks (written
    before this step), the device blocks stay in its table until the next schedule() commits the move, and
    finishing frees both tiers."""
    from jhybrid.cache.allocator import BlockAllocator, SlotAllocator
    from jhybrid.cache.host_tier import HostAllocator
    from jhybrid.engine.scheduler import Scheduler
    from jhybrid.engine.sequence import Sequence

    blocks, slots, host = BlockAllocator(9, 4), SlotAllocator(3), HostAllocator(20, 3, 4)
    sched = Scheduler(blocks, slots, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, host=host,
                      preemption_mode="recompute", kv_offload="cpu", offload_policy="always")
    long, short = Sequence("long", list(range(13)), PARAMS), Sequence("short", list(range(6)), PARAMS)
    sched.add(long)
    sched.add(short)

    def step(out):  # the engine's read: every sampled token arrives
        for row in out.rows:
            if row.samples:
                row.seq.num_pending -= 1
                row.seq.token_ids.append(0)

    out = sched.schedule()  # both prefill: 4 + 2 blocks of the 8
    assert not out.offload and blocks.num_free == 2
    step(out)
    for _ in range(12):  # decode until the next step would not fit
        out = sched.schedule()
        step(out)
        if out.offload:
            break
    assert out.offload, "no offload when the pool ran short"
    assert blocks.num_free < sum(blocks.blocks_needed(s.num_computed + 1) > len(s.block_table) for s in (long, short))
    (op,) = out.offload
    assert op.seq is long and op.device_blocks == long.block_table[: len(op.device_blocks)]
    assert long.host_blocks == [], "committed before the data reached the host"
    moved = list(op.device_blocks)
    out = sched.schedule()  # commits: the device blocks are free for reuse, the host blocks hold them
    assert long.host_blocks == op.host_blocks and not set(moved) & set(long.block_table)
    assert len(long.host_blocks) * 4 <= long.num_computed - 1, "offloaded a block that was not full"
    assert sched.num_host_resident_blocks == len(long.host_blocks)
    sched.finish(long, "abort")
    sched.finish(short, "abort")
    assert blocks.num_used == 0 and host.blocks.num_used == 0 and slots.num_used == 0


@pytest.mark.parametrize("admission", [False, True])
def test_offloading_to_admit_a_waiting_sequence_is_opt_in(admission):
    """A running sequence whose next token fits is never offloaded just to admit a waiting one, unless
    `offload_admission`: then its oldest full blocks go to the host so the waiting prompt's first chunk fits."""
    from jhybrid.cache.allocator import BlockAllocator, SlotAllocator
    from jhybrid.cache.host_tier import HostAllocator
    from jhybrid.engine.scheduler import Scheduler
    from jhybrid.engine.sequence import Sequence

    blocks, slots, host = BlockAllocator(8, 4), SlotAllocator(3), HostAllocator(20, 3, 4)
    sched = Scheduler(blocks, slots, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, host=host,
                      preemption_mode="recompute", kv_offload="copy", offload_admission=admission,
                      offload_policy="always")
    long, big = Sequence("long", list(range(20)), PARAMS), Sequence("big", list(range(16)), PARAMS)
    sched.add(long)
    sched.add(big)
    out = sched.schedule()  # long's 5 blocks fit, big's 4 do not: big waits
    assert [r.seq for r in out.rows] == [long] and blocks.num_free == 2 and sched.waiting[0] is big
    for row in out.rows:
        row.seq.num_pending -= 1
        row.seq.token_ids.append(0)
    out = sched.schedule()  # long decodes; its next token needs 1 of the 2 free blocks
    assert [r.seq for r in out.rows] == [long]
    if admission:
        (op,) = out.offload
        assert op.seq is long and len(op.device_blocks) == 3  # 4 blocks for big + 1 for long, 2 free
    else:
        assert out.offload == [] and sched.num_offloaded_blocks == 0
    sched.finish(long, "abort")
    sched.finish(big, "abort")
    sched.schedule()
    assert host.blocks.num_used == 0


@pytest.mark.parametrize("prefill_rate,max_tokens,offloads", [
    (1e2, 10, True),  # slow prefill, 3 steps left: 3 ms of copies a block against ~30 ms of recompute a block
    (1e6, 10, False),  # fast prefill: ~3 us of recompute a block against 3 ms of copies
    (1e2, 4000, False),  # slow prefill but ~4000 steps left: 4 s of copies a block against ~30 ms
    (1e2, 67, False),  # ~60 ms a block: below the whole ~130 ms recompute, above its ~30 ms per block freed
])
def test_cost_policy_offloads_only_where_it_pays(prefill_rate, max_tokens, offloads):
    """offload_policy="cost": the plan offloads a sequence's blocks only where `steps left x bytes / H2D` per block
    is below the preemption it avoids (the newest running sequence, recomputed) per block that frees; otherwise
    it declines, and the next schedule() preempts as without offloading. The last case sits between the
    per-block and the whole-preemption price."""
    from jhybrid.cache.allocator import BlockAllocator, SlotAllocator
    from jhybrid.cache.host_tier import HostAllocator, SwapCostModel
    from jhybrid.engine.scheduler import Scheduler
    from jhybrid.engine.sequence import Sequence

    # 1 MB blocks at 1 GB/s: 1 ms a block a step; recomputing the victim's ~13 tokens (4 blocks) at prefill_rate
    cost = SwapCostModel(h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9, prefill_tokens_per_s=prefill_rate)
    blocks, slots = BlockAllocator(9, 4), SlotAllocator(3)
    host = HostAllocator(20, 3, 4, block_bytes=1 << 20, slot_bytes=1 << 20)
    sched = Scheduler(blocks, slots, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=8192, host=host,
                      preemption_mode="recompute", cost_model=cost, kv_offload="copy")
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    long, short = Sequence("long", list(range(13)), params), Sequence("short", list(range(6)), params)
    sched.add(long)
    sched.add(short)
    planned = declined_at = None
    for _ in range(14):
        out = sched.schedule()
        if out.preempted:
            break
        for row in out.rows:
            if row.samples:
                row.seq.num_pending -= 1
                row.seq.token_ids.append(0)
        if out.offload and planned is None:
            planned = out.offload
        if sched.num_offloads_declined and declined_at is None:
            declined_at = long.num_generated
    if offloads:
        assert planned and planned[0].seq is long and sched.num_offloads_declined == 0
    else:
        assert planned is None and sched.num_offloads_declined > 0 and declined_at is not None
        assert out.preempted == [short], "a declined offload must leave the preemption it would have avoided"
    for seq in (long, short):
        sched.finish(seq, "abort")
    sched.schedule()
    assert blocks.num_used == 0 and host.blocks.num_used == 0
