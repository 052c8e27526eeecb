"""Can a small kernel pull the next projection's weight into L2 while it works, so that the GEMV after it reads
less from DRAM? (issue 20's batch-1 rows: their GEMVs stream 8-50 MB weights at 1.24-1.29x of the weights' time at
the read rate, and the 130-210 other kernels of a token leave DRAM idle for 0.6 ms.)

    PYTHONPATH=. python3 -m benchmarks.l2_prefetch [--json out.json] [--quick]
    PYTHONPATH=. python -m benchmarks.l2_prefetch --tiny        # CPU smoke test (interpreted kernel, small shapes)

A chain of "layers" in one jitted call, each: a Pallas kernel whose first `K / 128` programs do latency-bound work on
the layer's `[K]` input (a dependent loop of `--iters` tanh steps on 128 values a program, standing in for a mixer
or a norm at batch 1), then `x @ w` on its output through the engine's `jhybrid.models.quant.linear`, then a small
XLA op that makes the next layer's input. Each layer has its own weight, 1 GiB in all, so none is in L2 (50 MB)
when it is read. Variants per weight shape:

- `gemv`: the GEMVs and the small ops alone (no kernel);
- `kernel`: the kernel, then the GEMV;
- `kernel+pf P`: the same kernel with P more programs that read the GEMV's weight (`evict_last`: kept in L2) and
  write one sum each to a sink; the GEMV after it then finds its weight in L2 (the output is the same, checked);
- `kernel alone` / `kernel+pf alone`: the kernels without the GEMVs (what the prefetch costs the kernel itself).

Timed: the calls of `--reps` queued back to back, one wait at the end; microseconds per layer. The saving of a
prefetch is `kernel` - `kernel+pf`, against the weight's time at the `read` rate (a jnp sum of the same weights).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time


def log(*a):
    print(*a, flush=True)


CHUNK = 8192  # elements a prefetch program loads at once (16 KB of bf16)


def _kernel(x_ref, w_ref, o_ref, sink_ref, *, busy: int, iters: int, prefetch: int, chunks: int,
            eviction: str | None):
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    pid = pl.program_id(0)

    @pl.when(pid < busy)
    def _():
        v = x_ref[pl.ds(pl.multiple_of(pid * 128, 128), 128)].astype(jnp.float32)
        v = jax.lax.fori_loop(0, iters, lambda i, v: jnp.tanh(v * 1.0001 + 0.01), v)
        o_ref[pl.ds(pl.multiple_of(pid * 128, 128), 128)] = v.astype(o_ref.dtype)

    if prefetch:
        per = -(-chunks // prefetch)

        @pl.when(pid >= busy)
        def _():
            p = pid - busy

            rows = CHUNK // 128

            def body(i, acc):
                c = jnp.minimum(p * per + i, chunks - 1)  # the last program may read the last chunk again
                t = plt.load(w_ref.at[pl.ds(pl.multiple_of(c * rows, rows), rows), :], eviction_policy=eviction)
                return acc + t.astype(jnp.float32)  # summed once at the end: no reduction a chunk

            acc = jax.lax.fori_loop(0, per, body, jnp.zeros((rows, 128), jnp.float32))
            sink_ref[p] = jnp.sum(acc)


def busy_kernel(x, w, *, iters: int, prefetch: int, eviction: str | None, interpret: bool, stages: int = 1):
    """(the kernel's `[K]` output, the sink): `K / 128` programs of `iters` tanh steps on x, and `prefetch` more that
    read all of `w` (as `[size / 128, 128]` rows; its size a multiple of `CHUNK`)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    k_dim = x.shape[0]
    busy = k_dim // 128
    flat = w.reshape(-1, 128)  # [size / 128, 128]: a chunk is CHUNK / 128 of its rows
    chunks = flat.shape[0] * 128 // CHUNK
    whole = pl.no_block_spec
    kern = functools.partial(_kernel, busy=busy, iters=iters, prefetch=prefetch, chunks=chunks, eviction=eviction)
    return pl.pallas_call(
        kern, grid=(busy + prefetch,), in_specs=[whole, whole], out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct((k_dim,), x.dtype), jax.ShapeDtypeStruct((max(prefetch, 1),), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=stages), interpret=interpret,
        name=f"busy_i{iters}_pf{prefetch}")(x, flat)


def chain(variant: str, iters: int, prefetch: int, eviction: str | None, interpret: bool, stages: int = 1):
    """The jitted layers: `variant` in gemv / gemv_twice / kernel / kernel_alone; returns (final x, every layer's GEMV
    output). `gemv_twice` runs each layer's GEMV a second time on the first's output (its weight then in L2)."""
    import jax
    import jax.numpy as jnp

    from jhybrid.models.quant import linear

    def run(x, ws):
        k_dim = x.shape[0]
        outs = []
        for w in ws:
            h = x if variant.startswith("gemv") else busy_kernel(
                x, w, iters=iters, prefetch=prefetch, eviction=eviction, interpret=interpret, stages=stages)[0]
            if variant == "kernel_alone":
                x = h * 0.5
                continue
            y = linear(h[None, :], w)[0]
            if variant == "gemv_twice":
                n = y.shape[0]
                y = linear(((y[:k_dim] if n >= k_dim else jnp.pad(y, (0, k_dim - n))) + h)[None, :], w)[0]
            outs.append(y)
            n = y.shape[0]
            x = (y[:k_dim] if n >= k_dim else jnp.pad(y, (0, k_dim - n))) * 0.5 + x * 0.5
        return x, outs

    return jax.jit(run)


def time_calls(f, args, reps: int) -> float:
    """Seconds a call: the best of 3 rounds of `reps` calls queued back to back with one wait (after a warm call)."""
    import jax

    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        outs = [f(*args) for _ in range(reps)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def bench_shape(k_dim: int, n_out: int, total_bytes: float, iters_list, prefetches, reps: int, interpret: bool):
    import jax
    import jax.numpy as jnp

    nbytes = 2 * k_dim * n_out
    layers = max(2, math.ceil(total_bytes / nbytes))
    key = jax.random.key(k_dim + n_out)
    ws = [jax.random.normal(jax.random.fold_in(key, i), (k_dim, n_out), jnp.bfloat16) * 0.02 for i in range(layers)]
    x = jax.random.normal(jax.random.fold_in(key, 1 << 20), (k_dim,), jnp.bfloat16)
    per_layer = lambda f: time_calls(f, (x, ws), reps) / layers * 1e6  # noqa: E731
    row = dict(k=k_dim, n=n_out, mbytes=nbytes / 1e6, layers=layers)
    row["read_us"] = per_layer(jax.jit(lambda x, ws: [jnp.sum(w, dtype=jnp.float32) for w in ws]))
    row["gemv_us"] = per_layer(chain("gemv", 0, 0, None, interpret))
    row["gemv_twice_us"] = per_layer(chain("gemv_twice", 0, 0, None, interpret))
    row["cases"] = []
    for iters in iters_list:
        base = chain("kernel", iters, 0, None, interpret)
        want = base(x, ws)[1]
        case = dict(iters=iters, kernel_us=per_layer(base),
                    kernel_alone_us=per_layer(chain("kernel_alone", iters, 0, None, interpret)))
        for p in prefetches:
            for stages in (1, 3):
                ev = "evict_last"
                f = chain("kernel", iters, p, ev, interpret, stages)
                got = f(x, ws)[1]
                same = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, want))
                case[f"pf{p}_s{stages}"] = dict(
                    us=per_layer(f), same=same,
                    alone_us=per_layer(chain("kernel_alone", iters, p, ev, interpret, stages)))
        row["cases"].append(case)
        log(json.dumps(case))
    del ws
    return row


