"""`jhybrid.engine.sampling.top_k_exact` on the device: searching only the k blocks of largest maxima (`--block`
widths) against the whole-row TopK passes (`block=0`), checked equal first; and, for scale, the other full-vocabulary pieces of a
sampled decode step (the top-k / top-p filter by radix passes and by 64 candidates found with the fastest block
at k = 64, `jax.random.categorical`, `log_softmax`).

    PYTHONPATH=. python3 -m benchmarks.topk [--k 20,64] [--block 32,64,128,256] [--json PATH]

Shapes: 1, 64 and 256 rows of a 151,936-token vocabulary, float32. Each figure is the median over 7 rounds of
(20 calls dispatched back to back, then waited for) / 20, after warm-up, so launch latency overlaps device time.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", default="20,64", help="comma-separated k values (20: the logprob top-k)")
    ap.add_argument("--block", default="32,64,128,256", help="comma-separated block widths to try")
    ap.add_argument("--rows", default="1,64,256")
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from jhybrid.engine import sampling
    from jhybrid.engine.sampling import _filter_top_k_top_p, top_k_exact

    def timed(fn, *args):
        jax.block_until_ready(fn(*args))
        rounds = []
        for _ in range(7):
            t0 = time.perf_counter()
            out = [fn(*args) for _ in range(20)]
            jax.block_until_ready(out)
            rounds.append((time.perf_counter() - t0) / 20)
        return float(np.median(rounds)) * 1e3

    ks = [int(v) for v in a.k.split(",")]
    blocks = [int(v) for v in a.block.split(",")]
    results, ok = [], True
    print(f"{jax.devices()[0].device_kind}; vocab {a.vocab}")
    print("| rows | k | whole-row ms | " + " | ".join(f"block {c} ms" for c in blocks) + " | equal |")
    print("|---:|---:|---:|" + "---:|" * len(blocks) + "---|")
    for b in (int(v) for v in a.rows.split(",")):
        x = jax.random.normal(jax.random.key(b), (b, a.vocab), jnp.float32)
        for k in ks:
            whole = jax.jit(lambda y, k=k: top_k_exact(y, k, 0))
            want = whole(x)
            row = dict(rows=b, k=k, whole_ms=timed(whole, x), block_ms={})
            equal = True
            for c in blocks:
                fn = jax.jit(lambda y, k=k, c=c: top_k_exact(y, k, c))
                equal &= all(bool(jnp.array_equal(p, q)) for p, q in zip(want, fn(x)))
                row["block_ms"][c] = timed(fn, x)
            row["equal"] = equal
            ok &= equal
            results.append(row)
            print(f"| {b} | {k} | {row['whole_ms']:.3f} | " + " | ".join(f"{row['block_ms'][c]:.3f}" for c in blocks)
                  + f" | {equal} |", flush=True)
    k64 = [r for r in results if r["k"] == 64]
    if k64:  # the candidates filter below finds its 64 candidates with the block fastest at the largest batch
        sampling.TOP_K_BLOCK = int(min(k64[-1]["block_ms"], key=k64[-1]["block_ms"].get))
        print(f"TOP_K_BLOCK = {sampling.TOP_K_BLOCK} for the candidates filter", flush=True)
    others = []
    for b in (int(v) for v in a.rows.split(",")):
        x = jax.random.normal(jax.random.key(b), (b, a.vocab), jnp.float32)
        keys = jax.random.split(jax.random.key(0), b)
        tk, tp = jnp.full((b,), 50, jnp.int32), jnp.full((b,), 0.9, jnp.float32)
        parts = {
            "radix top-k 50 / top-p 0.9 filter": (jax.jit(partial(_filter_top_k_top_p, candidates=0)), (x, tk, tp)),
            "candidates top-k 50 / top-p 0.9 filter": (jax.jit(partial(_filter_top_k_top_p, candidates=64)), (x, tk, tp)),
            "jax.random.categorical": (jax.jit(jax.vmap(jax.random.categorical)), (keys, x)),
            "log_softmax": (jax.jit(lambda y: jax.nn.log_softmax(y, axis=-1)), (x,)),
            "argmax": (jax.jit(lambda y: jnp.argmax(y, axis=-1)), (x,)),
        }
        radix, cands = (np.isfinite(np.asarray(parts[n][0](*parts[n][1]))) for n in list(parts)[:2])
        ok &= bool((radix == cands).all())
        print(f"rows {b}: the two filters keep the same tokens: {bool((radix == cands).all())} "
              f"({int(radix.sum())} kept)", flush=True)
        for name, (fn, args) in parts.items():
            others.append(dict(rows=b, part=name, ms=timed(fn, *args)))
            print(f"rows {b}: {name}: {others[-1]['ms']:.3f} ms", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, vocab=a.vocab, topk=results, others=others), f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
