"""Simple GLA (scalar-decay recurrence) kernel benchmark: lightning attention (MiniMax-Text-01 / M1) and Mamba2
(NemotronH) layer shapes, the Pallas kernels against the jnp references under XLA.

    PYTHONPATH=. python -m benchmarks.simple_gla_kernels [--json out.json] [--quick] [--budget-s 200]
    PYTHONPATH=. python -m benchmarks.simple_gla_kernels --interpret --quick     # CPU smoke test, tiny shapes

Per (model shape, case) it first checks every kernel configuration against the fp32 reference (inputs upcast,
dots at HIGHEST precision) on the device: the relative RMS error of the output and of the written state
slots must stay under the tolerance of the input dtype, or the configuration is reported FAILED (and the
script exits 1: correctness gates speed). It then times each passing configuration (warm-up, median and
p20/p80 of N samples, state donated and threaded through the calls) and the reference as the model runs it
(`impl="reference"`, XLA's default precision). Cases: decode at batch 1, 64 and 256 (one token per row, state
slots permuted); chunked prefill of one 8192-token sequence, and a serving-shaped ragged step (63 one-token
rows + one 313-token prompt). Sweeps: every power-of-two value block and the warp counts for decode; for
prefill, both forms (split state pass + parallel output, or fused) over chunk sizes and value blocks, then
warps / stages of the best, the split form's output block and the one-token rows' block. The sweeps share
`--budget-s` seconds (30% decode, 70% prefill, evenly among the cases); once a case has used its share, its
remaining configurations are skipped (listed as such in the JSON), so the run stays under about 4 minutes.

Prints a machine line and a fixed-width table; `--json` writes {machine_info, results, sweeps}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.models.lightning import lightning_slopes
from pallas_kernels.simple_gla import (
    chunk_simple_gla_pallas,
    chunk_simple_gla_reference,
    fused_recurrent_simple_gla_pallas,
    fused_recurrent_simple_gla_reference,
)

# name, model, H (key heads / Mamba2 groups), HV (value heads), K (key dim / ssm_state_size), V (value dim /
# mamba_head_dim), input dtype (what the model passes: bf16 q/k/v for lightning, fp32 for Mamba2), decay kind
SHAPES = [
    ("minimax", "MiniMax-Text-01/M1 lightning (64 heads, d128)", 64, 64, 128, 128, jnp.bfloat16, "lightning"),
    ("nemotron3_nano", "Nemotron-3-Nano-30B Mamba2 (64 heads, 8 groups, N128, P64)", 8, 64, 128, 64, jnp.float32,
     "mamba2"),
    ("nemotron_h_56b", "Nemotron-H-56B Mamba2 (256 heads, 8 groups, N256, P64)", 8, 256, 256, 64, jnp.float32,
     "mamba2"),
    ("small", "small (8 heads, d64)", 8, 8, 64, 64, jnp.bfloat16, "lightning"),
]
TINY = [("tiny", "tiny (interpret smoke test)", 2, 4, 16, 32, jnp.float32, "mamba2")]
TOL = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float32): 1e-2}  # relative RMS vs the fp32 reference (TF32)

RESULTS, SWEEPS = [], []
FAILED = []


class Clock:
    """A case's sweep budget: past it, the remaining configurations are skipped."""

    def __init__(self, budget_s: float):
        self.t0, self.budget_s = time.perf_counter(), budget_s

    def over(self) -> bool:
        return time.perf_counter() - self.t0 > self.budget_s


