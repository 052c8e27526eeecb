"""`jhybrid.engine.sampling.top_k_exact` on the device: rows cut into chunks of `--chunk` against the whole-row
TopK passes (`chunk=0`, `TOP_K_CHUNK`'s default), at the logprob top-k of the sampler, checked equal first.

    PYTHONPATH=. python3 -m benchmarks.topk [--chunk 2048] [--json PATH]

Shapes: batch 1, 64 and 256 rows (and 256 prompt positions, `prompt_logprobs`' chunk) of a 151,936-token vocabulary,
float32, k = 20 (`MAX_LOGPROBS`); median of 50 timed calls after 5 warm-up calls, each call waited for.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=2048)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from jhybrid.engine.sampling import MAX_LOGPROBS, top_k_exact

    def timed(fn, x):
        for _ in range(5):
            jax.block_until_ready(fn(x))
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            times.append(time.perf_counter() - t0)
        return float(np.median(times)) * 1e3

    rows = []
    print(f"{jax.devices()[0].device_kind}; vocab {a.vocab}, k {MAX_LOGPROBS}, chunk {a.chunk}")
    print("| rows | whole-row passes ms | chunks ms | speed-up | equal |\n|---:|---:|---:|---:|---|")
    for b in (1, 64, 256):
        x = jax.random.normal(jax.random.key(b), (b, a.vocab), jnp.float32)
        whole = jax.jit(lambda y: top_k_exact(y, MAX_LOGPROBS, 0))
        chunked = jax.jit(lambda y: top_k_exact(y, MAX_LOGPROBS, a.chunk))
        equal = all(bool(jnp.array_equal(p, q)) for p, q in zip(whole(x), chunked(x)))
        t_whole, t_chunked = timed(whole, x), timed(chunked, x)
        rows.append(dict(rows=b, whole_ms=t_whole, chunked_ms=t_chunked, equal=equal))
        print(f"| {b} | {t_whole:.3f} | {t_chunked:.3f} | {t_whole / t_chunked:.2f}x | {equal} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, vocab=a.vocab, k=MAX_LOGPROBS, chunk=a.chunk,
                           rows=rows), f, indent=2)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
