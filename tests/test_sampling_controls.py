"""vLLM's sampling controls, computed on the device inside the one sampling program: presence / frequency /
repetition penalties, min_p, min_tokens, allowed_token_ids, bad words (the ban table), each against an
independent reference: a NumPy re-implementation of the processed distribution on the same logits, and greedy
decoding of the HF model with transformers' own repetition-penalty processor and NumPy presence / frequency
penalties. The engine tests run `ENGINE`'s shapes (tests/conftest.py) on the tiny Qwen3.5, so they share the
compiled step programs of test_programs.py / test_engine.py.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jhybrid import LLM, SamplingParams
from jhybrid.engine.sampling import (
    FLAG_ALLOWED,
    FLAG_BANS,
    FLAG_BIAS,
    FLAG_PENALTIES,
    INT32_MAX,
    MAX_BAN_TOKENS,
    MAX_LOGIT_BIAS,
    SamplingArrays,
    SlotTables,
    TokenHistory,
    _filter_top_k_top_p,
    _thresholds_from_candidates,
    sample,
    top_k_exact,
)
from tests.conftest import ENGINE, GREEDY


# ------------------------------------------------------------------------------------------ the sampler alone
def _reference_logits(logits, bias, allowed, bans, recent, num_output, counts, prompt_mask, presence, frequency,
                      repetition):
    """vLLM's processed logits of one row, in NumPy: bias, allowed tokens, bans, then penalties."""
    x = logits.astype(np.float64).copy()
    for t, b in bias.items():
        x[t] += b
    if allowed is not None:
        keep = np.zeros(len(x), bool)
        keep[list(allowed)] = True
        x[~keep] = -np.inf
    for word, until in bans:
        prefix = list(word[:-1])
        tail = [t for t in recent if t >= 0]
        if num_output < until and (not prefix or tail[len(tail) - len(prefix):] == prefix):
            x[word[-1]] = -np.inf
    seen = prompt_mask | (counts > 0)
    x = np.where(seen & (x > 0), x / repetition, np.where(seen, x * repetition, x))
    return x - frequency * counts - presence * (counts > 0)


def _case(vocab=64, seed=0):
    """Rows of different settings over random logits, with their tables and the NumPy expectation of each."""
    rng = np.random.default_rng(seed)
    num_slots = 7
    bias_ids = np.zeros((num_slots, MAX_LOGIT_BIAS), np.int32)
    bias_values = np.zeros((num_slots, MAX_LOGIT_BIAS), np.float32)
    bans = np.full((num_slots, 128, MAX_BAN_TOKENS + 1), -1, np.int32)
    allowed = np.ones((num_slots, vocab), bool)
    counts = (rng.integers(0, 4, (num_slots, vocab)) * (rng.random((num_slots, vocab)) < 0.3)).astype(np.int32)
    prompt_mask = rng.random((num_slots, vocab)) < 0.3
    logits = (rng.standard_normal((6, vocab)) * 2.5).astype(np.float32)
    top = np.argsort(-logits, axis=-1)  # each row's tokens, most likely first
    rows = []  # (slot, flags, bias, allowed, bans [(word, until)], recent, num_output, presence, frequency, repetition)
    rows.append((1, FLAG_PENALTIES, {}, None, [], [], 0, 0.7, 0.4, 1.6))
    rows.append((2, FLAG_ALLOWED | FLAG_BIAS, {int(top[1, 5]): 0.3}, sorted({int(t) for t in top[1, 3:9]}), [], [], 0, 0.0, 0.0, 1.0))
    r = 2  # bans: a single token; a two-token word whose prefix ends the output; one whose prefix does not;
    # a stop id until 4 (output 2: banned) and one until 2 (not banned)
    recent = [-2] * (MAX_BAN_TOKENS - 3) + [int(top[r, 9]), int(top[r, 8])]
    rows.append((3, FLAG_BANS, {}, None, [([int(top[r, 0])], INT32_MAX), ([int(top[r, 8]), int(top[r, 1])], INT32_MAX),
                                          ([int(top[r, 7]), int(top[r, 2])], INT32_MAX), ([int(top[r, 3])], 4),
                                          ([int(top[r, 4])], 2)], recent, 2, 0.0, 0.0, 1.0))
    r = 3  # everything at once
    rows.append((4, FLAG_PENALTIES | FLAG_ALLOWED | FLAG_BANS | FLAG_BIAS, {int(top[r, 2]): 1.5, int(top[r, 0]): -0.5},
                 sorted({int(t) for t in top[r, :12]}), [([int(top[r, 1])], INT32_MAX)], [-2] * (MAX_BAN_TOKENS - 1),
                 5, -0.5, 0.9, 0.7))
    rows.append((5, 0, {}, None, [], [], 0, 0.0, 0.0, 1.0))  # garbage in its slot's tables: flags 0 ignore it
    rows.append((6, FLAG_PENALTIES, {}, None, [], [], 0, 1.9, -1.3, 3.0))
    allowed[5] = False
    bans[5, 0, MAX_BAN_TOKENS - 1 :] = (int(top[4, 0]), INT32_MAX)
    meta = dict(slot_ids=[], flags=[], presence_penalty=[], frequency_penalty=[], repetition_penalty=[],
                num_output=[], recent=[])
    expected = []
    for i, (slot, flags, bias, allow, row_bans, rec, num_out, pres, freq, rep) in enumerate(rows):
        bias_ids[slot, : len(bias)], bias_values[slot, : len(bias)] = list(bias), list(bias.values())
        if allow is not None:
            allowed[slot] = False
            allowed[slot, allow] = True
        for k, (word, until) in enumerate(row_bans):
            bans[slot, k, MAX_BAN_TOKENS - len(word) : MAX_BAN_TOKENS] = word
            bans[slot, k, MAX_BAN_TOKENS] = until
        rec = rec or [-2] * (MAX_BAN_TOKENS - 1)
        for name, value in zip(meta, (slot, flags, pres, freq, rep, num_out, rec)):
            meta[name].append(value)
        penalised = flags & FLAG_PENALTIES
        expected.append(_reference_logits(logits[i], bias, allow, row_bans, rec, num_out,
                                          counts[slot] if penalised else np.zeros(vocab), prompt_mask[slot] & bool(penalised),
                                          pres, freq, rep))
    tables = SlotTables(bias_ids=jnp.asarray(bias_ids), bias_values=jnp.asarray(bias_values), bans=jnp.asarray(bans),
                        allowed=jnp.asarray(allowed))
    history = TokenHistory(output_counts=jnp.asarray(counts), prompt_mask=jnp.asarray(prompt_mask))
    return logits, meta, tables, history, np.stack(expected)


