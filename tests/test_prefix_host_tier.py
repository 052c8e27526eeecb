"""The prefix cache's host tier (`PrefixCache.attach_host`, `jhybrid.engine.prefix_tier`): cached blocks and
snapshots evicted from the device move to the host tier instead of being dropped, and a later hit brings them
back, exactly.

How the tests were checked to fail (each change made by hand, the file run, the change undone; never committed):
  * `PrefixTierMover.promote` without bringing the blocks back (`_bring("b", ...)`: promoted device blocks keep
    stale KV), or without bringing the snapshots back (`_bring("s", ...)`: a slot restored from a host snapshot
    keeps stale state): the engine cases fail by
    other tokens or log-probabilities (and so does `test_prefix_cache`'s fixed interleaving in "swap" mode, whose
    host tier now also holds the cache's evictions);
  * `PrefixCache._evict_block` demoting a block registered in the same step (`block not in self._fresh_blocks`
    dropped): `test_a_block_registered_this_step_is_dropped_not_demoted` fails;
  * `PrefixCache.lookup` offering a node demoted in the same step (the `_moved_now` check dropped):
    `test_a_block_demoted_this_step_is_not_offered_until_the_next` fails;
  * `PrefixTierMover._keep` not recording where a host block's data is when the block is demoted into again
    (the first demotion's location kept): `test_a_promotion_reads_the_data_its_node_was_demoted_with` fails, as it
    does with `sweep` keeping every piece;
  * `PrefixCache._take_snapshot_slot` demoting every evicted snapshot (not only those known to be shared):
    `test_a_snapshot_not_known_to_be_shared_is_dropped_not_demoted` fails;
  * `HostAllocator.can_hold` without calling `reclaim`: `test_swapping_reclaims_the_cache_s_host_blocks` fails;
  * `LLMEngine.step` dispatching offloads (`kv_offload`) before the promotions (an offload then gathers a block
    just promoted before its data is written): `test_prefix_cache`'s fixed interleaving in "offload" mode fails
    by other log-probabilities.
"""

from __future__ import annotations

import numpy as np
import pytest

from jhybrid import LLM
from jhybrid.cache.host_tier import HostAllocator, SwapCostModel
from jhybrid.cache.prefix_cache import PrefixCache, PrefixCursor
from tests.conftest import FAMILY_ENGINE
from tests.test_prefix_cache import FAMILIES, assert_exact, params, tokens

# ----------------------------------------------------------------------------------------- host bookkeeping

BS = 4


def _tiered(num_blocks=5, snapshots=range(4, 5), host_blocks=9, host_slots=4, cost=None):
    """A cache of `num_blocks - 1` device blocks of 4 tokens and the given snapshot slots, over a host tier."""
    pc = PrefixCache(num_blocks, BS, snapshots)
    host = HostAllocator(host_blocks, host_slots, BS, block_bytes=100, slot_bytes=1000)
    pc.attach_host(host, cost, snapshot_bytes=1000)
    return pc, host


