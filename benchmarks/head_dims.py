"""Every Pallas kernel at every power-of-two head dimension from 16 to 256, in bf16 and fp32 (issue 20: "any
power-of-two head dimension from 16 to 256 on the H200; where a configuration cannot fit, pick smaller tiles or
fall back to the reference, never a crash at run time").

    PYTHONPATH=. python3 -m benchmarks.head_dims [--dims 16,32,64,128,256] [--json out.json]    # on the GPU
    PYTHONPATH=. python -m benchmarks.head_dims --interpret --dims 16,32                      # CPU smoke test

Each case runs the kernel through its dispatch function with `impl="pallas"` on small ragged inputs (the cases
`cases()` builds: paged decode and prefill attention over bf16 or fp32 pages, the Gated DeltaNet and simple-GLA
decode and chunked-prefill kernels over an fp32 state, and the one-kernel decode steps of the Gated DeltaNet, Mamba2
and lightning mixers, from their parts or the layers' packed arrays) and the same call with `impl="reference"`, and prints one
line per case: PASS with the relative RMS error against the reference and the kernel's median time, or FAIL with
the error the kernel raised (a shared-memory overflow shows here: what fits is only known on the GPU). Lowering
for the H200 at every case is the CPU test `tests/test_head_dims.py`. Exit status 1 when any case fails.

The cases compile in threads (`--jobs`, 8 by default), a batch at a time, before the batch runs: on an H100 one at a
time took ~1.5 s a case, 4+ minutes for the 170 (session 49).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, paged_attention
from pallas_kernels.conv_update import conv_prefill
from pallas_kernels.paged_attention import paged_attention_reference, paged_prefix_merge_pallas
from pallas_kernels.paged_attention.self_attention import packed_causal_attention
from pallas_kernels.gated_delta_rule import (
    gated_delta_conv_decode_pallas,
    gated_delta_conv_decode_reference,
    gated_delta_decode,
    gated_delta_decode_packed,
)
from pallas_kernels.simple_gla import (chunk_mamba2, chunk_simple_gla, fused_recurrent_simple_gla, lightning_decode,
                                      mamba2_decode, mamba2_gated_norm)

KERNELS = ("paged_decode", "paged_decode_page", "paged_prefill", "paged_prefix_merge", "gdn_decode",
           "gdn_fused_decode", "gdn_packed_decode", "gdn_conv_decode", "gdn_chunk", "gdn_chunk_normed_qk",
           "sgla_decode", "sgla_chunk", "mamba2_chunk", "mamba2_decode", "lightning_decode", "conv_prefill",
           "mamba2_norm", "paged_decode_tail")
TOLERANCE = {jnp.bfloat16: 2e-2, jnp.float32: 2e-3}  # relative RMS error (TF32 dots in fp32 kernels)


def _unit(rng, shape):
    x = rng.normal(size=shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _paged(rng, lengths, new, d, dtype, h=8, kvh=2, bs=16):
    """q for the last `new[b]` positions of each row, pages holding every row's `lengths[b]` tokens, block tables,
    each query's row and position, cu_seqlens."""
    max_blocks = max(-(-n // bs) for n in lengths)
    num_pages = 1 + max_blocks * len(lengths)
    pages = [jnp.asarray(rng.normal(size=(num_pages, bs, kvh, d)), dtype) for _ in range(2)]
    tables = (1 + np.arange(len(lengths) * max_blocks)).reshape(len(lengths), max_blocks).astype(np.int32)
    rows = np.concatenate([[b] * m for b, m in enumerate(new)]).astype(np.int32)
    positions = np.concatenate([np.arange(n - m, n) for n, m in zip(lengths, new)]).astype(np.int32)
    q = jnp.asarray(rng.normal(size=(len(rows), h, d)), dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32)
    return (q, *pages, jnp.asarray(tables), jnp.asarray(rows), jnp.asarray(positions)), cu


def _self_part(args, cu):
    """The queries' attention over their own step's keys (read back from the pages), jnp."""
    q, k_pages, v_pages, tables, rows, positions = args
    bs = k_pages.shape[1]
    pages = tables[rows, positions // bs]
    k, v = k_pages[pages, positions % bs], v_pages[pages, positions % bs]
    return packed_causal_attention(q, k, v, cu, scale=q.shape[-1] ** -0.5, impl="reference")


def cases(d: int, dtype, rng=None) -> dict[str, tuple]:
    """Per kernel: (a function of `impl` and `interpret` that runs it, its arguments). q / k / v in `dtype`, linear
    states fp32 (the engine's), value and key head dims both `d`."""
    rng = rng or np.random.default_rng(d)
    out = {}
    args, cu = _paged(rng, [40, 17], [1, 1], d, dtype)
    out["paged_decode"] = (lambda *a, impl, interpret, cu=cu: paged_attention(
        *a, cu_seqlens=cu, decode=True, impl=impl, interpret=interpret), args)
    # one online-softmax step a page of the block (`block_softmax=False`; a block's pages one step is the default)
    out["paged_decode_page"] = (lambda *a, impl, interpret, cu=cu: paged_attention(
        *a, cu_seqlens=cu, decode=True, impl=impl, interpret=interpret, block_softmax=False), args)
    args, cu = _paged(rng, [40, 17], [30, 17], d, dtype)
    out["paged_prefill"] = (lambda *a, impl, interpret, cu=cu: paged_attention(
        *a, cu_seqlens=cu, decode=False, impl=impl, interpret=interpret), args)
    # the split prefill's prefix part merged into a given self part (its jnp form) in place; the reference: the
    # whole attention (row 0 has 10 cached keys, row 1 none)
    o_self, lse_self = _self_part(args, cu)
    out["paged_prefix_merge"] = (lambda *a, impl, interpret, cu=cu: paged_attention_reference(*a[:6])
                                 if impl == "reference" else paged_prefix_merge_pallas(
                                     *a[:4], cu, *a[5:], interpret=interpret)[0], (*args, o_self, lse_self))
    h, hv, slots = 2, 4, 9
    state = jnp.asarray(rng.normal(size=(slots, hv, d, d)), jnp.float32)
    decode_slots = jnp.arange(1, 9, dtype=jnp.int32)
    q, k = (jnp.asarray(_unit(rng, (8, h, d)), dtype) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(8, hv, d)), dtype)
    g = jnp.asarray(-rng.uniform(0.0, 1.5, (8, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (8, hv)), jnp.float32)
    out["gdn_decode"] = (fused_recurrent_gated_delta_rule, (q, k, v, g, beta, state, decode_slots))
    out["sgla_decode"] = (fused_recurrent_simple_gla, (q, k, v, g, state, decode_slots))
    # the whole decode step after the conv in one kernel (`gated_delta_decode`, fused): raw q / k, gate inputs
    a, b = (jnp.asarray(rng.normal(size=(8, hv)), dtype) for _ in range(2))
    z = jnp.asarray(rng.normal(size=(8, hv, d)), dtype)
    gate_params = (jnp.asarray(rng.uniform(-1.0, 1.0, hv), jnp.float32), jnp.asarray(rng.normal(size=hv), jnp.float32),
                   jnp.asarray(rng.uniform(0.5, 1.5, d), dtype))
    out["gdn_fused_decode"] = (lambda *x, impl, interpret: gated_delta_decode(
        *x, eps=1e-6, impl=impl, interpret=interpret, fused=True), (q * 2, k, v, a, b, z, *gate_params, state,
                                                                     decode_slots))
    # the same from the layer's packed arrays (conv output q | k | v, in_proj output q | k | v | z | b | a)
    flat = lambda x: x.reshape(8, -1)  # noqa: E731
    qkv = jnp.concatenate([flat(q * 2), flat(k), flat(v)], axis=1)
    proj = jnp.concatenate([qkv, flat(z), b, a], axis=1)
    out["gdn_packed_decode"] = (lambda *x, impl, interpret: gated_delta_decode_packed(
        *x, dims=(h, d, hv, d), eps=1e-6, impl=impl, interpret=interpret, fused=True), (qkv, proj, *gate_params,
                                                                                       state, decode_slots))
    # the conv update and the packed decode in one kernel (a program per key head), from the in_proj output
    c_weight = jnp.asarray(rng.normal(size=(qkv.shape[1], 4)) * 0.5, dtype)
    c_state = jnp.asarray(rng.normal(size=(slots, qkv.shape[1], 3)), jnp.float32)
    out["gdn_conv_decode"] = (lambda *x, impl, interpret: (gated_delta_conv_decode_reference(
        *x, dims=(h, d, hv, d), eps=1e-6) if impl == "reference" else gated_delta_conv_decode_pallas(
        *x, dims=(h, d, hv, d), eps=1e-6, interpret=interpret)), (proj, c_state, c_weight, *gate_params, state,
                                                                  decode_slots))
    # Mamba2 (2 groups of 2 heads, P = N = d) and lightning attention (hd = d) decode from their packed arrays
    xbc = jnp.asarray(rng.normal(size=(8, 4 * d + 2 * 2 * d)), jnp.float32)
    m_proj = jnp.asarray(rng.normal(size=(8, 4 * d + xbc.shape[1] + 4)), dtype)
    m_state = jnp.asarray(rng.normal(size=(slots, 4, d, d)), jnp.float32)
    heads4 = lambda lo, hi: jnp.asarray(rng.uniform(lo, hi, 4), jnp.float32)  # noqa: E731
    out["mamba2_decode"] = (lambda *x, impl, interpret: mamba2_decode(
        *x, dims=(4, d, 2, d), dt_offset=4 * d + 8 * d, dt_range=(1e-3, 10.0), out_dtype=dtype, impl=impl,
        interpret=interpret, fused=True), (xbc, m_proj, heads4(-1, 1), heads4(-1, 1), heads4(-1, 1), m_state,
                                           decode_slots))
    l_proj = jnp.asarray(rng.normal(size=(8, 4 * 4 * d)), dtype)
    out["lightning_decode"] = (lambda *x, impl, interpret: lightning_decode(
        *x, num_heads=4, head_dim=d, impl=impl, interpret=interpret, fused=True), (l_proj, heads4(0.05, 1.0), m_state,
                                                                                   decode_slots))
    cu = jnp.asarray([0, 100, 101, 130], jnp.int32)  # a long prompt, a one-token row, a short prompt
    chunk_slots = jnp.asarray([1, 2, 3], jnp.int32)
    q, k = (jnp.asarray(_unit(rng, (130, h, d)), dtype) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(130, hv, d)), dtype)
    g = jnp.asarray(-rng.uniform(0.0, 0.5, (130, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (130, hv)), jnp.float32)
    out["gdn_chunk"] = (chunk_gated_delta_rule, (q, k, v, g, beta, cu, state, chunk_slots))
    # raw q / k normalised by the WY stage, which writes them for the sequential pass (`normed_qk`, off by default)
    raw_q, raw_k = (jnp.asarray(rng.normal(size=(130, h, d)), dtype) for _ in range(2))
    out["gdn_chunk_normed_qk"] = (functools.partial(chunk_gated_delta_rule, qk_l2norm=True, normed_qk=True),
                                  (raw_q, raw_k, v, g, beta, cu, state, chunk_slots))
    out["sgla_chunk"] = (chunk_simple_gla, (q, k, v, g, cu, state, chunk_slots))
    # a Mamba2 mixer's chunked scan reading its conv output in place (4 heads of P = d in 2 groups, N = d), gated
    # by z as the model asks for it
    xbc_c = jnp.asarray(rng.normal(size=(130, 4 * d + 2 * 2 * d)), dtype)
    dt_c = jnp.asarray(rng.uniform(0.01, 0.3, (130, 4)), jnp.float32)
    z_c = jnp.asarray(rng.normal(size=(130, 4 * d)), dtype)
    out["mamba2_chunk"] = (lambda *x, impl, interpret: chunk_mamba2(
        *x, dims=(4, d, 2, d), out_dtype=dtype, impl=impl, interpret=interpret, fused=True),
        (xbc_c, dt_c, -dt_c, heads4(-1, 1), cu, m_state[:4], chunk_slots, z_c))
    # a prefill step's conv with SiLU, q | k | v (the Gated DeltaNet layer's heads at d) read in place from the
    # packed in_proj output; 128 tokens in rows of 100, 1 and 27 (the kernel's 16-token programs: window tiles inside
    # the first row, gathered ones at the row starts)
    cu_128 = jnp.asarray([0, 100, 101, 128], jnp.int32)
    seq_128 = jnp.asarray(np.repeat([0, 1, 2], [100, 1, 27]), jnp.int32)
    p_proj = jnp.asarray(rng.normal(size=(128, proj.shape[1])), dtype)
    out["conv_prefill"] = (lambda *x, impl, interpret: conv_prefill(
        *x, activation="silu", splits=(h * d, h * d, hv * d), impl=impl, interpret=interpret),
        (p_proj, c_state, c_weight, cu_128, chunk_slots, seq_128))
    # a Mamba2 prefill's output after the scan: the D skip, the gate z and the norm over groups of 2 heads
    o_n = jnp.asarray(rng.normal(size=(130, 4, d)), dtype)
    w_n = jnp.asarray(1 + 0.1 * rng.normal(size=(4 * d,)), dtype)
    out["mamba2_norm"] = (lambda *x, impl, interpret: mamba2_gated_norm(
        *x, group_size=2 * d, eps=1e-5, out_dtype=dtype, impl=impl, interpret=interpret),
        (o_n, xbc_c, z_c, heads4(-1, 1), w_n))
    # paged decode masking only a split's edge blocks (`tail_mask`, off by default): a 300-token row (19 pages, 5
    # blocks) over 2 splits, so that blocks between the edges run unmasked
    args, cu = _paged(rng, [300, 17], [1, 1], d, dtype)
    out["paged_decode_tail"] = (lambda *a, impl, interpret, cu=cu: paged_attention(
        *a, cu_seqlens=cu, decode=True, impl=impl, interpret=interpret, tail_mask=True, num_splits=2), args)
    return out


def _rel(got, want) -> float:
    leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    err = num = 0.0
    for g, w in leaves:
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        err, num = err + float(np.sum((g - w) ** 2)), num + float(np.sum(w**2))
    return float(np.sqrt(err / max(num, 1e-30)))


def compile_case(name: str, d: int, dtype, built: dict, *, interpret: bool) -> tuple[dict, tuple | None]:
    """The case's row and its `(args, reference, kernel)` compiled from `built` (`cases(d, dtype)`), or the row FAIL
    with the error that compiling raised and None."""
    fn, args = built[name]
    row = dict(kernel=name, head_dim=d, dtype=jnp.dtype(dtype).name)
    try:
        want = jax.jit(functools.partial(fn, impl="reference", interpret=False)).lower(*args).compile()
        kernel = jax.jit(functools.partial(fn, impl="pallas", interpret=interpret)).lower(*args).compile()
    except Exception as e:  # noqa: BLE001  a kernel that cannot compile here is the finding
        return row | _failure(e), None
    return row, (args, want, kernel)


def _failure(e: Exception) -> dict:
    return dict(status="FAIL", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def time_case(row: dict, compiled: tuple | None, *, iters: int) -> dict:
    """Runs a compiled case (`compile_case`) against its reference: PASS / FAIL, relative error, median ms."""
    if compiled is None:
        return row
    args, want, kernel = compiled
    try:
        expected = want(*args)
        got = jax.block_until_ready(kernel(*args))
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            jax.block_until_ready(kernel(*args))
            times.append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001  a kernel that cannot run here is the finding
        return row | _failure(e)
    rel = _rel(got, expected)
    ok = bool(np.isfinite(rel)) and rel <= TOLERANCE[jnp.dtype(row["dtype"]).type]
    return row | dict(status="PASS" if ok else "FAIL", rel_err=rel, ms=1e3 * float(np.median(times)) if times else None)


def run_cases(names, dims, dtypes, *, interpret: bool, iters: int, jobs: int, report=None) -> list[dict]:
    """Every case, in batches of `2 * jobs`: a batch compiled in `jobs` threads (XLA and Triton compile outside the
    GIL), then its cases run one at a time on the device with no compile beside them; `report(row)` as each ends.
    The inputs are built once a (head dim, dtype)."""
    built = {(d, dtype): cases(d, dtype) for d in dims for dtype in dtypes}
    todo = [(name, d, dtype) for name in names for d, dtype in built]
    compile_one = lambda t: compile_case(*t, built[t[1:]], interpret=interpret)  # noqa: E731
    rows = []
    jobs = max(1, jobs)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for lo in range(0, len(todo), 2 * jobs):
            for row, compiled in list(pool.map(compile_one, todo[lo:lo + 2 * jobs])):  # the whole batch first
                rows.append(time_case(row, compiled, iters=iters))
                if report:
                    report(rows[-1])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", default="16,32,64,128,256")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--iters", type=int, default=10, help="timed calls per case (median); 0 with --interpret")
    ap.add_argument("--interpret", action="store_true", help="the Pallas interpreter (CPU smoke test)")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="threads compiling the cases before any runs (default: min(8, CPUs)); 1: one at a time")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dims = [int(x) for x in args.dims.split(",")]
    dtypes = [jnp.dtype(x).type for x in args.dtypes.split(",")]
    names = args.kernels.split(",")
    iters = 0 if args.interpret else args.iters
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; {len(names) * len(dims) * len(dtypes)} cases",
          flush=True)
    print(f"{'kernel':<14} {'d':>4} {'dtype':<9} {'status':<6} {'rel err':>9} {'ms':>8}  error")
    t0 = time.perf_counter()

    def report(r):
        err = f"{r['rel_err']:.2e}" if "rel_err" in r else "-"
        ms = f"{r['ms']:.3f}" if r.get("ms") is not None else "-"
        print(f"{r['kernel']:<14} {r['head_dim']:>4} {r['dtype']:<9} {r['status']:<6} {err:>9} {ms:>8}  "
              f"{r.get('error', '')}", flush=True)

    rows = run_cases(names, dims, dtypes, interpret=args.interpret, iters=iters, jobs=args.jobs, report=report)
    print(f"{len(rows)} cases in {time.perf_counter() - t0:.0f} s ({args.jobs} compile threads)")
    failed = [r for r in rows if r["status"] != "PASS"]
    print(f"{len(rows) - len(failed)} of {len(rows)} cases pass")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, results=rows), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