def _arrays(meta, repeat: int, temperature: float, min_p: float, seed0: int = 0) -> SamplingArrays:
    n = len(meta["slot_ids"]) * repeat
    rep = {k: np.repeat(np.asarray(v), repeat, axis=0) for k, v in meta.items()}
    return SamplingArrays(
        temperature=jnp.full(n, temperature, jnp.float32), top_k=jnp.zeros(n, jnp.int32), top_p=jnp.ones(n, jnp.float32),
        seeds=jnp.arange(seed0, seed0 + n, dtype=jnp.int32), counters=jnp.zeros(n, jnp.int32),
        want_logprobs=jnp.zeros(n, jnp.int32), slot_ids=jnp.asarray(rep["slot_ids"], jnp.int32),
        flags=jnp.asarray(rep["flags"], jnp.int32), min_p=jnp.full(n, min_p, jnp.float32),
        presence_penalty=jnp.asarray(rep["presence_penalty"], jnp.float32),
        frequency_penalty=jnp.asarray(rep["frequency_penalty"], jnp.float32),
        repetition_penalty=jnp.asarray(rep["repetition_penalty"], jnp.float32),
        num_output=jnp.asarray(rep["num_output"], jnp.int32), recent=jnp.asarray(rep["recent"], jnp.int32))


