"""The prefill step's elementwise kernels at one 8k-token layer, XLA against jhybrid's Pallas kernels at several
tunings: a Mamba2 mixer's post-scan work (`mamba2_gated_norm`: D skip, gate, grouped RMS norm; NemotronH's layer)
and the short conv of both linear mixers (`conv_prefill`: Qwen3-Next's q | k | v with SiLU, NemotronH's x | B | C with
the bias), each read in place from the packed in_proj output as the models do.

    PYTHONPATH=. python3 -m benchmarks.prefill_fusions [--tokens 8192] [--json F]      # on the GPU
    PYTHONPATH=. python -m benchmarks.prefill_fusions --tiny                           # CPU smoke test (interpreted)

Each Pallas tuning is first checked against the jnp reference (relative RMS error; over 2e-2 is FAILED and not
timed). Timed: the best of five rounds of ten calls queued back to back (`floors._best_seconds`); the XLA row is the
jitted reference, which is what the model's layer compiles to when the kernel is off. GB/s counts each kernel's
least bytes: every input read once and the output written once.
"""

from __future__ import annotations

import argparse
import functools
import json

import numpy as np

NORM_TUNINGS = ({"block_t": 8, "num_warps": 4}, {"block_t": 16, "num_warps": 4}, {"block_t": 16, "num_warps": 8},
                {"block_t": 32, "num_warps": 8}, {"block_t": 4, "num_warps": 4})
