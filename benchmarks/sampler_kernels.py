"""The sampler on its own (issue 19): what each part of `jhybrid.engine.sampling.sample` costs on the device at a
decode step's shape, and the sort-free top-k / top-p filter against the sort it replaced, in one run.

    PYTHONPATH=. python -m benchmarks.sampler_kernels [--batch 64] [--vocab 151936] [--json out.json]
    PYTHONPATH=. python -m benchmarks.sampler_kernels --batch 4 --vocab 4096 --iters 3 --interpret  # CPU smoke test

Rows of random logits (standard normal x 4, the spread of a language model's logits) in float32. Each case is
one jitted function, called `--iters` times after a warm call; the figure is the median wall time of a call
ended by `block_until_ready` (one kernel launch or a few: on the GPU this is device time plus ~10-20 us of
dispatch, the same for every case). Before timing, the filter's kept set is checked against the sort's on every
row (they must agree exactly: same thresholds, ties kept).

The Pallas kernel of both thresholds (`pallas_kernels.sampling`, issue 19) runs in several configurations
(`PALLAS_CONFIGS`: tile of the vocabulary, tiles a loop iteration, key bits a pass R, warps, tile skipping, L2
eviction policy); each is first checked to keep exactly the tokens of the shipped XLA filter on every row (a mismatch is printed and the case not timed),
on the benchmark's rows (top-k 50, top-p 0.9) and on rows of top-p 0.9 alone (k off: the top-p set over the whole
vocabulary). `--interpret` runs them in the Pallas interpreter (CPU smoke test; without it they are skipped off
the GPU); `--no-xla-variants` leaves out the radix variants of the XLA filter (all but the shipped one).

Cases: the argmax (a greedy row's whole cost), the sort-based filter (the previous `_filter_top_k_top_p`: a
descending sort of the row, then a cumulative sum), the radix-select filter at 1, 2 and 4 key bits a pass, its
row sums done three ways (the shipped ones: `sampling.RADIX_BITS`, `sampling._masked_sums`), the categorical draw alone, and `sample()` greedy, sampled
(temperature 0.8, top-k 50, top-p 0.9) and sampled with the top-5 log-probabilities.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def sort_filter(logits, top_k, top_p):
    """The sort-based top-k / top-p of sessions 9-11 (the baseline), ties kept at both thresholds."""
    import jax
    import jax.numpy as jnp

    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    in_top_k = sorted_desc >= kth
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    num_keep = jnp.maximum(jnp.sum(mass_before < top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    return jnp.where(logits >= jnp.maximum(kth, pth), logits, -jnp.inf)


def sampling_arrays(n: int, temperature: float, logprobs: bool = False):
    """`SamplingArrays` of `n` rows in slots 1..n: greedy (temperature 0) or sampled with top-k 50, top-p 0.9;
    the top log-probabilities wanted or not; no other control."""
    import jax.numpy as jnp

    from jhybrid.engine import sampling

    return sampling.SamplingArrays(
        temperature=jnp.full(n, temperature, jnp.float32), top_k=jnp.full(n, 50 if temperature else 0, jnp.int32),
        top_p=jnp.full(n, 0.9 if temperature else 1.0, jnp.float32), seeds=jnp.arange(n, dtype=jnp.int32),
        counters=jnp.zeros(n, jnp.int32), want_logprobs=jnp.full(n, int(logprobs), jnp.int32),
        slot_ids=jnp.arange(1, n + 1, dtype=jnp.int32), flags=jnp.zeros(n, jnp.int32),
        min_p=jnp.zeros(n, jnp.float32), presence_penalty=jnp.zeros(n, jnp.float32),
        frequency_penalty=jnp.zeros(n, jnp.float32), repetition_penalty=jnp.ones(n, jnp.float32),
        num_output=jnp.zeros(n, jnp.int32), recent=jnp.full((n, sampling.MAX_BAN_TOKENS - 1), -2, jnp.int32))


def timed(fn, args, iters: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return float(np.median(out)) * 1e3


# Pallas configurations timed: (tile, tiles a loop iteration, key bits a pass R, warps, skipping: "table" (group
# maxima read back from memory) / "vector" (picked out of registers) / None, eviction policy)
PALLAS_CONFIGS = [
    (256, 4, 4, 4, "table", None), (256, 4, 4, 4, "vector", None), (256, 8, 4, 4, "table", None),
    (512, 4, 4, 8, "table", None), (128, 8, 4, 4, "table", None), (256, 4, 2, 4, "table", None),
    (512, 4, 2, 8, "table", None), (256, 4, 4, 4, None, None), (256, 4, 4, 4, "table", "evict_last"),
]
PALLAS_CONFIGS_INTERPRET = [(256, 4, 4, 4, "table", None), (512, 2, 2, 4, None, None)]  # CPU smoke test: a few only


def pallas_variants(logits, top_k, top_p, interpret: bool) -> dict:
    """`{name: (jitted filter, args)}` of the Pallas kernel's configurations, each checked first to keep exactly
    the shipped XLA filter's tokens, on the given rows and on rows of top-p alone (the XLA filter's own time on
    those is a case too). Empty off the GPU unless `interpret`."""
    import jax
    import jax.numpy as jnp

    from jhybrid.engine import sampling
    from pallas_kernels.sampling import apply_thresholds, top_k_top_p_thresholds_pallas

    if jax.default_backend() != "gpu" and not interpret:
        print("Pallas cases skipped: no GPU (--interpret runs them in the interpreter)")
        return {}
    xla = jax.jit(sampling._filter_top_k_top_p)
    k_off = jnp.zeros_like(top_k)
    inputs = {"": (logits, top_k, top_p), ", top-p 0.9 alone": (logits, k_off, top_p)}
    cases = {"top-k/top-p, XLA radix, top-p 0.9 alone": (xla, inputs[", top-p 0.9 alone"])}
    for block, unroll, bits, warps, skip, eviction in (PALLAS_CONFIGS_INTERPRET if interpret else PALLAS_CONFIGS):
        tuning = dict(block=block, unroll=unroll, bits=bits, num_warps=warps, skip=skip is not None,
                      table=skip == "table", eviction=eviction, interpret=interpret)

        def fn(x, k, p, tuning=tuning):
            return apply_thresholds(x, *top_k_top_p_thresholds_pallas(x, k, p, **tuning))

        fn = jax.jit(fn)
        label = (f"Pallas blk{block}x{unroll} R{bits} w{warps}{' skip-' + skip if skip else ' no-skip'}"
                 f"{' ' + eviction if eviction else ''}")
        for suffix, args in inputs.items():
            want = np.isfinite(np.asarray(xla(*args)))
            try:
                got = np.isfinite(np.asarray(fn(*args)))
            except Exception as e:  # a configuration Triton cannot compile: say so, time the others
                print(f"FAILED {label}{suffix}: {type(e).__name__}: {str(e)[:300]}")
                break
            if (got != want).any():
                print(f"MISMATCH {label}{suffix}: {int((got != want).sum())} tokens in rows "
                      f"{np.flatnonzero((got != want).any(-1)).tolist()} differ from the XLA filter; not timed")
                continue
            cases[label + suffix] = (fn, args)
    print(f"Pallas == XLA filter for {sum(1 for n in cases if n.startswith('Pallas'))} cases")
    return cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json")
    parser.add_argument("--interpret", action="store_true", help="run the Pallas cases in the interpreter (CPU)")
    parser.add_argument("--no-xla-variants", action="store_true", help="time only the shipped XLA radix filter")
    parser.add_argument("--filters-only", action="store_true", help="leave out the draw and sample() cases")
    a = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jhybrid.engine import sampling
    from jhybrid.engine.slot_tables import init_tables

    b, v = a.batch, a.vocab
    logits = jax.random.normal(jax.random.key(0), (b, v), jnp.float32) * 4.0
    top_k = jnp.full(b, 50, jnp.int32)
    top_p = jnp.full(b, 0.9, jnp.float32)
    res = {"device": str(jax.devices()[0].device_kind), "batch": b, "vocab": v, "ms": {}}

    def chunked_sums(keys, weights, cand, groups=128):
        """The row sums in two levels: [B, groups, V / groups] (more programs for the reduction)."""
        pad = -keys.shape[1] % groups
        keys = jnp.pad(keys, ((0, 0), (0, pad))).reshape(keys.shape[0], groups, -1)
        weights = jnp.pad(weights, ((0, 0), (0, pad))).reshape(keys.shape)
        return jnp.stack([jnp.sum(jnp.where(keys >= cand[:, j, None, None], weights, 0.0), axis=(1, 2))
                          for j in range(cand.shape[1])], axis=-1)

    def broadcast_sums(keys, weights, cand):
        """All candidates in one reduction over a [B, V, C] comparison."""
        return jnp.sum(jnp.where(keys[:, :, None] >= cand[:, None, :], weights[:, :, None], 0.0), axis=1)

    sums = {"stack": sampling._masked_sums, "chunked": chunked_sums, "broadcast": broadcast_sums}

    def radix(bits, how="stack"):
        def fn(x, k, p):
            old = sampling.RADIX_BITS, sampling._masked_sums
            sampling.RADIX_BITS, sampling._masked_sums = bits, sums[how]  # read while tracing
            try:
                return sampling._filter_top_k_top_p(x, k, p)
            finally:
                sampling.RADIX_BITS, sampling._masked_sums = old
        return jax.jit(fn)

    reference = np.isfinite(np.asarray(jax.jit(sort_filter)(logits, top_k, top_p)))
    variants = {f"top-k/top-p, radix {bits} bits, {how} sums": radix(bits, how)
                for how in sums for bits in (1, 2, 4)
                if not a.no_xla_variants or (bits, how) == (sampling.RADIX_BITS, "stack")}
    for name, fn in variants.items():
        kept = np.isfinite(np.asarray(fn(logits, top_k, top_p)))
        assert (kept == reference).all(), f"{name}: {int((kept != reference).sum())} tokens differ from the sort"
    print(f"radix filter == sort filter on {b} rows (kept per row {reference.sum(-1).min()}-{reference.sum(-1).max()})")

    pallas_cases = pallas_variants(logits, top_k, top_p, a.interpret)
    tables, history = init_tables(b + 1, v)

    def draw(x):
        keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), 0))(jnp.arange(b, dtype=jnp.uint32))
        return jax.vmap(jax.random.categorical)(keys, x)

    sample = jax.jit(sampling.sample)
    cases = {
        "argmax (greedy floor)": (jax.jit(lambda x: jnp.argmax(x, -1)), (logits,)),
        "top-k/top-p, sort (baseline)": (jax.jit(sort_filter), (logits, top_k, top_p)),
        **{name: (fn, (logits, top_k, top_p)) for name, fn in variants.items()},
        **pallas_cases,
        "categorical draw": (jax.jit(draw), (logits,)),
        "sample(): greedy": (sample, (logits, sampling_arrays(b, 0.0), tables, history)),
        "sample(): temperature, top-k 50, top-p 0.9": (sample, (logits, sampling_arrays(b, 0.8), tables, history)),
        "sample(): sampled + top-5 logprobs": (sample, (logits, sampling_arrays(b, 0.8, True), tables, history)),
    }
    if jax.default_backend() == "gpu":  # the engine's switch (read while tracing; the kernel runs on the GPU only)
        def sample_pallas(*args):
            old = sampling.TOP_K_TOP_P_IMPL
            sampling.TOP_K_TOP_P_IMPL = "pallas"
            try:
                return sampling.sample(*args)
            finally:
                sampling.TOP_K_TOP_P_IMPL = old

        cases["sample(): temperature, top-k 50, top-p 0.9, Pallas"] = (
            jax.jit(sample_pallas), (logits, sampling_arrays(b, 0.8), tables, history))
    if a.filters_only:
        cases = {n: c for n, c in cases.items() if not n.startswith(("sample()", "categorical"))}
    print(f"{res['device']}, batch {b}, vocab {v}: ms per call (median of {a.iters})")
    for name, (fn, args) in cases.items():
        res["ms"][name] = ms = timed(fn, args, a.iters)
        print(f"  {name:60s} {ms:8.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
