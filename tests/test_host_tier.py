"""The host tier: swap out + in is bit-exact, greedy outputs under forced swapping equal outputs without
memory pressure (each request run alone, tests/conftest.py `alone`), everything is returned, and moves of KV
without state (or state without KV) fail."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid import LLM, SamplingParams
from jhybrid.cache.host_tier import HostEntry, HostTier, SwapCostModel, plan_host_tier
from jhybrid.cache.state import CacheConfig, HybridState, init_state
from jhybrid.engine.scheduler import SwapOp
from jhybrid.engine.swap import Swapper
from tests.conftest import ENGINE, GREEDY, prompts_1_to_300
from tests.test_engine import assert_all_free


def random_state(cfg, cache: CacheConfig, seed: int) -> HybridState:
    state = init_state(cfg, cache)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype) for k, x in zip(keys, leaves)])


def host_for(cfg, cache, gb=0.01, max_num_seqs=4) -> HostTier:
    return HostTier(cfg, plan_host_tier(cfg, cache, host_kv_memory_gb=gb, max_num_seqs=max_num_seqs))


def assert_host_free(llm: LLM):
    host = llm.engine.host
    assert host.blocks.num_used == 0 and host.slots.num_used == 0 and not host.entries, "host tier leaked"
    assert not llm.engine.scheduler.swapped


@pytest.mark.parametrize("kv_dtype,transfer", [("float32", "pageable"), ("bfloat16", "pageable"), ("bfloat16", "pinned")])
def test_swap_out_and_in_is_bit_exact(tiny, kv_dtype, transfer):
    cfg = tiny[1].cfg
    cache = CacheConfig(num_blocks=12, block_size=4, num_slots=5, kv_dtype=kv_dtype)
    state = random_state(cfg, cache, seed=1)
    before = jax.tree.map(np.asarray, state)
    host = host_for(cfg, cache)
    swapper = Swapper(host, transfer)
    src_blocks, src_slot = [3, 7, 5], 2
    entry = host.reserve(3 * 4 - 1)  # 11 tokens: 3 blocks
    swapper.swap_out(state, [SwapOp("seq", src_blocks, src_slot, entry)])
    swapper.flush()
    if transfer == "pinned":  # the data stays in pinned memory; the NumPy arrays are not written
        assert swapper.num_resident == 1
        assert not any(a[entry.blocks].any() for a in host.k + host.v)
        assert not any(a[entry.slot].any() for a in host.conv + host.ssm)
    # the device pages and slot are reused by someone else meanwhile
    state = random_state(cfg, cache, seed=2)
    other = jax.tree.map(np.asarray, state)
    dst_blocks, dst_slot = [9, 1, 4], 3
    state = swapper.swap_in(state, [SwapOp("seq", dst_blocks, dst_slot, entry)])
    after = jax.tree.map(np.asarray, state)
    assert not host.entries and host.blocks.num_used == 0 and host.slots.num_used == 0
    assert swapper.num_resident == 0
    for name in ("k_pages", "v_pages"):
        for i, (a, b, o) in enumerate(zip(getattr(after, name), getattr(before, name), getattr(other, name))):
            assert a.dtype == jnp.dtype(kv_dtype)
            np.testing.assert_array_equal(a[dst_blocks].view(np.uint8), b[src_blocks].view(np.uint8), err_msg=f"{name}[{i}]")
            untouched = [p for p in range(1, cache.num_blocks) if p not in dst_blocks]  # page 0 takes padding
            np.testing.assert_array_equal(a[untouched], o[untouched], err_msg=f"{name}[{i}] other pages")
    for name in ("conv", "ssm"):
        for j, (a, b, o) in enumerate(zip(getattr(after, name), getattr(before, name), getattr(other, name))):
            np.testing.assert_array_equal(a[dst_slot].view(np.uint32), b[src_slot].view(np.uint32), err_msg=f"{name}[{j}]")
            keep = [s for s in range(cache.num_slots) if s != dst_slot]
            np.testing.assert_array_equal(a[keep], o[keep], err_msg=f"{name}[{j}] other slots")
    assert swapper.stats.bytes_out == swapper.stats.bytes_in == host.entry_bytes(3) > 0


def test_moves_without_both_halves_are_refused(tiny):
    cfg = tiny[1].cfg
    cache = CacheConfig(num_blocks=12, block_size=4, num_slots=5, kv_dtype="float32")
    state = random_state(cfg, cache, seed=3)
    host = host_for(cfg, cache)
    swapper = Swapper(host)
    entry = host.reserve(8)  # 2 blocks
    with pytest.raises(ValueError, match="without its sequence's state"):  # KV without the state slot
        swapper.swap_out(state, [SwapOp("seq", [3, 4], 0, entry)])
    with pytest.raises(ValueError, match="without all of its sequence's KV"):  # state without (all) its KV
        swapper.swap_out(state, [SwapOp("seq", [3], 2, entry)])
    with pytest.raises(ValueError, match="without all of its sequence's KV"):
        swapper.swap_out(state, [SwapOp("seq", [], 2, HostEntry(entry.slot, [], 0))])
    with pytest.raises(ValueError, match="holds no swapped sequence"):  # a host slot that holds nothing
        swapper.swap_in(state, [SwapOp("seq", [3, 4], 2, HostEntry(entry.slot + 1, entry.blocks, 8))])
    with pytest.raises(ValueError, match="not those of host slot"):  # someone else's KV with this state
        host.read(entry.slot, [entry.blocks[0], entry.blocks[1] + 1])
    k, v, conv, ssm = host.read(entry.slot, entry.blocks)
    with pytest.raises(ValueError, match="without its sequence's state"):
        host.write(entry.slot, entry.blocks, k, v, (), ())
    with pytest.raises(ValueError, match="without all its layers"):
        host.write(entry.slot, entry.blocks, k[:-1], v, conv, ssm)
    host.release(entry.slot)
    assert host.blocks.num_used == host.slots.num_used == 0


def test_engine_options_are_checked(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="host_kv_memory_gb"):
        LLM(model, dtype=None, max_num_seqs=2, max_model_len=64, preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(model, dtype=None, max_num_seqs=2, max_model_len=64, preemption_mode="sometimes")
    with pytest.raises(ValueError, match="host_kv_memory_gb"):
        LLM(model, dtype=None, max_num_seqs=2, max_model_len=64, host_kv_memory_gb=1e-9, preemption_mode="swap")
    with pytest.raises(ValueError, match="swap_transfer='dma'"):
        LLM(model, dtype=None, max_num_seqs=2, max_model_len=64, host_kv_memory_gb=0.01, swap_transfer="dma")
    with pytest.raises(ValueError, match="rates must be > 0"):
        SwapCostModel(h2d_bytes_per_s=1.0, d2h_bytes_per_s=0.0, prefill_tokens_per_s=1.0)


def pressured(model, **kw) -> LLM:
    """`ENGINE`: 4 running sequences of up to 310 tokens need up to 80 blocks of 16; 45 force preemption."""
    return LLM(model, **ENGINE, **kw)


def test_forced_swapping_equals_no_pressure(tiny, alone):
    """Every preemption swaps; each request's tokens equal its run alone (tests/conftest.py `alone`, which
    test_engine.py checks against HF), the swap counters and bytes add up and reach /metrics."""
    _, model = tiny
    prompts = prompts_1_to_300()
    params = SamplingParams(max_tokens=10, **GREEDY)
    llm = pressured(model, host_kv_memory_gb=0.01, preemption_mode="swap")
    swapped = llm.generate(prompts, params)
    st = llm.engine.stats()
    assert st["num_swap_preemptions"] > 0 and st["num_recompute_preemptions"] == 0, st
    assert st["num_swap_out"] == st["num_swap_in"] == st["num_swap_preemptions"], st
    assert st["swap_out_bytes"] == st["swap_in_bytes"] > 0
    assert_all_free(llm)
    assert_host_free(llm)
    from jhybrid.server.metrics import EngineMetrics

    metrics = EngineMetrics("m")
    metrics.observe_engine(llm.engine)
    text = metrics.exposition().decode()
    assert f'jhybrid:swap_bytes_total{{direction="out",model_name="m"}} {float(st["swap_out_bytes"])}' in text, text
    assert f'jhybrid:preemptions_by_mode_total{{mode="swap",model_name="m"}} {float(st["num_swap_preemptions"])}' in text
    assert 'jhybrid:host_tier_bytes_total{model_name="m"}' in text
    for i, (p, out, want) in enumerate(zip(prompts, swapped, alone)):
        assert out.token_ids == want, f"prompt {i} ({len(p)} tokens, {out.num_preemptions} swaps) differs"
        assert out.finish_reason == "length"


@pytest.mark.slow
def test_swapping_through_pinned_host_memory_equals_no_pressure(tiny, alone):
    """swap_transfer="pinned" (swap outs via a device_put into JAX's pinned_host memory) under the same
    pressure: the same swaps and bytes, and the tokens of a run with no memory pressure."""
    _, model = tiny
    prompts = prompts_1_to_300()
    params = SamplingParams(max_tokens=10, **GREEDY)
    llm = pressured(model, host_kv_memory_gb=0.01, preemption_mode="swap", swap_transfer="pinned")
    assert llm.engine.swapper.transfer == "pinned"
    pinned = llm.generate(prompts, params)
    st = llm.engine.stats()
    assert st["num_swap_preemptions"] > 0 and st["num_swap_out"] == st["num_swap_in"], st
    assert st["swap_out_bytes"] == st["swap_in_bytes"] > 0
    assert_all_free(llm)
    assert_host_free(llm)
    assert llm.engine.swapper.num_resident == 0, "pinned data outlived its entries"
    assert [o.token_ids for o in pinned] == alone


@pytest.mark.slow
def test_auto_mode_follows_the_cost_model(tiny):
    _, model = tiny
    prompts = prompts_1_to_300(8)
    params = SamplingParams(max_tokens=6, **GREEDY)
    cheap_swap = pressured(model, host_kv_memory_gb=0.01, swap_bandwidth_gbps=1e6, prefill_tokens_per_s=1.0)
    dear_swap = pressured(model, host_kv_memory_gb=0.01, swap_bandwidth_gbps=1e-9, prefill_tokens_per_s=1e9)
    outs = [llm.generate(prompts, params) for llm in (cheap_swap, dear_swap)]
    a, b = cheap_swap.engine.stats(), dear_swap.engine.stats()
    assert a["num_swap_preemptions"] > 0 and a["num_recompute_preemptions"] == 0, a
    assert b["num_swap_preemptions"] == 0 and b["num_recompute_preemptions"] > 0, b
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    for llm in (cheap_swap, dear_swap):
        assert_all_free(llm)
        assert_host_free(llm)


def run_all(llm: LLM, prompts, params, abort_swapped: bool = False):
    eng = llm.engine
    seqs = [eng.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    aborted = None
    while eng.has_unfinished():
        eng.step()
        if abort_swapped and aborted is None and eng.scheduler.swapped:  # abort one while it sits on the host
            seq_id = next(iter(eng.scheduler.swapped))
            aborted = next(s for s in seqs if s.seq_id == seq_id)
            eng.abort(aborted.request_id)
            assert seq_id not in eng.scheduler.swapped
    assert_all_free(llm)
    assert_host_free(llm)
    return seqs, aborted


def test_abort_while_swapped_frees_the_host_tier(tiny):
    llm = pressured(tiny[1], host_kv_memory_gb=1e-4, preemption_mode="swap")
    seqs, aborted = run_all(llm, prompts_1_to_300(), SamplingParams(max_tokens=30, **GREEDY), abort_swapped=True)
    assert aborted is not None and aborted.finish_reason == "abort"
    assert all(s.finish_reason == "length" for s in seqs if s is not aborted)


@pytest.mark.slow
def test_full_host_tier_falls_back_to_recompute(tiny):
    llm = pressured(tiny[1], host_kv_memory_gb=5e-5, preemption_mode="swap")  # 7 blocks: long ones recompute
    seqs, _ = run_all(llm, prompts_1_to_300(), SamplingParams(max_tokens=30, **GREEDY))
    st = llm.engine.stats()
    assert st["num_swap_fallbacks"] > 0 and st["num_recompute_preemptions"] > 0, f"{st}"
    assert all(s.finish_reason == "length" and len(s.token_ids) == min(len(s.prompt_ids) + 30, 320) for s in seqs)


class FakeClock:
    """`time.perf_counter` that advances by the given steps, one per call."""

    def __init__(self, steps):
        self.steps, self.now = iter(steps), 0.0

    def perf_counter(self) -> float:
        self.now += next(self.steps)
        return self.now


def test_measured_cost_model(tiny, alone, monkeypatch):
    """The engine's start-up probes turn their timings into the cost model's rates: bytes (tokens) over the
    median time of the repeats after a warm-up. A fake clock gives each timed interval a chosen length: a
    warm-up of 100 s, then host->device copies of 1, 2 and 4 s (median 2), device->host copies of 8, 16 and
    32 s (median 16), prefills of 0.5 and 0.25 s (median 0.375); a warm-up counted or a direction swapped
    changes a rate."""
    from jhybrid.engine import swap

    _, model = tiny
    nbytes = inspect.signature(swap.measure_transfer_bandwidth).parameters["nbytes"].default
    copies = [1.0, 100.0, 100.0] + [x for h2d, d2h in [(1, 8), (2, 16), (4, 32)] for x in (1.0, h2d, d2h)]
    prefills = [1.0, 100.0] + [1.0, 0.5] + [1.0, 0.25]
    with monkeypatch.context() as m:
        m.setattr(swap, "time", FakeClock(copies + prefills))
        llm = LLM(model, **ENGINE, host_kv_memory_gb=0.01)
    cost = llm.engine.cost_model
    assert (cost.h2d_bytes_per_s, cost.d2h_bytes_per_s) == (nbytes / 2, nbytes / 16)
    assert cost.prefill_tokens_per_s == 128 / 0.375  # a row of min(max_num_batched_tokens, max_model_len - 1)
    # the probe wrote only into the null slot / page: a generation afterwards equals the run alone
    (out,) = llm.generate([prompts_1_to_300()[2]], SamplingParams(max_tokens=10, **GREEDY))
    assert out.token_ids == alone[2]


def test_transfer_probe_through_pinned_memory_returns_the_data(monkeypatch):
    from jhybrid.engine import swap

    with monkeypatch.context() as m:  # pinned: device->host (into pinned memory) is timed first, then back
        m.setattr(swap, "time", FakeClock([1.0, 100.0, 100.0, 1.0, 4.0, 2.0]))
        h2d, d2h = swap.measure_transfer_bandwidth(1 << 20, repeats=1, transfer="pinned")
    assert (h2d, d2h) == ((1 << 20) / 2, (1 << 20) / 4)
    x = jnp.arange(1000, dtype=jnp.bfloat16)
    (pinned,) = jax.tree.leaves(swap._to_pinned((x,)))
    assert pinned.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(pinned), np.asarray(x))
    (back,) = jax.tree.leaves(swap._to_device((pinned,)))
    assert back.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


def test_pinned_data_of_an_aborted_entry_is_dropped(tiny):
    """An entry released while swapped out (its request was aborted) leaves no pinned data behind."""
    cfg = tiny[1].cfg
    cache = CacheConfig(num_blocks=12, block_size=4, num_slots=5, kv_dtype="bfloat16")
    host = host_for(cfg, cache)
    swapper = Swapper(host, "pinned")
    entries = [host.reserve(8), host.reserve(4)]
    swapper.swap_out(random_state(cfg, cache, seed=4), [SwapOp("a", [3, 4], 1, entries[0]), SwapOp("b", [5], 2, entries[1])])
    assert swapper.num_resident == 2
    host.release(entries[0].slot)  # what the scheduler does for an aborted swapped-out sequence
    assert swapper.num_resident == 1
    swapper.flush()
    assert swapper.num_resident == 1 and entries[1].slot in swapper._resident


def test_plan_host_tier_sizes(tiny):
    cfg = tiny[1].cfg
    cache = CacheConfig(num_blocks=12, block_size=16, num_slots=5, kv_dtype="bfloat16")
    plan = plan_host_tier(cfg, cache, host_kv_memory_gb=0.05, max_num_seqs=4)
    host = HostTier(cfg, plan)
    assert plan.num_slots == 5 and host.bytes_total <= 0.05 * 2**30
    assert host.bytes_total + host.block_bytes > 0.05 * 2**30 - host.slot_bytes  # no whole block left unused
    with pytest.raises(ValueError, match="needs >= 2 blocks and slots"):  # the config validates itself
        dataclasses.replace(plan, num_blocks=1)
    with pytest.raises(ValueError, match="host_kv_memory_gb"):
        plan_host_tier(cfg, cache, host_kv_memory_gb=0, max_num_seqs=4)


# ---------------------------------------------------------------- partial attentions merged by LSE
@pytest.mark.parametrize("num_heads,num_kv_heads,soft_cap", [(6, 2, None), pytest.param(4, 4, None, marks=pytest.mark.slow),
                                                             pytest.param(8, 1, 30.0, marks=pytest.mark.slow)])
def test_lse_merge_of_host_and_device_parts_equals_whole(num_heads, num_kv_heads, soft_cap):
    """Each row's context is split at a random point (0 and the full length included: empty parts on either
    side); keys before it are attended on the CPU over host blocks, the rest by the device reference (a
    sliding window starting at the split); the LSE merge equals attention over the whole context."""
    from jhybrid.cache.host_attention import host_paged_attention
    from pallas_kernels.paged_attention import merge_attention, paged_attention_reference

    rng = np.random.default_rng(num_heads * 7 + num_kv_heads)
    block_size, head_dim, num_pages, max_blocks = 4, 16, 48, 9
    lengths = np.array([1, 2, 5, 17, 23, 36, 36, 11, 8, 30])  # context (query included) of each row
    # host keys [0, split), device keys [split, length): empty host parts (0), empty device parts (split ==
    # length), both non-empty, block boundaries and not, and random points
    splits = np.array([0, 2, 3, 0, 9, 36, 20, 0, 0, 0])
    splits[7:] = rng.integers(0, lengths[7:] + 1)
    num_rows = len(lengths)
    k_pages = rng.normal(size=(num_pages, block_size, num_kv_heads, head_dim)).astype(np.float32)
    v_pages = rng.normal(size=(num_pages, block_size, num_kv_heads, head_dim)).astype(np.float32)
    tables = np.zeros((num_rows, max_blocks), np.int32)
    perm = rng.permutation(np.arange(1, num_pages))
    used = set()
    for b, n in enumerate(lengths):
        nb = -(-n // block_size)
        tables[b, :nb] = perm[sum(-(-x // block_size) for x in lengths[:b]) :][:nb]
        used.update(tables[b, :nb].tolist())
    poison = [p for p in range(num_pages) if p not in used]
    k_pages[poison] = np.nan  # pages nobody owns must never be read
    v_pages[poison] = np.nan
    q = rng.normal(size=(num_rows, num_heads, head_dim)).astype(np.float32)
    positions = lengths - 1
    row_ids = np.arange(num_rows)
    args = (jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(tables), jnp.asarray(row_ids))
    o_all, lse_all = paged_attention_reference(*args, jnp.asarray(positions), soft_cap=soft_cap, return_lse=True)
    # the device part: keys [split, position]; an empty one is poisoned with NaN (its lse is -inf)
    o_dev = np.full_like(q, np.nan)
    lse_dev = np.full((num_rows, num_heads), -np.inf, np.float32)
    for b in range(num_rows):
        if splits[b] < lengths[b]:
            window = int(positions[b] - splits[b] + 1)
            o_b, lse_b = paged_attention_reference(*args, jnp.asarray(positions), soft_cap=soft_cap, return_lse=True,
                                                   sliding_window=window)
            o_dev[b], lse_dev[b] = np.asarray(o_b)[b], np.asarray(lse_b)[b]
    # the host part, on the CPU: the row's first blocks as the host tier would hold them
    host_k, host_v = k_pages.copy(), v_pages.copy()
    o_host, lse_host = host_paged_attention(q, host_k, host_v, tables, splits, soft_cap=soft_cap)
    assert np.all(np.isneginf(lse_host[splits == 0])) and np.all(o_host[splits == 0] == 0)
    for first in ("host", "device"):  # the merge is symmetric
        parts = [(o_host, lse_host), (o_dev, lse_dev)]
        if first == "device":
            parts.reverse()
        o, lse = merge_attention(jnp.asarray(parts[0][0]), jnp.asarray(parts[0][1]), jnp.asarray(parts[1][0]),
                                 jnp.asarray(parts[1][1]))
        err = np.abs(np.asarray(o) - np.asarray(o_all)).max()
        assert np.isfinite(np.asarray(o)).all(), f"{first}: NaN leaked from an empty part or a poisoned page"
        assert err < 2e-5, f"{first}: merged output max abs err {err:.2e}"
        np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_all), rtol=1e-5, atol=1e-5, err_msg=first)


def test_lse_merge_of_two_empty_parts():
    from pallas_kernels.paged_attention import merge_attention

    nan = jnp.full((2, 3, 4), jnp.nan)
    ninf = jnp.full((2, 3), -jnp.inf)
    o, lse = merge_attention(nan, ninf, nan, ninf)
    assert np.all(np.asarray(o) == 0) and np.all(np.isneginf(np.asarray(lse)))
    with pytest.raises(ValueError, match="equal shapes"):
        merge_attention(nan, ninf, nan[:1], ninf[:1])