CONV_TUNINGS = ({"block_t": 64, "block_c": 128, "num_warps": 8}, {"block_t": 32, "block_c": 128, "num_warps": 4},
                {"block_t": 32, "block_c": 256, "num_warps": 8}, {"block_t": 128, "block_c": 64, "num_warps": 8},
                {"block_t": 16, "block_c": 256, "num_warps": 4}, {"block_t": 64, "block_c": 64, "num_warps": 4},
                # 16 elements a thread: 72 registers on the H200 compile where 32 a thread take 241-242 (ptxas)
                {"block_t": 16, "block_c": 128, "num_warps": 4}, {"block_t": 32, "block_c": 128, "num_warps": 8},
                {"block_t": 32, "block_c": 64, "num_warps": 4}, {"block_t": 16, "block_c": 64, "num_warps": 4},
                {"block_t": 16, "block_c": 128, "num_warps": 4, "contiguous": True},
                {"block_t": 32, "block_c": 128, "num_warps": 8, "contiguous": True},
                {"block_t": 32, "block_c": 128, "num_warps": 4, "contiguous": True})


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def _row(rows, label, tuning, seconds, nbytes, err=None):
    r = dict(case=label, tuning=tuning, ms=None if seconds is None else seconds * 1e3, err=err,
             gbps=None if seconds is None else nbytes / seconds / 1e9)
    rows.append(r)
    failed = err is not None and not err <= 2e-2
    ms = "FAILED" if failed else "not timed" if seconds is None else \
        f"{seconds * 1e3:8.3f} ms {nbytes / seconds / 1e9:7.0f} GB/s"
    print(f"{label:28s} {json.dumps(tuning) if tuning else 'xla':52s} {ms}"
          + ("" if err is None else f"  err {err:.1e}"), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--tiny", action="store_true", help="small shapes, the Pallas interpreter (CPU)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from benchmarks.floors import _best_seconds
    from pallas_kernels.conv_update import conv_prefill_reference
    from pallas_kernels.conv_update.prefill import conv_prefill_pallas
    from pallas_kernels.simple_gla.mamba2_norm import mamba2_gated_norm_pallas
    from pallas_kernels.simple_gla.reference import mamba2_gated_norm_reference

    tiny = a.tiny
    t = 64 if tiny else a.tokens
    time_it = (lambda f, *x: None) if tiny else (lambda f, *x: _best_seconds(lambda *y: jax.tree.leaves(f(*y))[0], *x))
    rng = np.random.default_rng(0)
    bf = jnp.bfloat16
    rows: list[dict] = []
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; {t} tokens", flush=True)

    # NemotronH's Mamba2 post-scan work: 64 heads of 64, 8 norm groups of 512; x in the conv output, z in the in_proj's
    h, p, groups, conv_dim, proj_dim = (4, 16, 2, 128, 200) if tiny else (64, 64, 8, 6144, 10304)
    inner = h * p
    o = jnp.asarray(rng.normal(size=(t, h, p)), bf)
    xbc = jnp.asarray(rng.normal(size=(t, conv_dim)), bf)
    z = jnp.asarray(rng.normal(size=(t, proj_dim)), bf)
    d = jnp.asarray(rng.normal(size=(h,)), bf)
    w = jnp.asarray(1 + 0.1 * rng.normal(size=(inner,)), bf)
    common = dict(group_size=inner // groups, eps=1e-5, out_dtype=bf)
    nbytes = 4 * t * inner * 2
    xla = jax.jit(functools.partial(mamba2_gated_norm_reference, **common))
    want = xla(o, xbc, z, d, w)
    _row(rows, "mamba2_norm", None, time_it(xla, o, xbc, z, d, w), nbytes)
    for tuning in NORM_TUNINGS:
        f = jax.jit(functools.partial(mamba2_gated_norm_pallas, **common, **tuning, interpret=tiny))
        err = _rel(f(o, xbc, z, d, w), want)
        _row(rows, "mamba2_norm", tuning, time_it(f, o, xbc, z, d, w) if err <= 2e-2 else None, nbytes, err)

    # the conv of both mixers, from the packed in_proj output (one prompt from an empty slot)
    cu, slots, seq = jnp.asarray([0, t], jnp.int32), jnp.asarray([1], jnp.int32), jnp.zeros((t,), jnp.int32)
    shapes = {"qwen3_next": (8192, 12352, 0, (2048, 2048, 4096), "silu", False),
              "nemotron_h": (6144, 10304, 4096, None, None, True)}
    if tiny:
        shapes = {"qwen3_next": (128, 200, 0, (32, 32, 64), "silu", False), "nemotron_h": (96, 200, 64, None, None, True)}
    for name, (channels, width, offset, splits, act, has_bias) in shapes.items():
        x = jnp.asarray(rng.normal(size=(t, width)), bf)
        state = jnp.asarray(rng.normal(size=(2, channels, 3)), jnp.float32)
        weight = jnp.asarray(rng.normal(size=(channels, 4)) * 0.5, bf)
        bias = jnp.asarray(rng.normal(size=(channels,)), bf) if has_bias else None
        form = dict(offset=offset, bias=bias, activation=act, splits=splits, out_dtype=bf)

        def ref(x, state, weight, form=form):
            outs, new = conv_prefill_reference(x, state, weight, cu, slots, seq, **form)
            return outs, new

        xla = jax.jit(ref)
        want = xla(x, state, weight)
        nbytes = 2 * t * channels * 2
        _row(rows, f"conv {name}", None, time_it(xla, x, state, weight), nbytes)
        for tuning in CONV_TUNINGS:
            tn = dict(tuning, block_t=min(tuning["block_t"], t), block_c=min(tuning["block_c"], 32 if tiny else 512))
            f = jax.jit(lambda x, state, weight, tn=tn, form=form: conv_prefill_pallas(
                x, state, weight, cu, slots, seq, **form, **tn, interpret=tiny))
            try:
                err = _rel(jnp.concatenate(f(x, state, weight)[0], axis=1), jnp.concatenate(want[0], axis=1))
            except Exception as e:  # a tuning that does not fit (shared memory, tiling) is a row, not a crash
                print(f"conv {name} {tn}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                _row(rows, f"conv {name}", tn, None, nbytes, float("inf"))
                continue
            _row(rows, f"conv {name}", tn, time_it(f, x, state, weight) if err <= 2e-2 else None, nbytes, err)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=jax.devices()[0].device_kind, tokens=t, rows=rows), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