def test_filter_thresholds_from_candidates_change_no_sampled_token(monkeypatch):
    """The GPU's top-k / top-p filter (thresholds read off each row's largest logits where they lie there:
    `sampling.FILTER_CANDIDATES`, off on the CPU unless `FILTER_CANDIDATES_ON_CPU`) gives `sample` the tokens of the
    radix passes, seeded draws at temperature 2 over 128 tokens with 32 candidates: in a batch whose rows it all
    resolves (top-k 5; top-k 20 and top-p 0.9) and in one with a row it cannot (top-k 40, past the candidates), so
    both branches of its `lax.cond` run, beside greedy rows. (It replaces an engine-level run of the same claim:
    `sample` reads the switch when traced, so a fresh trace of it is the engine's path.)
    Checked to fail with the resolved branch keeping `>` its threshold instead of `>=` (top-k keeps k - 1)."""
    from jhybrid.engine import sampling

    rng = np.random.default_rng(4)
    vocab, draws = 128, 24
    kinds = [(5, 1.0), (20, 0.9), (40, 1.0), (0, 1.0)]  # (top-k, top-p); top-k 0 with temperature 0: greedy
    logits = rng.standard_normal((len(kinds), vocab)).astype(np.float32) * 2

    def batch(rows: list[int]):
        n = len(rows) * draws
        k = np.repeat([kinds[r][0] for r in rows], draws)
        args = SamplingArrays(
            temperature=jnp.asarray(np.where(k > 0, 2.0, 0.0), jnp.float32), top_k=jnp.asarray(k, jnp.int32),
            top_p=jnp.asarray(np.repeat([kinds[r][1] for r in rows], draws), jnp.float32),
            seeds=jnp.arange(n, dtype=jnp.int32) % draws + 7, counters=jnp.arange(n, dtype=jnp.int32) // draws,
            want_logprobs=jnp.zeros(n, jnp.int32), slot_ids=jnp.zeros(n, jnp.int32), flags=jnp.zeros(n, jnp.int32),
            min_p=jnp.zeros(n), presence_penalty=jnp.zeros(n), frequency_penalty=jnp.zeros(n),
            repetition_penalty=jnp.ones(n), num_output=jnp.zeros(n, jnp.int32),
            recent=jnp.full((n, MAX_BAN_TOKENS - 1), -2, jnp.int32))
        tables = SlotTables(bias_ids=jnp.zeros((1, MAX_LOGIT_BIAS), jnp.int32), bias_values=jnp.zeros((1, MAX_LOGIT_BIAS)),
                            bans=jnp.full((1, 4, MAX_BAN_TOKENS + 1), -1, jnp.int32), allowed=jnp.ones((1, vocab), bool))
        history = TokenHistory(output_counts=jnp.zeros((1, vocab), jnp.int32), prompt_mask=jnp.zeros((1, vocab), bool))
        x = jnp.asarray(np.repeat(logits[rows], draws, axis=0))
        # a new function each time: its trace reads the switches as they are now
        return np.asarray(jax.jit(lambda *a: sample(*a)[0])(x, args, tables, history)).reshape(len(rows), draws)

    resolved_rows, all_rows = [0, 1, 3], [0, 1, 2, 3]
    radix = {rows[-1]: batch(rows) for rows in (resolved_rows[:2], all_rows)}
    monkeypatch.setattr(sampling, "FILTER_CANDIDATES_ON_CPU", True)
    monkeypatch.setattr(sampling, "FILTER_CANDIDATES", 32)
    np.testing.assert_array_equal(batch(resolved_rows[:2]), radix[1])
    np.testing.assert_array_equal(batch(all_rows), radix[3])
    assert all(len(set(radix[3][i])) > 3 for i in range(3))  # the draws vary
    assert len(set(radix[3][3])) == 1  # the greedy row


def test_sampler_equals_numpy_reference():
    """Greedy rows take the argmax of the NumPy-processed logits (bias, allowed tokens, single- and multi-token
    bans with their `until`, presence / frequency / repetition penalties; a row with flags 0 ignores the garbage
    in its slot's tables); sampled rows (temperature 0.8, min_p 0.1) draw from the NumPy distribution: every draw
    inside its support, the empirical distribution within 0.1 total variation of it; log-probabilities stay the
    model's. Checked to fail with each of the penalties, the allowed mask, the bans and min_p removed in turn from
    `sample`."""
    logits, meta, tables, history, expected = _case()
    num_rows = len(logits)
    repeat, temp, min_p = 600, 0.8, 0.1
    # one batch: the greedy rows, then each setting `repeat` times sampled (one seed per row)
    rows = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), _arrays(meta, 1, 0.0, 0.0),
                        _arrays(meta, repeat, temp, min_p, seed0=7))
    x = jnp.concatenate([jnp.asarray(logits), jnp.repeat(jnp.asarray(logits), repeat, axis=0)])
    tokens, token_logp, *_ = jax.jit(sample)(x, rows, tables, history)
    greedy, drawn = np.asarray(tokens[:num_rows]), np.asarray(tokens[num_rows:])
    np.testing.assert_array_equal(greedy, expected.argmax(-1))
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    np.testing.assert_allclose(np.asarray(token_logp[:num_rows]), np.take_along_axis(logp, greedy[:, None], 1)[:, 0],
                               rtol=1e-6)
    for i in range(num_rows):
        scaled = expected[i] / temp
        p = np.exp(scaled - scaled.max())
        p /= p.sum()
        p[p < min_p * p.max()] = 0.0
        p /= p.sum()
        got = drawn[i * repeat : (i + 1) * repeat]
        assert set(got) <= set(np.flatnonzero(p)), f"row {i}: drew {sorted(set(got) - set(np.flatnonzero(p)))} outside the support"
        freq = np.bincount(got, minlength=len(p)) / repeat
        tv = 0.5 * np.abs(freq - p).sum()
        assert tv < 0.1, f"row {i}: total variation {tv:.3f} from the reference distribution"


