"""Does dispatching a jitted step wait for the device? (issues 16 and 21: the engine loop's "prepare + dispatch"
phase took about as long as the device step on the H200, so the host's own work was not hidden behind it.)

    PYTHONPATH=. python -m benchmarks.dispatch_probe

A program that takes ~`--ms` ms on the device (chained matmuls) with a large state argument, called the way the
engine calls its step: compiled ahead of time (`jit(...).lower(...).compile()`) or through `jit`, with the
state donated or not, and a small NumPy argument (the step's metadata) or a device array. For each way, the
host time of the call itself (median over `--iters` back-to-back calls, each call's inputs the previous call's
outputs, as in the engine) against the device time of one call: a call that returns in microseconds is
asynchronous; one that takes about the device time waits for the previous call.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def time_calls(fn, state, x, rest: tuple, iters: int) -> tuple[float, float]:
    """(median host ms of one call, device ms per call) over `iters` chained calls `state, x = fn(state, x, *rest)`."""
    import jax

    state, x = fn(state, x, *rest)
    jax.block_until_ready((state, x))
    calls = []
    t_start = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        state, x = fn(state, x, *rest)
        calls.append(time.perf_counter() - t0)
    jax.block_until_ready((state, x))
    return float(np.median(calls)) * 1e3, (time.perf_counter() - t_start) / iters * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ms", type=float, default=5.0, help="device time of one call to aim at")
    parser.add_argument("--state-mb", type=int, default=2048, help="size of the state argument")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--leaves", default="4,64,400", help="argument counts to try (the engine's step has ~350: "
                        "every layer's weights, the state's arrays, the sampling tables)")
    a = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    n = 4096
    w = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16) / 64
    x0 = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)

    def make(reps):
        def step(state, x, meta, w):
            for _ in range(reps):
                x = jnp.tanh(x @ w)
            state = state.at[0].add(x[0, 0].astype(jnp.float32) + meta.sum().astype(jnp.float32))
            return state, x
        return step

    # calibrate the device time: matmuls of 4096^3 at ~0.3 ms each
    probe = jax.jit(make(4))
    state = jnp.zeros((a.state_mb * 2**18,), jnp.float32)
    meta = np.arange(1024, dtype=np.int32)
    jax.block_until_ready(probe(state, x0, meta, w))
    t0 = time.perf_counter()
    jax.block_until_ready(probe(state, x0, meta, w))
    reps = max(1, round(4 * a.ms / ((time.perf_counter() - t0) * 1e3)))
    step = make(reps)
    print(f"{jax.devices()[0].device_kind}: {reps} matmuls per call, state {a.state_mb} MB")
    print(f"{'how called':52s} {'call ms':>8s} {'device ms / call':>17s}")
    for how in ("jit", "compiled"):
        for donate in (False, True):
            for meta_kind in ("numpy", "device"):
                fn = jax.jit(step, donate_argnums=(0,) if donate else ())
                s = jnp.zeros((a.state_mb * 2**18,), jnp.float32)
                m = meta if meta_kind == "numpy" else jnp.asarray(meta)
                if how == "compiled":
                    fn = fn.lower(s, x0, m, w).compile()
                call, device = time_calls(fn, s, x0, (m, w), a.iters)
                name = f"{how}, state {'donated' if donate else 'not donated'}, meta {meta_kind}"
                print(f"{name:52s} {call:8.3f} {device:17.3f}", flush=True)
    # the number of arguments: `n` small weight arrays (each read), state donated, meta from NumPy
    print(f"{'arguments':>10s} {'call ms':>8s} {'device ms / call':>17s}")
    for leaves in (int(x) for x in a.leaves.split(",")):
        ws = [jnp.full((256, 256), i, jnp.bfloat16) / 1e4 for i in range(leaves)]

        def many(state, x, meta, w, ws):
            for _ in range(reps):
                x = jnp.tanh(x @ w)
            extra = sum(v[0, 0].astype(jnp.float32) for v in ws)
            return state.at[0].add(x[0, 0].astype(jnp.float32) + meta.sum() + extra), x

        fn = jax.jit(many, donate_argnums=(0,))
        call, device = time_calls(fn, jnp.zeros((a.state_mb * 2**18,), jnp.float32), x0, (meta, w, ws), a.iters)
        print(f"{leaves + 4:10d} {call:8.3f} {device:17.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
