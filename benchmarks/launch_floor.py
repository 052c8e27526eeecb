"""What one more kernel costs a decode step: chains of N dependent tiny kernels in one program, timed.

A batch-1 decode step of the floors' models launches 200-350 kernels (`benchmarks.device_loop`'s traces): the
weights' GEMMs and, between them, norms, residual adds, gates, the conv and recurrence kernels and the sampler,
each a few microseconds of work. Inside one program (one command buffer) each still costs the device its launch,
ramp-up and drain, which the next dependent kernel cannot hide. This script measures that cost on the device: a
jitted chain of N kernels, each depending on the last (an `optimization_barrier` between them, so that XLA fuses
none of them together), on a batch-1-sized activation `[4, 2048]` bf16, for:

- `loop`: an elementwise update (the residual add's kind of kernel: an XLA loop fusion);
- `norm`: an RMS norm of the rows (a row reduction: an XLA reduction or Triton fusion);
- `pallas`: a one-program Pallas kernel that reads and writes the tile (the engine's small Pallas kernels' kind).

The per-kernel cost is the slope `(t(N) - t(1)) / (N - 1)` between the chain lengths, so the program's own call
and synchronisation cancel. Each chain's kernels are counted in its compiled HLO (the entry computation's fusions
and custom calls, command buffers walked into), so a chain that XLA fused shorter is reported, not timed as if it
were N kernels.

A step's floor under a given kernel count is then its weights' bytes at the read rate plus its non-GEMM kernels
times this slope (the GEMMs stream the weights; the rest are latency): `benchmarks/RESULTS.md` does that
arithmetic for issue 20's batch-1 rows.

    PYTHONPATH=. python3 -m benchmarks.launch_floor [--kernels 1,64,256,1024] [--json out.json]
    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 PYTHONPATH=. .venv-h200/bin/python -m benchmarks.launch_floor --h200-compile

(`--h200-compile`: no GPU; each chain compiled for the H200 (`benchmarks.h200_aot`) and its kernels counted, exit 1
unless every chain launches its N kernels.)
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks.h200_aot import count_kernels as _count
from benchmarks.kernels import machine_info, time_jax

SHAPE = (4, 2048)  # a batch-1 decode step's activation in its 4-row bucket (qwen3_next's hidden size)


def _loop(x):
    return x * 0.5 + 1.0  # (a fixed point at 2: any chain length stays finite)


def _norm(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 0.5 + 1.0


def _pallas(x, interpret: bool):
    return pl.pallas_call(_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret,
                          name="launch_floor_tile")(x)


def chain(kind: str, n: int, interpret: bool = False):
    """A jitted program of `n` dependent `kind` kernels on one array."""
    step = dict(loop=_loop, norm=_norm, pallas=functools.partial(_pallas, interpret=interpret))[kind]

    @jax.jit
    def f(x):
        for _ in range(n):
            x = jax.lax.optimization_barrier(step(x))
        return x

    return f


def count_kernels(compiled_text: str) -> int:
    """The launches of one call of the compiled program (`h200_aot.count_kernels`: command buffers walked into)."""
    return int(_count(compiled_text)["total"])


def h200_counts(kinds: list[str], lengths: list[int]) -> list[tuple[str, int, int]]:
    """(kind, N, kernels) of each chain compiled for the H200 without a GPU (`benchmarks.h200_aot`)."""
    from benchmarks import h200_aot

    spec = (jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16),)
    with h200_aot.h200() as sharding:
        return [(kind, n, count_kernels(h200_aot.compile_for_h200(chain(kind, n), spec, {}, sharding).as_text()))
                for kind in kinds for n in lengths]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", default="1,64,256,1024", help="chain lengths (the first is the slope's base)")
    ap.add_argument("--kinds", default="loop,norm,pallas")
    ap.add_argument("--json")
    ap.add_argument("--interpret", action="store_true", help="Pallas in interpret mode (a CPU check of the script)")
    ap.add_argument("--h200-compile", action="store_true", help="count each chain's kernels on the H200 compile "
                    "(no GPU, no timing); exit 1 unless each launches N")
    args = ap.parse_args(argv)
    lengths = [int(n) for n in args.kernels.split(",")]
    if args.h200_compile:
        counts = h200_counts(args.kinds.split(","), lengths)
        for kind, n, kernels in counts:
            print(f"{kind:8s} N={n:<6d} {kernels} kernels on the H200 compile", flush=True)
        return 0 if all(kernels == n for _, n, kernels in counts) else 1
    info = machine_info(None)
    print("machine: " + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    x = jax.random.normal(jax.random.PRNGKey(0), SHAPE, jnp.bfloat16)
    rows = []
    print(f"{'kind':8s} {'N':>6s} {'kernels':>8s} {'ms':>9s} {'us/kernel (slope)':>18s}", flush=True)
    for kind in args.kinds.split(","):
        base = None
        for n in lengths:
            f = chain(kind, n, args.interpret)
            kernels = count_kernels(f.lower(x).compile().as_text())
            ms = time_jax(f, (x,), reps=20, inner=10)[0]
            slope = None if base is None else (ms - base[1]) / max(kernels - base[0], 1) * 1e3
            if base is None:
                base = (kernels, ms)
            rows.append(dict(kind=kind, n=n, kernels=kernels, ms=ms, us_per_kernel=slope))
            flag = "" if kernels >= n else f"  (XLA fused the chain to {kernels})"
            print(f"{kind:8s} {n:6d} {kernels:8d} {ms:9.4f} {'' if slope is None else f'{slope:18.2f}'}{flag}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(machine=info, shape=list(SHAPE), rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