@pytest.mark.parametrize("k", [5, 16, 20, 37])
def test_top_k_exact_equals_a_sort_and_keeps_each_pass_small(k):
    """`top_k_exact` gives the values and indices of a stable descending NumPy sort (ties in index order: rows
    with many equal values) while every TopK it emits has k <= GPU_TOPK_MAX_K (XLA's GPU kernel; a larger k is a
    full sort of the row on the GPU). Checked to fail with the second pass's -inf masking removed (indices repeat)
    and with `lax.top_k(x, k)` restored (the jaxpr's k is 20)."""
    rng = np.random.default_rng(k)
    x = rng.standard_normal((6, 300)).astype(np.float32)
    x[1] = np.round(x[1])  # a handful of distinct values: ties across the pass boundary
    x[2, :40] = 3.0
    values, ids = jax.jit(top_k_exact, static_argnums=(1, 2))(jnp.asarray(x), k, 0)
    order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.asarray(ids), order)
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(x, order, axis=-1))
    jaxpr = str(jax.make_jaxpr(top_k_exact, static_argnums=(1, 2))(jnp.asarray(x), k, 0))
    ks = [int(m) for m in re.findall(r"top_k\[.*?k=(\d+)", jaxpr)]
    assert ks and max(ks) <= 16 and sum(ks) == k, jaxpr


@pytest.mark.parametrize("k", [5, 20, 37])
def test_top_k_exact_by_blocks_equals_a_sort(k):
    """Only the k blocks of largest maxima searched (`block=8`: 300 values, 38 blocks, the last one padded) give the
    same values and indices as a stable descending sort: ties inside and across blocks, blocks whose maxima tie
    at the k-th (some chosen, some not), values equal to that maximum inside blocks of larger maxima, the best
    values in the padded block, -inf values. Checked to fail with the chosen blocks left in the order of their
    maxima (ties out of index order) and with the padding 0 instead of -inf (rows of negative values get
    padding's indices)."""
    rng = np.random.default_rng(100 + k)
    x = rng.standard_normal((6, 300)).astype(np.float32)
    x[1] = np.round(x[1] * 2)  # few distinct values: ties everywhere
    x[2, 50:90] = 4.0  # equal values across block boundaries
    x[3, 296:] = 5.0  # the best values in the padded last block
    x[4] = np.round(x[4]) - 3.0  # all negative, many blocks of equal maxima
    x[4, ::7] = -0.5
    x[5, rng.random(300) < 0.5] = -np.inf
    values, ids = jax.jit(top_k_exact, static_argnums=(1, 2))(jnp.asarray(x), k, 8)
    order = np.argsort(-x, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.asarray(ids), order)
    np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(x, order, axis=-1))


def _reference_top_k_top_p(x, k, p):
    """vLLM's top-k / top-p mask of one row by a float64 sort: the top-k set is every logit >= the k-th largest;
    top-p keeps, over that set's softmax in descending order, each token whose predecessors hold < p."""
    order = np.argsort(-x, kind="stable")
    s = x[order].astype(np.float64)
    kth = s[min(k, len(x)) - 1] if k > 0 else -np.inf
    keep = x >= kth
    probs = np.where(keep[order], np.exp(s - s[0]), 0.0)
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    last = max(int(np.sum(before < p)), 1) - 1 if p < 1.0 else len(x) - 1
    return keep & (x >= s[last])


def _filter_rows(seed, n, ks, ps, vocab=1000):
    """Rows for the top-k / top-p filter tests: random ones of three scales, rows of few distinct values (ties at
    the thresholds), rows mostly -inf (after min_p) and rows of neighbouring floats (thresholds that differ in the
    lowest bits), each with a k and a p drawn from `ks` and `ps`."""
    rng = np.random.default_rng(seed)
    rows, row_ks, row_ps = [], [], []
    for i in range(n):
        x = rng.standard_normal(vocab).astype(np.float32) * rng.choice([0.5, 2.0, 6.0])
        if i % 4 == 1:
            x = np.round(x * 2) / 2
        if i % 4 == 2:
            x[rng.random(vocab) < 0.7] = -np.inf
        if i % 4 == 3:
            x = (np.uint32(np.float32(rng.standard_normal()).view(np.uint32)) + rng.permutation(vocab).astype(np.uint32)).view(np.float32)
        rows.append(x)
        row_ks.append(int(rng.choice(ks)))
        row_ps.append(float(rng.choice(ps)))
    return np.stack(rows), row_ks, row_ps


@pytest.mark.parametrize("rolled,candidates", [(False, 0), (True, 0), (False, 64)],
                         ids=["unrolled", "fori_loop", "candidates-then-radix"])
