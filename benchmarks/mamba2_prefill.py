"""A Mamba2 mixer's chunked prefill scan at the `benchmarks.floors` NemotronH layer (Hm 64, P 64, G 8, N 128; `--dims`
for others), from its conv output to the gated norm's input, each way it can run on the GPU:

- `parts`: `chunk_mamba2_in_parts` around the simple-GLA chunk kernel (XLA writes SiLU'd B / C, `v = x dt`, the
  D skip and the gate as arrays of their own; the model's default), in its fused form (the default) and its split
  form (a sequential state pass, then every chunk's output in parallel), each with B, C and v in fp32 and in bf16
  (`scan_dtype`; the model's default, `simple_gla.MAMBA2_SCAN_DTYPE` "auto", takes the conv output's dtype: bf16);
- `in_place T`: `chunk_mamba2_pallas` at tuning T (the kernels read x, B, C and z where they sit; keywords not in T
  take `simple_gla.MAMBA2_PREFILL_TUNING`, then the kernel's defaults).

    PYTHONPATH=. python3 -m benchmarks.mamba2_prefill [--tokens 8192] [--dims 64,64,8,128] [--tunings '{...};{...}']
        [--parts-tunings '{"fused_output": false, "out_num_warps": 8};...'] [--json F] [--kernels N]

`--kernels N` also prints each way's N biggest device kernels (a profiler trace of five calls): how a way's time
splits between its sequential state pass, its output kernel and XLA's parts.

Each way is first checked against the fp32 reference (`chunk_mamba2_in_parts` around the jnp chunked scan at
HIGHEST precision); a way over the tolerance is reported FAILED and not timed. Timed: median (p20-p80) ms of one
call, the state threaded through the calls. `benchmarks.h200_aot spills` gives the same kernels' registers and
spill bytes from ptxas without a GPU. One row of `--tokens` tokens, then a serving-shaped step (63 one-token rows
and a 313-token prompt) at the best tuning.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels import errors, machine_info, time_jax
from pallas_kernels.simple_gla import chunk_mamba2, chunk_mamba2_in_parts, chunk_simple_gla_reference

H, P, G, N = 64, 64, 8, 128
TOL = 2e-2  # relative error of the bf16-rounded output against the fp32 reference


def inputs(lengths, seed=0, num_slots=80):
    rng = np.random.default_rng(seed)
    t = int(sum(lengths))
    cm = H * P + 2 * G * N
    xbc = jnp.asarray(rng.normal(size=(t, cm)), jnp.bfloat16)
    dt = jnp.asarray(rng.uniform(0.001, 0.1, size=(t, H)), jnp.float32)
    a = jnp.asarray(rng.uniform(1, 16, size=(H,)), jnp.float32)
    g = dt * -a
    d_skip = jnp.asarray(rng.normal(size=(H,)), jnp.float32)
    z = jnp.asarray(rng.normal(size=(t, 2 * H * P + 2 * G * N + H)), jnp.bfloat16)  # the in_proj output
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    slots = jnp.asarray(1 + rng.permutation(num_slots - 1)[:len(lengths)].astype(np.int32))
    state = jnp.asarray(rng.normal(size=(num_slots, H, N, P)) * 0.1, jnp.float32)
    return (xbc, dt, g, d_skip, cu, state, slots, z)


def reference(args):
    xbc, dt, g, d_skip, cu, state, slots, z = jax.tree.map(
        lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, args)
    with jax.default_matmul_precision("highest"):
        chunk = functools.partial(chunk_simple_gla_reference, scale=1.0, chunk_size=64)
        return jax.jit(functools.partial(chunk_mamba2_in_parts, dims=(H, P, G, N), out_dtype=jnp.float32,
                                         chunk=chunk))(xbc, dt, g, d_skip, cu, state, slots, z)


INTERPRET = False  # `--interpret`: the Pallas interpreter (a CPU smoke test of the script)


def way(fused: bool, tuning: dict):
    return jax.jit(functools.partial(chunk_mamba2, dims=(H, P, G, N), out_dtype=jnp.bfloat16, impl="pallas",
                                     fused=fused, interpret=INTERPRET, **tuning), donate_argnums=(5,))


def run_case(label, lengths, ways, rows):
    args = inputs(lengths)
    want_y, want_s = reference(args)
    live = np.asarray(args[6])
    for name, fused, tuning in ways:
        fn = way(fused, tuning)
        try:
            y, s = fn(*args[:5], jnp.array(args[5]), *args[6:])
        except Exception as e:  # noqa: BLE001  a tuning that does not compile is a result
            print(f"{label:14s} {name:38s} FAILED to run: {type(e).__name__}: {str(e)[:160]}", flush=True)
            rows.append(dict(case=label, way=name, tuning=tuning, error=str(e)[:300]))
            continue
        e_y = errors(np.asarray(y, np.float32), want_y)
        e_s = errors(np.asarray(s)[live], np.asarray(want_s)[live])
        ok = max(e_y[1], e_s[1]) <= TOL
        row = dict(case=label, way=name, tuning=tuning, rel_err_y=e_y[1], rel_err_state=e_s[1], passed=ok)
        if ok:
            carry = lambda out, a: (*a[:5], out[1], *a[6:])  # noqa: E731
            row["ms"] = time_jax(fn, (*args[:5], jnp.array(args[5]), *args[6:]), reps=20, inner=3, carry=carry)
            if KERNELS:
                row["kernels"] = kernel_breakdown(fn, args)
        rows.append(row)
        ms = row.get("ms")
        print(f"{label:14s} {name:38s} err y {e_y[1]:.2e} state {e_s[1]:.2e} "
              + (f"{ms[0]:8.3f} ms ({ms[1]:.3f}-{ms[2]:.3f})" if ms else "FAILED the check"), flush=True)
        for kernel, kms, launches in row.get("kernels", []):
            print(f"{'':16s}{kms:8.3f} ms  x{launches:3.0f}  {kernel[:100]}", flush=True)
    return rows


KERNELS = 0  # `--kernels N`: also each way's N biggest device kernels, from a profiler trace


def kernel_breakdown(fn, args, calls: int = 5) -> list[tuple[str, float, float]]:
    """The device kernels of `calls` calls of `fn` under the JAX profiler, summed by name, per call: (name, ms,
    launches), the `KERNELS` biggest. Which kernel of a way (the sequential state pass, the output kernel, XLA's
    parts) takes its time."""
    import tempfile

    from benchmarks.device_loop import kernel_sums

    state = jnp.array(args[5])
    jax.block_until_ready(fn(*args[:5], state, *args[6:]))  # warm, outside the trace
    with tempfile.TemporaryDirectory() as folder:
        state = jnp.array(args[5])
        with jax.profiler.trace(folder, create_perfetto_trace=True):
            for _ in range(calls):
                _, state = fn(*args[:5], state, *args[6:])
            jax.block_until_ready(state)
        return [tuple(t) for t in kernel_sums(folder, calls, KERNELS)["top"]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dims", default="64,64,8,128",
                    help="Mamba2 heads, head dim, groups, state size (Nemotron-H-56B: 256,64,8,256)")
    ap.add_argument("--tunings", default='{"fused_output": true};{"fused_output": false};'
                    '{"fused_output": false, "out_num_warps": 4};{"fused_output": false, "out_block_v": 32}',
                    help="';'-separated JSON dicts of the in-place kernels' keyword arguments")
    ap.add_argument("--parts-tunings", default='{"fused_output": true, "scan_dtype": "float32"};'
                    '{"fused_output": false, "scan_dtype": "float32"};{"fused_output": true, "scan_dtype": "bfloat16"};'
                    '{"fused_output": false, "scan_dtype": "bfloat16"}',
                    help="';'-separated JSON dicts of the parts' chunk kernel's keyword arguments (`fused_output`: "
                    "its form; `out_block_v`, `out_num_warps`: the split form's output kernel; `scan_dtype`: "
                    "`chunk_mamba2`'s, the dtype of B, C and v)")
    ap.add_argument("--json")
    ap.add_argument("--interpret", action="store_true",
                    help="the Pallas interpreter, tiny heads (a CPU smoke test; small --tokens)")
    ap.add_argument("--commit", default=os.environ.get("JHYBRID_COMMIT"))
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also print each way's N biggest device kernels (JAX profiler trace of 5 calls)")
    a = ap.parse_args()
    global INTERPRET, H, P, G, N, KERNELS
    INTERPRET, KERNELS = a.interpret, a.kernels
    H, P, G, N = (int(x) for x in a.dims.split(","))
    if a.interpret:  # tiny heads: the interpreter runs every program in Python
        H, P, G, N = 4, 16, 2, 16
    tunings = [json.loads(t) for t in a.tunings.split(";")]
    ways = [(f"parts {json.dumps(t)}", False, t) for t in (json.loads(x) for x in a.parts_tunings.split(";"))]
    ways += [(f"in_place {json.dumps(t)}", True, t) for t in tunings]
    print(json.dumps(machine_info(a.commit)), flush=True)
    rows = run_case(f"T{a.tokens}", [a.tokens], ways, [])
    timed = [r for r in rows if r.get("ms") and r["way"].startswith("in_place")]
    if timed:
        best = min(timed, key=lambda r: r["ms"][0])
        ragged = [1] * 3 + [45] if a.interpret else [1] * 63 + [313]
        best_way = (best["way"], True, best["tuning"])
        parts = [w for w in ways if not w[1]]
        run_case(f"ragged {len(ragged) - 1}+{ragged[-1]}", ragged, [*parts, best_way], rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(machine_info=machine_info(a.commit), rows=rows), f, indent=1)
    return 0 if all(r.get("passed") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
