"""Does the call of a compiled program let other Python threads run while it launches? (issues 16, 20)

    PYTHONPATH=. python -m benchmarks.gil_probe [--kernels 400] [--seconds 1.0] [--json out.json]

On the H200 the call of an engine step program holds the host for 1-3 ms at batch 1, mostly inside
`cuGraphLaunch` and XLA's CUDA-graph update (benchmarks/RESULTS.md, "Session 15"): longer than the device
step, so batch-1 decode is host-bound. Moving the call to a second thread only pays if the call releases
Python's GIL while it is in the driver. This measures it: a program of about `--kernels` small kernels (a
chain of matmuls that do not fuse) is called back to back on a worker thread (a `block_until_ready` every 8
calls bounds the queue) while the main thread counts iterations of a pure-Python loop for `--seconds`;
the count against the same loop with no worker says how much of the main thread the calls take. The
worker's share of time inside the call is printed too: if the calls held the GIL for all of it, the main
thread would lose about that share.
"""

from __future__ import annotations

import argparse
import json
import threading
import time


def spin(seconds: float) -> int:
    """Iterations of a pure-Python loop in `seconds`."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", type=int, default=400, help="matmuls in the program (about one kernel each)")
    parser.add_argument("--size", type=int, default=128, help="matrix size of each matmul")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--json")
    a = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    ws = [jax.random.normal(jax.random.key(i), (a.size, a.size), jnp.float32) / np.sqrt(a.size)
          for i in range(8)]

    def chain(x, ws):
        for i in range(a.kernels):
            x = jnp.tanh(x @ ws[i % len(ws)]) if i % 2 else x @ ws[i % len(ws)] + 1.0
        return x

    x = jnp.ones((a.size, a.size), jnp.float32)
    fn = jax.jit(chain).lower(x, ws).compile()
    jax.block_until_ready(fn(x, ws))

    stop = threading.Event()
    stats = {"calls": 0, "in_call": 0.0, "total": 0.0}

    def worker():
        t_start, y = time.perf_counter(), x
        while not stop.is_set():
            t0 = time.perf_counter()
            y = fn(x, ws)
            stats["in_call"] += time.perf_counter() - t0
            stats["calls"] += 1
            if stats["calls"] % 8 == 0:
                jax.block_until_ready(y)
        jax.block_until_ready(y)
        stats["total"] = time.perf_counter() - t_start

    alone = spin(a.seconds)
    t = threading.Thread(target=worker)
    t.start()
    time.sleep(0.05)
    shared = spin(a.seconds)
    stop.set()
    t.join()
    alone_again = spin(a.seconds)
    res = {
        "device": str(jax.devices()[0].device_kind), "kernels": a.kernels,
        "call_ms": stats["in_call"] / stats["calls"] * 1e3, "worker_share_in_call": stats["in_call"] / stats["total"],
        "main_loop_alone": (alone + alone_again) / 2, "main_loop_beside_calls": shared,
    }
    res["main_thread_kept"] = res["main_loop_beside_calls"] / res["main_loop_alone"]
    print(f"{res['device']}: {a.kernels} matmuls, call {res['call_ms']:.3f} ms, worker in calls "
          f"{res['worker_share_in_call']:.0%} of its time; main-thread loop beside the calls "
          f"{res['main_thread_kept']:.0%} of its speed alone (near 100%: the call releases the GIL; near "
          f"{1 - res['worker_share_in_call']:.0%}: it holds it)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