def test_top_k_top_p_filter_equals_a_float64_sort(rolled, candidates):
    """`_filter_top_k_top_p` (thresholds by radix select, no sort) keeps exactly the tokens of a float64 sort's
    top-k / top-p (ties at either threshold kept, as vLLM does): random rows, rows of few distinct values, rows
    with -inf (after min_p), k of 1, inside and past the vocabulary, p tiny, mid and 1; with the radix passes
    unrolled (the GPU's form) and in a `fori_loop` (the CPU's), and behind the candidates' check (rows it cannot
    resolve: the radix passes run). Checked to fail with the radix select's last pass dropped (`range(..., 0,
    ...)`: the low bits stay zero and ties of the high bits get in; and, for the loop alone, `fori_loop(0,
    num_passes - 1, ...)`) and with the top-k set left out of the top-p softmax."""
    x, ks, ps = _filter_rows(3, 48, [0, 1, 5, 50, 999, 1000, 5000], [1e-6, 0.3, 0.9, 0.99, 1.0])
    vocab = x.shape[1]
    fn = jax.jit(functools.partial(_filter_top_k_top_p, rolled=rolled, candidates=candidates))
    got = np.isfinite(np.asarray(fn(jnp.asarray(x), jnp.asarray(ks, jnp.int32), jnp.asarray(ps, jnp.float32))))
    for i in range(len(x)):
        want = _reference_top_k_top_p(x[i], ks[i], ps[i]) & np.isfinite(x[i])
        np.testing.assert_array_equal(got[i], want, err_msg=f"row {i}: k={ks[i]} p={ps[i]}")
    assert 1 <= got.sum(-1).min() and got.sum(-1).max() == vocab  # from one token up to all


@pytest.mark.parametrize("candidates", [64, 1000], ids=["64", "whole-row"])
def test_thresholds_from_candidates_equal_a_float64_sort(candidates):
    """`_thresholds_from_candidates` resolves a row only where its thresholds lie among its largest logits, and
    then keeps exactly the float64 sort's tokens; the filter then takes that path (no radix passes) and keeps the
    same. Rows of k <= 50 and top-k of the whole vocabulary with a small p, in all four kinds of rows; the
    expected resolved rows are named independently (k within the candidates and no tie across the last one;
    with all 1000 candidates, every row). Checked to fail with the tie check (`kth > last`) dropped (rows of few
    distinct values lose tied tokens), with the whole row's normaliser replaced by the candidates' (top-p of
    top-k 0 keeps too few)."""
    x, ks, ps = _filter_rows(5, 64, [0, 1, 5, 50, 999], [1e-6, 0.07, 0.33, 1.0])  # p * k never a whole number: no float ties
    x[0, 100:200] = 9.0  # 100 equal best logits: top-k 5 keeps them all, past any 64 candidates
    x[4, 300:340] = 9.0  # 40 of them: within the candidates
    ks[0], ps[0], ks[4], ps[4], ks[8], ps[8] = 5, 1.0, 5, 1.0, 999, 1.0
    ok, threshold = jax.jit(_thresholds_from_candidates, static_argnums=3)(
        jnp.asarray(x), jnp.asarray(ks, jnp.int32), jnp.asarray(ps, jnp.float32), candidates)
    ok, threshold = np.asarray(ok), np.asarray(threshold)
    resolved = 0
    for i in range(len(x)):
        want = _reference_top_k_top_p(x[i], ks[i], ps[i]) & np.isfinite(x[i])
        s = np.sort(x[i])[::-1]
        k = ks[i] if 0 < ks[i] < len(s) else len(s)
        if candidates == len(s):
            assert ok[i], f"row {i}: every logit is a candidate"
        elif ps[i] == 1.0:  # top-k alone: resolved iff the k-th is a candidate with no equal past the last one
            assert ok[i] == (k == len(s) or k <= candidates and (s[k - 1] > s[candidates - 1] or s[k - 1] == -np.inf)), f"row {i}"
        if ok[i]:
            resolved += 1
            kept = np.asarray(jnp.asarray(x[i]) >= threshold[i])
            np.testing.assert_array_equal(kept & np.isfinite(x[i]), want, err_msg=f"row {i}: k={ks[i]} p={ps[i]}")
    assert resolved >= len(x) // 3, resolved
    rows = np.flatnonzero(ok)
    fn = jax.jit(functools.partial(_filter_top_k_top_p, candidates=candidates))
    got = np.isfinite(np.asarray(fn(jnp.asarray(x[rows]), jnp.asarray(ks, jnp.int32)[rows], jnp.asarray(ps, jnp.float32)[rows])))
    for r, i in enumerate(rows):
        np.testing.assert_array_equal(got[r], _reference_top_k_top_p(x[i], ks[i], ps[i]) & np.isfinite(x[i]), err_msg=f"row {i}")