def time_jax(fn, args, carry, reps, inner, warmup=2):
    """Median/p20/p80 ms per call: `inner` async calls per sample, synchronised at the end; `carry(out, args)`
    threads the (donated) state back in."""
    out = None
    for _ in range(warmup):
        out = fn(*args)
        args = carry(out, args)
    jax.block_until_ready(out)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
            args = carry(out, args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner * 1e3)
    return np.percentile(samples, [50, 20, 80]).tolist()


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def inputs(shape, num_tokens, num_slots, seed):
    """q, k [T, H, K], v [T, HV, V] (the model's dtype), g [T, HV] fp32 (lightning: the slopes of layer 0 of
    80, constant in time; Mamba2: dt A with dt in [1e-3, 0.1], A in [-16, -1]; v = dt x), state fp32."""
    _, _, h, hv, dk, dv, dtype, kind = shape
    key = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(key[0], (num_tokens, h, dk)) / np.sqrt(dk)
    k = jax.random.normal(key[1], (num_tokens, h, dk)) / np.sqrt(dk)
    v = jax.random.normal(key[2], (num_tokens, hv, dv))
    if kind == "lightning":
        g = jnp.broadcast_to(-jnp.asarray(lightning_slopes(hv, 0, 80)), (num_tokens, hv))
    else:
        dt = jnp.exp(jax.random.uniform(key[3], (num_tokens, hv), minval=np.log(1e-3), maxval=np.log(1e-1)))
        g = dt * -jax.random.uniform(key[4], (hv,), minval=1.0, maxval=16.0)
        v = v * dt[..., None]
    state = jax.random.normal(key[5], (num_slots, hv, dk, dv), jnp.float32) * 0.1
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g.astype(jnp.float32), state


def fp32_reference(ref_fn, args, **kw):
    """The reference on fp32 copies of the inputs with HIGHEST-precision dots: the ground truth."""
    f32 = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    with jax.default_matmul_precision("highest"):
        return jax.jit(functools.partial(ref_fn, **kw))(*f32)


def sweep(op, label, configs, make, args, carry, want, out_rows, live_slots, tol, reps, inner, clock, quick):
    """Checks each config (first = the default) against `want` (output rows `out_rows`, state slots `live_slots`)
    and times those that pass; returns (best cfg, its times, its errors) or None."""
    best = None
    for n, cfg in enumerate(configs):
        if n and (quick or clock.over()):
            SWEEPS.append(dict(op=op, case=label, cfg=cfg, skipped="budget" if not quick else "quick"))
            continue
        try:
            fn = make(cfg)
            o, s = fn(*args())
            e_o = rel_err(np.asarray(o, np.float32)[out_rows], np.asarray(want[0])[out_rows])
            e_s = rel_err(np.asarray(s)[live_slots], np.asarray(want[1])[live_slots])
            ok = max(e_o, e_s) <= tol
            t = time_jax(fn, args(), carry, reps, inner) if ok else None
        except Exception as e:  # a config that does not compile (shared memory, registers) is skipped
            print(f"  {op} {label} {cfg}: ERROR {type(e).__name__}: {str(e)[:200]}", flush=True)
            SWEEPS.append(dict(op=op, case=label, cfg=cfg, error=str(e)[:300]))
            continue
        print(f"  {op} {label} {cfg}: out err {e_o:.2e} state err {e_s:.2e} "
              f"{'%.4f ms' % t[0] if ok else 'FAILED CHECK (tol %.0e)' % tol}", flush=True)
        SWEEPS.append(dict(op=op, case=label, cfg=cfg, ms=t, out_rel_err=e_o, state_rel_err=e_s, passed=ok))
        if not ok:
            FAILED.append(f"{op} {label} {cfg}: out {e_o:.2e} state {e_s:.2e} > {tol:.0e}")
        elif best is None or t[0] < best[1][0]:
            best = (cfg, t, (e_o, e_s))
    return best


def record(op, shape, case, best, ref_ms, tol, extra):
    row = dict(op=op, model=shape[1], shape=f"H{shape[2]} HV{shape[3]} K{shape[4]} V{shape[5]} "
               f"{jnp.dtype(shape[6]).name}", case=case, tol=tol, ref_ms=ref_ms, passed=best is not None)
    if best is not None:
        cfg, t, (e_o, e_s) = best
        row.update(cfg=cfg, ms=t, out_rel_err=e_o, state_rel_err=e_s, speedup=ref_ms[0] / t[0] if ref_ms else None,
                   **extra(t[0]))
    RESULTS.append(row)


# ---------------------------------------------------------------- decode


def decode_configs(dv):
    """Every power-of-two value block with 1-8 warps, the default first."""
    blocks = [b for b in (32, 64, 16, 128) if b <= dv]
    configs = [dict(block_v=b, num_warps=w) for b in blocks for w in (4, 2, 8, 1)]
    return configs