def table(rows: list[dict]) -> list[str]:
    lines = [f"{'weight K x N (MB)':>24} {'iters':>5} {'read':>7} {'gemv':>7} {'2nd':>6} {'k alone':>8} {'kernel':>7} "
             f"{'variant':>18} {'k+pf':>7} {'alone':>7} {'saved':>7} same"]
    for r in rows:
        for c in r["cases"]:
            for name, v in c.items():
                if not name.startswith("pf"):
                    continue
                lines.append(f"{r['k']:>7} x {r['n']:>5} ({r['mbytes']:5.1f}) {c['iters']:>5} {r['read_us']:7.2f} "
                             f"{r['gemv_us']:7.2f} {r['gemv_twice_us'] - r['gemv_us']:6.2f} "
                             f"{c['kernel_alone_us']:8.2f} {c['kernel_us']:7.2f} {name:>18} "
                             f"{v['us']:7.2f} {v['alone_us']:7.2f} {c['kernel_us'] - v['us']:7.2f} {v['same']}")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: small shapes, the kernel interpreted")
    ap.add_argument("--quick", action="store_true", help="one shape (the GDN out projection)")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args(argv)
    import jax

    interpret = a.tiny or jax.default_backend() != "gpu"
    if a.tiny:
        shapes, total, iters_list, prefetches, reps = [(256, 64)], 2 * 256 * 64 * 3, [4], [2], 1
    else:
        # qwen3_next's GDN out projection, its MLP down and gate-up projections (benchmarks.generate.HF_CONFIG)
        shapes = [(4096, 2048)] if a.quick else [(4096, 2048), (5632, 2048), (2048, 11264)]
        total, iters_list, prefetches, reps = float(1 << 30), [20, 200], [256, 512], a.reps
    rows = []
    for k_dim, n_out in shapes:
        log(f"shape {k_dim} x {n_out}")
        rows.append(bench_shape(k_dim, n_out, total, iters_list, prefetches, reps, interpret))
    log(f"device: {jax.devices()[0].device_kind}")
    for line in table(rows):
        log(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