def test_token_history_follows_the_holdings_of_a_slot():
    """The runner's bookkeeping (`SlotTableKeeper.sync`) on its own: a penalised sequence's slot rows are reset
    when it takes the slot, the step's `record_fed_tokens` adds what it feeds (prompt positions to the prompt
    mask, later ones to the output counts), the same sequence taking the same slot again after a recompute
    preemption starts from zero (it re-feeds everything), and one resuming in another slot with 5 tokens fed
    (a swap-in) gets them written from the host; a sequence without penalties leaves the rows alone. Checked to
    fail with the holding keyed by the sequence alone (not its preemptions) and with the swap-in rebuild writing
    only the reset."""
    from jhybrid.engine.scheduler import ScheduledRow
    from jhybrid.engine.sequence import Sequence
    from jhybrid.engine.slot_tables import SlotTableKeeper

    vocab = 16
    keeper = SlotTableKeeper(5, vocab, 4)
    seq = Sequence("a", [1, 2, 3, 3], SamplingParams(frequency_penalty=1.0))
    seq.slot = 2
    record = jax.jit(lambda h, slot, ids, out: sample_history(h, slot, ids, out))

    def rows(slot):
        return (np.asarray(keeper.history.output_counts[slot]), np.asarray(keeper.history.prompt_mask[slot]))

    keeper.history = record(keeper.history, 2, [9, 9, 9, 9, 9, 9], [True] * 6)  # a previous holder's garbage
    keeper.sync([ScheduledRow(seq, 0, 4, True)])
    assert not rows(2)[0].any() and not rows(2)[1].any()
    keeper.history = record(keeper.history, 2, [1, 2, 3, 3, 5, 5, 7], [False] * 4 + [True] * 3)
    counts, mask = rows(2)
    assert counts.tolist() == np.bincount([5, 5, 7], minlength=vocab).tolist() and np.flatnonzero(mask).tolist() == [1, 2, 3]
    seq.token_ids += [5, 5, 7]
    keeper.sync([ScheduledRow(seq, 7, 1, True)])  # the same holding: nothing written
    assert rows(2)[0].tolist() == counts.tolist()
    seq.num_preemptions += 1  # recomputed, back in the same slot: re-feeds from position 0
    keeper.sync([ScheduledRow(seq, 0, 7, True)])
    assert not rows(2)[0].any() and not rows(2)[1].any()
    seq.num_preemptions += 1  # swapped out after 7 fed tokens, back in slot 3
    seq.slot = 3
    keeper.sync([ScheduledRow(seq, 7, 1, True)])
    counts, mask = rows(3)
    assert counts.tolist() == np.bincount([5, 5, 7], minlength=vocab).tolist() and np.flatnonzero(mask).tolist() == [1, 2, 3]
    plain = Sequence("b", [4, 4], SamplingParams())
    plain.slot = 3
    keeper.sync([ScheduledRow(plain, 0, 2, True)])
    assert rows(3)[0].tolist() == counts.tolist()


def sample_history(history, slot, ids, is_output):
    """`record_fed_tokens` of one row's tokens into `slot`."""
    from jhybrid.engine.sampling import record_fed_tokens

    ids = jnp.asarray(ids, jnp.int32)
    return record_fed_tokens(history, jnp.full(ids.shape, slot, jnp.int32), ids, jnp.asarray(is_output),
                             jnp.ones(ids.shape, bool))


# ------------------------------------------------------------------------------------------ through the engine
@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny[1], **ENGINE)