def bench_decode(shape, batch, a, budget_s):
    _, _, h, hv, dk, dv, dtype, _ = shape
    num_slots = batch + 1
    q, k, v, g, state = inputs(shape, batch, num_slots, seed=batch)
    slots = jnp.asarray(np.random.default_rng(batch).permutation(np.arange(1, num_slots)).astype(np.int32))
    chk_slots = slots.at[batch // 2].set(0) if batch > 1 else slots  # a padded row on the null slot (unchecked output)
    live = np.asarray(chk_slots)[np.asarray(chk_slots) != 0]
    live_rows = np.flatnonzero(np.asarray(chk_slots) != 0)
    want = fp32_reference(fused_recurrent_simple_gla_reference, (q, k, v, g, state, chk_slots))
    clock = Clock(budget_s)
    tol = TOL[jnp.dtype(dtype)]
    carry = lambda out, args: (*args[:4], out[1], args[5])  # noqa: E731

    def make(cfg):
        f = functools.partial(fused_recurrent_simple_gla_pallas, interpret=a.interpret, **cfg)
        return jax.jit(f, donate_argnums=(4,))

    fresh = lambda: (q, k, v, g, state + 0.0, chk_slots)  # noqa: E731
    best = sweep("decode", f"B{batch}", decode_configs(dv), make, fresh, carry, want, live_rows, live, tol,
                 a.reps, a.inner, clock, a.quick)
    ref = jax.jit(functools.partial(fused_recurrent_simple_gla_reference), donate_argnums=(4,))
    ref_ms = time_jax(ref, fresh(), carry, a.reps, a.inner)
    state_bytes = 2 * batch * hv * dk * dv * 4  # the rows' state tiles read and written, fp32
    record("decode", shape, f"B{batch}", best, ref_ms, tol,
           lambda ms: dict(note=f"state {state_bytes / 1e9:.3f} GB -> {state_bytes / ms / 1e9:.2f} TB/s"))


# ---------------------------------------------------------------- chunked prefill


def chunk_stage1(dv):
    """Both forms over chunk sizes and value blocks, the likelier ones first (a budget may cut the list)."""
    blocks = [b for b in (32, 64, 16, 128) if b <= dv]
    return [dict(fused_output=f, chunk_size=c, block_v=b) for c in (64, 128, 32) for f in (False, True) for b in blocks]


def bench_chunk(shape, lengths, label, a, budget_s):
    _, _, h, hv, dk, dv, dtype, _ = shape
    batch = len(lengths)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    num_tokens = int(cu[-1])
    num_slots = batch + 1
    q, k, v, g, state = inputs(shape, num_tokens, num_slots, seed=num_tokens)
    rng = np.random.default_rng(num_tokens)
    slots = jnp.asarray(rng.permutation(np.arange(1, num_slots)).astype(np.int32))
    live = np.asarray(slots)
    want = fp32_reference(chunk_simple_gla_reference, (q, k, v, g, cu, state, slots))
    clock = Clock(budget_s)
    tol = TOL[jnp.dtype(dtype)]
    carry = lambda out, args: (*args[:5], out[1], args[6])  # noqa: E731
    fresh = lambda: (q, k, v, g, cu, state + 0.0, slots)  # noqa: E731

    def make(cfg):
        f = functools.partial(chunk_simple_gla_pallas, interpret=a.interpret, **cfg)
        return jax.jit(f, donate_argnums=(5,))

    run = functools.partial(sweep, "chunk", label, make=make, args=fresh, carry=carry, want=want, out_rows=np.arange(num_tokens),
                            live_slots=live, tol=tol, reps=a.reps, inner=a.inner, clock=clock, quick=a.quick)
    best = run(chunk_stage1(dv))
    if best is not None and not a.quick and not clock.over():  # warps and stages of the best form / block, then the output kernel
        base = best[0]
        more = [dict(base, num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (1, 2, 3) if (w, s) != (4, 2)]
        if not base["fused_output"]:
            more += [dict(base, out_block_v=b, out_num_warps=w) for b in (16, 32, 64, 128) if b <= dv for w in (4, 8)]
        if 1 in lengths:
            more += [dict(base, single_block_v=b) for b in (16, 64, 128) if b <= dv]
        if jnp.dtype(dtype) == jnp.float32:
            more.append(dict(base, precision="tf32x3"))
        second = run(more)
        if second is not None and second[1][0] < best[1][0]:
            best = second
    ref = jax.jit(functools.partial(chunk_simple_gla_reference), donate_argnums=(5,))
    ref_ms = time_jax(ref, fresh(), carry, max(3, a.reps // 2), 1)
    record("chunk", shape, label, best, ref_ms, tol,
           lambda ms: dict(note=f"{num_tokens / ms / 1e3:.2f} M tokens/s"))


# ---------------------------------------------------------------- main


def machine_info(commit):
    dev = jax.devices()[0]
    return dict(device=dev.device_kind, backend=jax.default_backend(), jax=jax.__version__, commit=commit,
                date=time.strftime("%Y-%m-%d"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="the default configuration only, no sweeps")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpreter, tiny shapes (CPU smoke test)")
    parser.add_argument("--budget-s", type=float, default=120.0,
                        help="seconds of configuration sweeps in all (split among the cases); the checks, the "
                             "default configurations and the references come on top")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--inner", type=int, default=None)
    parser.add_argument("--only", default="decode,chunk")
    parser.add_argument("--commit", default=os.environ.get("JHYBRID_COMMIT"))
    a = parser.parse_args()
    a.reps = a.reps or (2 if a.interpret else 10)
    a.inner = a.inner or (1 if a.interpret else 5)
    info = machine_info(a.commit)
    print("machine: " + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    if jax.default_backend() != "gpu" and not a.interpret:
        sys.exit("no GPU: run on an H200, or pass --interpret --quick for the CPU smoke test")
    shapes = TINY if a.interpret else SHAPES
    batches = (1, 4) if a.interpret else (1, 64, 256)
    chunk_cases = ([("T40", [40]), ("3x1+13", [1, 1, 13, 1])] if a.interpret else
                   [("T8192", [8192]), ("63x1+313", [1] * 32 + [313] + [1] * 31)])
    start = time.perf_counter()
    # the sweep budget: 30% to the decode cases, 70% to the prefill cases, evenly within each
    decode_s = 0.3 * a.budget_s / (len(shapes) * len(batches))
    chunk_s = 0.7 * a.budget_s / (len(shapes) * len(chunk_cases))
    for shape in shapes:
        try:
            if "decode" in a.only:
                for batch in batches:
                    bench_decode(shape, batch, a, decode_s)
            if "chunk" in a.only:
                for label, lengths in chunk_cases:
                    bench_chunk(shape, lengths, label, a, chunk_s)
        except Exception as e:  # one shape's failure (memory, ...) does not hide the others
            import traceback

            traceback.print_exc()
            FAILED.append(f"{shape[0]}: {type(e).__name__}: {e}")
    print()
    print("machine: " + " ".join(f"{k}={v}" for k, v in info.items()) + f"  ({time.perf_counter() - start:.0f} s)")
    hdr = (f"{'op':<7} {'model':<15} {'shape':<26} {'case':<9} {'kernel ms':>10} {'p20-p80':>15} {'ref ms':>9} "
           f"{'speedup':>8} {'out err':>8} {'st err':>8} {'ok':<4} best config / note")
    print(hdr)
    print("-" * len(hdr))
    names = {s[1]: s[0] for s in shapes}
    for r in RESULTS:
        if not r["passed"]:
            print(f"{r['op']:<7} {names[r['model']]:<15} {r['shape']:<26} {r['case']:<9} {'-':>10} {'':>15} "
                  f"{r['ref_ms'][0]:>9.4f} {'-':>8} {'':>8} {'':>8} FAIL")
            continue
        t = r["ms"]
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(f"{r['op']:<7} {names[r['model']]:<15} {r['shape']:<26} {r['case']:<9} {t[0]:>10.4f} "
              f"{f'{t[1]:.3f}-{t[2]:.3f}':>15} {r['ref_ms'][0]:>9.4f} {sp:>8} {r['out_rel_err']:>8.1e} "
              f"{r['state_rel_err']:>8.1e} PASS {r['cfg']} {r['note']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(machine_info=info, results=RESULTS, sweeps=SWEEPS, failed=FAILED), f, indent=1,
                      default=str)
    if FAILED:
        print("\nFAILED CHECKS:\n  " + "\n  ".join(FAILED))
        sys.exit(1)


if __name__ == "__main__":
    main()