def _computed(pc: PrefixCache, tokens_: list[int], shared: bool = True) -> list[int]:
    """A sequence computes `tokens_` in one step (blocks registered, a snapshot at its end, known to be shared
    unless `shared=False`) and finishes; the next step begins. Returns its blocks (now cached and unreferenced)."""
    cursor = PrefixCursor()
    table = pc.blocks.allocate(-(-len(tokens_) // BS))
    pc.register(cursor, tokens_, table, len(tokens_))
    pc.snapshot(cursor, len(tokens_) // BS, rolling=False, keep=shared)
    pc.release(cursor, tokens_, table, len(tokens_))
    pc.blocks.free(table)
    pc.begin_step()
    return table


def _nodes(pc: PrefixCache, tokens_: list[int]):
    hit, _ = pc.lookup(tokens_ + [999])
    return hit.node.path() if hit else []


def test_evicted_blocks_move_to_the_host_and_a_hit_brings_them_back():
    pc, host = _tiered()
    a = list(range(8))
    table = _computed(pc, a)
    assert pc.take_ops().demote_blocks == []
    others = pc.blocks.allocate(4)  # the whole pool: both cached blocks are evicted, deepest first
    ops = pc.take_ops()
    assert [op[0] for op in ops.demote_blocks] == table[::-1]
    assert [op[2].depth for op in ops.demote_blocks] == [2, 1]
    assert pc.num_host_blocks == 2 and pc.num_cached_blocks == 0 and host.blocks.num_used == 2
    pc.check({b: 1 for b in others})
    pc.blocks.free(others)
    pc.begin_step()
    hit, matched = pc.lookup(a + [99])
    assert (hit.num_tokens, matched, hit.blocks, hit.snapshot) == (8, 8, (None, None), 4)
    host_of = [n.host_block for n in hit.node.path()]
    hit, blocks = pc.acquire(hit)
    ops = pc.take_ops()
    assert ops.promote_blocks == list(zip(host_of, blocks, strict=True)), "host blocks come back in path order"
    assert [n.block for n in hit.node.path()] == blocks and pc.num_host_blocks == 0
    pc.check({b: 1 for b in blocks})
    assert host.blocks.num_used == 2, "a promoted host block is read during this step: freed at the next"
    pc.begin_step()
    assert host.blocks.num_used == 0
    pc.check({b: 1 for b in blocks})


def test_an_evicted_snapshot_moves_to_a_host_slot_and_is_restored_from_there():
    pc, host = _tiered(num_blocks=9)
    a, b = list(range(8)), list(range(100, 108))
    _computed(pc, a)
    _computed(pc, b)  # one snapshot slot: a's snapshot is evicted for b's, and demoted
    ops = pc.take_ops()
    assert len(ops.demote_snapshots) == 1 and ops.demote_snapshots[0][0] == 4
    node = ops.demote_snapshots[0][2]
    assert node.snapshot is None and node.host_snapshot is not None and pc.num_host_snapshots == 1
    pc.begin_step()
    hit, _ = pc.lookup(a + [1])
    assert (hit.num_tokens, hit.snapshot, hit.host_snapshot) == (8, None, node.host_snapshot)
    hit, blocks = pc.acquire(hit)
    pc.count(9, hit)
    assert pc.num_host_restores == 1 and pc.num_restores == 1
    pc.check({b_: 1 for b_ in blocks})


def test_a_snapshot_not_known_to_be_shared_is_dropped_not_demoted():
    """A prompt's own end or chunk end, never restored: not worth the bytes of a host copy."""
    pc, host = _tiered(num_blocks=9)
    _computed(pc, list(range(8)), shared=False)
    _computed(pc, list(range(100, 108)))
    assert pc.take_ops().demote_snapshots == [] and pc.num_host_snapshots == 0 and host.slots.num_used == 0


def test_a_block_registered_this_step_is_dropped_not_demoted():
    """Its data is written by the step being scheduled: a gather before that step would read stale KV."""
    pc, host = _tiered()
    a = list(range(8))
    cursor = PrefixCursor()
    table = pc.blocks.allocate(2)
    pc.register(cursor, a, table, 8)
    pc.release(cursor, a, table, 8)
    pc.blocks.free(table)  # (a sequence aborted in the step that computes these blocks)
    pc.blocks.allocate(4)  # no begin_step: the same step
    assert pc.take_ops().demote_blocks == [] and pc.num_host_blocks == 0 and pc.num_cached_blocks == 0
    assert pc.lookup(a + [1]) == (None, 0)


def test_a_block_demoted_this_step_is_not_offered_until_the_next():
    """Its data reaches the host after the step (`flush`): a promotion in the same step would read nothing."""
    pc, host = _tiered()
    a = list(range(8))
    _computed(pc, a)
    others = pc.blocks.allocate(4)
    assert len(pc.take_ops().demote_blocks) == 2
    pc.blocks.free(others)
    assert pc.lookup(a + [1])[0] is None
    pc.begin_step()
    assert pc.lookup(a + [1])[0].num_tokens == 8


def test_host_data_is_loaded_only_where_the_cost_model_prices_it_below_recomputing():
    slow = SwapCostModel(h2d_bytes_per_s=1.0, d2h_bytes_per_s=1.0, prefill_tokens_per_s=1e9)
    fast = SwapCostModel(h2d_bytes_per_s=1e12, d2h_bytes_per_s=1e12, prefill_tokens_per_s=1.0)
    for cost, want in ((slow, None), (fast, 8)):
        pc, _ = _tiered(cost=cost)
        a = list(range(8))
        _computed(pc, a)
        pc.blocks.free(pc.blocks.allocate(4))
        pc.begin_step()
        hit, matched = pc.lookup(a + [1])
        assert matched == 8 and (hit.num_tokens if hit else None) == want


def test_a_full_host_tier_gives_up_its_least_recently_demoted_block_with_its_descendants():
    pc, host = _tiered(num_blocks=5, host_blocks=3)  # two host blocks
    a, b = list(range(8)), list(range(50, 58))
    _computed(pc, a)
    pc.blocks.free(pc.blocks.allocate(4))  # a's two blocks go to the host
    pc.take_ops()
    pc.begin_step()
    _computed(pc, b)  # takes two device blocks
    pc.blocks.free(pc.blocks.allocate(4))  # b's blocks are evicted; the host drops a's (LRU) for them
    ops = pc.take_ops()
    assert len(ops.demote_blocks) == 2 and pc.num_host_blocks == 2
    pc.begin_step()
    assert pc.lookup(a + [1]) == (None, 0), "a's chain left the trie"
    assert pc.lookup(b + [1])[0].num_tokens == 8
    pc.check({})


def test_swapping_reclaims_the_cache_s_host_blocks():
    pc, host = _tiered(host_blocks=3)
    _computed(pc, list(range(8)))
    pc.blocks.free(pc.blocks.allocate(4))
    assert host.blocks.num_free == 0
    assert host.can_hold(8), "a swap entry of two blocks fits once the cache gives its host blocks back"
    assert pc.num_host_blocks == 0
    pc.check({})


def test_a_promotion_reads_the_data_its_node_was_demoted_with():
    """The mover keeps each demotion's rows in pinned host memory and finds a host block's data by the demotion
    that last wrote it: after a node is dropped and its host block takes another demotion, a promotion from that
    block brings the new data, and one from the other block the old; pieces no node needs are swept."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from jhybrid.cache.state import HybridState
    from jhybrid.engine.prefix_tier import PrefixTierMover

    class Host:  # a host tier of one full layer and no linear layer (the mover reads only these)
        k, conv = (np.zeros(1),), ()
        block_bytes, slot_bytes = 64, 0

    def pages(values):
        return jnp.asarray(np.asarray(values, np.float32)[:, None, None, None] * np.ones((1, BS, 1, 2), np.float32))

    pc, host = _tiered(host_blocks=3)  # two host blocks: a freed one is the next taken
    mover = PrefixTierMover(Host)
    a, b = list(range(8)), list(range(50, 54))
    _computed(pc, a)
    state = HybridState(k_pages=(pages([0, 1, 2, 3, 4]),), v_pages=(pages([0, -1, -2, -3, -4]),), conv=(), ssm=())
    pc.blocks.free(pc.blocks.allocate(4))
    ops = pc.take_ops()  # a's two blocks (device 1 and 2, deepest first) go to the host
    mover.demote(state, ops)
    (_, hb_child, child), (_, hb_parent, parent) = ops.demote_blocks
    pc.begin_step()
    pc._kill(child)  # (the cache drops the deeper block; its host block is free again)
    _computed(pc, b)
    state = HybridState(k_pages=(pages([0, 9, 9, 9, 9]),), v_pages=(pages([0, -9, -9, -9, -9]),), conv=(), ssm=())
    pc.blocks.free(pc.blocks.allocate(4))  # b's block takes the freed host block
    ops = pc.take_ops()
    mover.demote(state, ops)
    ((_, hb_b, node_b),) = ops.demote_blocks
    assert hb_b == hb_child
    pc.begin_step()
    mover.sweep()
    assert mover.num_pieces == 2, "each piece still holds a live row"
    state = HybridState(k_pages=(pages([0, 7, 7, 7, 7]),), v_pages=(pages([0, 7, 7, 7, 7]),), conv=(), ssm=())
    from jhybrid.cache.prefix_cache import TierOps

    state = mover.promote(state, TierOps(promote_blocks=[(hb_parent, 3), (hb_b, 4)]))
    k, v = np.asarray(state.k_pages[0])[:, 0, 0, 0], np.asarray(state.v_pages[0])[:, 0, 0, 0]
    assert k[1:].tolist() == [7, 7, 1, 9] and v[1:].tolist() == [7, 7, -1, -9], (k, v)  # (page 0: padding)
    pc._kill(parent)
    pc._kill(node_b)
    mover.sweep()
    assert mover.num_pieces == 0, "pieces whose rows no node needs are dropped"


# ----------------------------------------------------------------------------------------- engines

# 10 usable device blocks and one snapshot slot, so that two 88-token fillers evict the first prompt's blocks and
# snapshot; a host tier (recompute preemption: no cost model, host data is always loaded)
TIERED = FAMILY_ENGINE | dict(enable_prefix_caching=True, prefix_snapshot_slots=1, host_kv_memory_gb=0.01,
                              preemption_mode="recompute")


@pytest.fixture(scope="module", params=[f if f == "gated_deltanet" else pytest.param(f, marks=pytest.mark.slow)
                                        for f in FAMILIES])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tier_{request.param}")
    FAMILIES[request.param](path)
    return request.param, LLM(path, **FAMILY_ENGINE).model


def test_a_prefix_evicted_to_the_host_is_a_hit_equal_to_no_cache(model):
    """Two prompts share a prefix (the second restores the first's snapshot: known to be shared); their blocks and
    that snapshot are pushed off the device by two long prompts; a third prompt with the prefix resumes from the
    host copies (blocks promoted, the state restored from a host slot) and generates exactly what it generates
    without the cache."""
    name, loaded = model
    shared = tokens(1, 40)
    first, third = shared + tokens(3, 5), shared + tokens(4, 7)
    want = LLM(loaded, **FAMILY_ENGINE).generate([third], params())[0]
    llm = LLM(loaded, **TIERED)
    llm.generate([first], params(2))  # (its decode stays short of the next block boundary: no decode snapshot)
    assert llm.generate([shared + tokens(5, 3)], params(2))[0].num_cached_tokens == 32
    for seed in (20, 21):
        llm.generate([tokens(seed, 88)], params(2))
    stats = llm.engine.stats()
    assert stats["prefix_blocks_demoted"] >= 2 and stats["prefix_snapshots_demoted"] >= 1, stats
    (out,) = llm.generate([third], params())
    stats = llm.engine.stats()
    assert out.num_cached_tokens == 32, f"{name}: reused {out.num_cached_tokens} tokens, not 32"
    assert stats["prefix_blocks_promoted"] >= 2 and stats["prefix_host_restores"] == 1, stats
    assert_exact(f"{name} from the host tier", out, want)
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