def _reference_greedy(hf_model, prompt, num_tokens, presence=0.0, frequency=0.0, repetition=1.0):
    """Greedy decoding of the HF model: transformers' RepetitionPenaltyLogitsProcessor (prompt + output), then
    OpenAI's presence / frequency penalties over the output in NumPy."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    ids = list(prompt)
    rep = RepetitionPenaltyLogitsProcessor(repetition) if repetition != 1.0 else None
    for _ in range(num_tokens):
        with torch.no_grad():
            x = torch.tensor([ids])
            logits = hf_model(x, position_ids=torch.arange(len(ids))[None]).logits[:, -1].float()
        if rep is not None:
            logits = rep(x, logits)
        scores = logits[0].numpy().astype(np.float64)
        counts = np.bincount(ids[len(prompt):], minlength=len(scores))
        scores = scores - frequency * counts - presence * (counts > 0)
        ids.append(int(scores.argmax()))
    return ids[len(prompt):]


def test_penalties_greedy_equal_hf(tiny, llm):
    """Greedy output under repetition_penalty (over prompt and output) equals HF transformers'
    `generate(repetition_penalty=...)`, and under presence + frequency (+ repetition) penalties the HF model's
    greedy decoding with transformers' repetition processor and NumPy presence / frequency penalties; the prompts
    are longer than a step's 128 tokens (chunked prefill: the prompt part of the history is built over two steps).
    Checked to fail with the history not recorded in the step, with prompt tokens recorded as output tokens, and
    with the penalties not applied."""
    hf, _ = tiny
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 12, size=n).tolist() for n in (150, 140)]  # few distinct tokens: repeats
    settings = [dict(repetition_penalty=1.8), dict(presence_penalty=1.2, frequency_penalty=0.9, repetition_penalty=0.7)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=10, **GREEDY, **kw) for kw in settings])
    plain = llm.generate(prompts, SamplingParams(max_tokens=10, **GREEDY))
    assert all(p.token_ids != o.token_ids for p, o in zip(plain, outs)), "the penalties were meant to change the output"
    with torch.no_grad():
        full = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                           repetition_penalty=1.8)
    assert outs[0].token_ids == full[0, len(prompts[0]) :].tolist()
    assert outs[1].token_ids == _reference_greedy(hf, prompts[1], 10, 1.2, 0.9, 0.7)


def test_penalised_outputs_survive_preemption_and_swapping(tiny, llm):
    """Four penalised requests whose prompts fill `ENGINE`'s pool (11 of its 44 blocks each) are preempted while
    decoding, with output tokens in their history: recomputed ones re-feed their tokens (the slot's history is
    reset when the sequence takes it again, so each token counts once) and swapped-out ones resume without
    re-feeding (their history is rebuilt from the host's tokens). The outputs equal each request's run alone.
    Checked to fail with the swap-in rebuild writing only the reset (no tokens); the reset of a slot the same
    sequence takes again is `test_token_history_follows_the_holdings_of_a_slot`'s (here the recomputed sequences
    come back in other slots)."""
    _, model = tiny
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 12, size=n).tolist() for n in (172, 170, 168, 166)]
    params = SamplingParams(max_tokens=14, frequency_penalty=1.1, presence_penalty=0.3, repetition_penalty=1.4,
                            **GREEDY)
    want = [llm.generate([p], params)[0].token_ids for p in prompts]
    recomputed = llm.generate(prompts, params)
    assert llm.engine.stats()["num_recompute_preemptions"] > 0
    assert [o.token_ids for o in recomputed] == want
    swapping = LLM(model, **ENGINE, host_kv_memory_gb=0.01, preemption_mode="swap")
    swapped = swapping.generate(prompts, params)
    assert swapping.engine.stats()["num_swap_preemptions"] > 0
    assert [o.token_ids for o in swapped] == want


def test_min_tokens_allowed_tokens_and_min_p_through_the_engine(llm):
    """A logit bias of +100 forces a stop token id; min_tokens 5 holds it off for exactly 5 tokens (the sixth is
    it); allowed_token_ids keeps every sampled token in the set (and more than one of it is drawn); min_p 1.0
    leaves only the most likely token, so a hot sampled request decodes as greedy does. Checked to fail with the
    min_tokens bans, the allowed mask and min_p removed in turn."""
    prompt = list(range(3, 40))
    stop = 11
    forced = dict(max_tokens=20, stop_token_ids=[stop], logit_bias={stop: 100.0}, temperature=0.0)
    (early,) = llm.generate([prompt], SamplingParams(**forced))
    assert early.token_ids == [stop] and early.finish_reason == "stop"
    (held,) = llm.generate([prompt], SamplingParams(**forced, min_tokens=5))
    assert held.token_ids[5:] == [stop] and stop not in held.token_ids[:5] and held.finish_reason == "stop", held.token_ids
    allowed = [5, 9, 17, 60]
    outs = llm.generate([prompt] * 3, [SamplingParams(max_tokens=12, temperature=1.5, seed=s, ignore_eos=True,
                                                      allowed_token_ids=allowed) for s in range(3)])
    drawn = [t for o in outs for t in o.token_ids]
    assert set(drawn) <= set(allowed) and len(set(drawn)) > 1, drawn
    (greedy,) = llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))
    (hot,) = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=5.0, seed=1, min_p=1.0, ignore_eos=True))
    assert hot.token_ids == greedy.token_ids


def test_validation():
    """Out-of-range settings are refused with the field named."""
    for kw, field in [(dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
                      (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
                      (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
                      (dict(bad_words=[" "]), "bad_words"), (dict(n=0), "n"), (dict(n=3, best_of=2), "best_of"),
                      (dict(include_stop_str_in_output=1), "include_stop_str_in_output")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    assert SamplingParams(n=2, best_of=4, bad_words="x").bad_words == ("x",)


def _sample_args(rows: int, vocab: int, dtype, with_mask: bool) -> list:
    """`sample`'s arguments as shapes: `rows` x `vocab` logits of `dtype`, every setting, 4 slots' tables, and a
    grammar mask or none."""
    slots = 4
    f32, i32 = jax.ShapeDtypeStruct((rows,), jnp.float32), jax.ShapeDtypeStruct((rows,), jnp.int32)
    s = SamplingArrays(temperature=f32, top_k=i32, top_p=f32, seeds=i32, counters=i32, want_logprobs=i32,
                       slot_ids=i32, flags=i32, min_p=f32, presence_penalty=f32, frequency_penalty=f32,
                       repetition_penalty=f32, num_output=i32,
                       recent=jax.ShapeDtypeStruct((rows, MAX_BAN_TOKENS - 1), jnp.int32))
    tables = SlotTables(bias_ids=jax.ShapeDtypeStruct((slots, MAX_LOGIT_BIAS), jnp.int32),
                        bias_values=jax.ShapeDtypeStruct((slots, MAX_LOGIT_BIAS), jnp.float32),
                        bans=jax.ShapeDtypeStruct((slots, 4, MAX_BAN_TOKENS + 1), jnp.int32),
                        allowed=jax.ShapeDtypeStruct((slots, vocab), jnp.bool_))
    history = TokenHistory(output_counts=jax.ShapeDtypeStruct((slots, vocab), jnp.int32),
                           prompt_mask=jax.ShapeDtypeStruct((slots, vocab), jnp.bool_))
    args = [jax.ShapeDtypeStruct((rows, vocab), dtype), s, tables, history]
    if with_mask:
        args.append(jax.ShapeDtypeStruct((rows, vocab // 32), jnp.int32))
    return args


def _sample_program_entry(rows: int, vocab: int, dtype, with_mask: bool) -> str:
    """The entry computation of `sample` (no plan) compiled for this machine at `_sample_args`, as optimised HLO."""
    text = jax.jit(sample).lower(*_sample_args(rows, vocab, dtype, with_mask)).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    return entry[: entry.index("\n}\n")]


def test_a_step_that_modifies_no_logits_copies_none():
    """`sample` without a plan (the single-step programs) puts its logit-modifying parts (mask, allowed tokens, bans,
    penalties) under one `lax.cond` whose result is the tokens: no conditional at the program's top level returns a
    `[B, V]` array, since a cond whose skipped branch passes the logits through copies them whole (four copies of the
    fp32 logits a greedy step before, 1.2 GB at 256 rows on the H200 compile: benchmarks/RESULTS.md, session 37).
    The tokens themselves are checked by the tests above. Checked to fail with the four parts' own conds at the top
    level again (four such conditionals)."""
    rows, vocab = 8, 512
    entry = _sample_program_entry(rows, vocab, jnp.float32, with_mask=True)
    conds = [line for line in entry.splitlines() if " conditional(" in line]
    assert conds, "no conditional left: the test no longer sees the structure it checks"
    wide = [line.split("conditional(")[0] for line in conds if f"[{rows},{vocab}]" in line.split("conditional(")[0]]
    assert not wide, wide


def test_a_step_without_bias_writes_no_logits_array():
    """Without a plan, `sample` of the model's bf16 logits takes the sampled tokens' logprobs from each row's
    normaliser (no `[B, V]` log_softmax), and adds the logit bias only under the cond of the logit-modifying parts
    (`FLAG_BIAS`), so on this machine's compile no instruction at the program's top level makes a `[B, V]` array:
    before, a cast, its copy, the bias's scatter and log_softmax's subtraction did (on the H200 compile at 256
    rows: 0.70 -> 0.23 GB of `[B, V]` outputs, the cast alone left: benchmarks/RESULTS.md, session 38). The tokens
    and logprobs themselves are checked by the tests above and in test_logprobs.py. Checked to fail with the bias
    added before the cond again, and with the logprobs taken from a whole-row log_softmax again."""
    rows, vocab = 8, 512
    entry = _sample_program_entry(rows, vocab, jnp.bfloat16, with_mask=False)
    made = [line.strip()[:160] for line in entry.splitlines()
            if " = " in line and f"[{rows},{vocab}]" in line.split(" = ")[1].split("(")[0]
            and " parameter(" not in line]
    assert not made, made


def test_the_conds_take_the_rows_settings_packed():
    """Without a plan, `sample`'s conds take the rows' settings (`SamplingArrays`, which the engine slices out of
    its packed step metadata) as one packed vector, unpacked inside each branch: a cond's operand is a buffer of
    its own, so each setting it took was one more kernel a step (on the H200 compile, qwen3_next's batch-1 step
    342 -> 334 kernels: benchmarks/RESULTS.md, session 38). Checked at the jaxpr: no top-level cond takes a `[B]`
    or `[B, W]` array. Checked to fail with the outer cond closing over `s` again."""
    rows, vocab = 8, 512
    jaxpr = jax.make_jaxpr(sample)(*_sample_args(rows, vocab, jnp.bfloat16, with_mask=True))
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    assert len(conds) >= 2, "the test no longer sees the conds it checks"
    per_row = [(e.primitive.name, v.aval.shape) for e in conds for v in e.invars[1:]
               if v.aval.shape[:1] == (rows,) and v.aval.shape != (rows, vocab) and v.aval.shape != (rows, vocab // 32)]
    assert not per_row, per_row
