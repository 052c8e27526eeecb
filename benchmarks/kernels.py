"""Kernel benchmark: each Pallas kernel checked against its reference on the GPU, then timed against
baselines measured in the same run (fla's Triton kernels, jax's Pallas paged attention, the jnp reference
under XLA, and a device copy for the bandwidth ceiling).

    PYTHONPATH=. python -m benchmarks.kernels [--json out.json] [--quick]

Prints a machine line and a fixed-width table; `--json` writes {machine_info, results, sweeps}.
Correctness gates speed: a row whose error check fails reports no speedup.
fla (fla-core / flash-linear-attention 0.6.0) and torch are optional: their rows are skipped without them.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gated_delta_rule import (
    chunk_gated_delta_rule_pallas,
    chunk_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule_pallas,
    fused_recurrent_gated_delta_rule_reference,
)
from pallas_kernels.paged_attention import (
    paged_attention,
    paged_attention_decode_pallas,
    paged_attention_prefill_pallas,
    paged_attention_reference,
)
from pallas_kernels.paged_attention.self_attention import packed_causal_attention

try:
    import torch
except ImportError:
    torch = None


# ---------------------------------------------------------------- timing and checks


def time_jax(fn, args, reps=30, inner=5, warmup=3, carry=None):
    """Median/p20/p80 ms per call: `inner` async calls per timed sample, synchronised at the end.

    `carry(out, args) -> args` threads outputs back as inputs (donated state)."""
    for _ in range(warmup):
        out = fn(*args)
        if carry:
            args = carry(out, args)
    jax.block_until_ready(out)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
            if carry:
                args = carry(out, args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner * 1e3)
    return np.percentile(samples, [50, 20, 80]).tolist()


def time_torch(fn):
    from triton.testing import do_bench

    return list(do_bench(fn, warmup=50, rep=300, quantiles=[0.5, 0.2, 0.8]))


def errors(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if np.isnan(got).any():
        return float("inf"), float("inf")
    rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    return float(np.abs(got - want).max()), rel


def machine_info(commit=None):
    """The device, versions and tree (`commit`, default `benchmarks.provenance.git_commit()`) of a run."""
    from benchmarks.provenance import git_commit

    dev = jax.devices()[0]
    info = dict(gpu=dev.device_kind, backend=jax.default_backend(), jax=jax.__version__, commit=commit or git_commit(),
                date=time.strftime("%Y-%m-%d"))
    if torch is not None:
        info["torch"] = torch.__version__
    try:
        import fla

        info["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        info["fla"] = None
    return info


RESULTS, SWEEPS = [], []


def record(op, shape, ours, base_name, base, err, rel, tol, extra="", **fields):
    """A result row; `fields` are figures an aim is judged on beside the times (the paged decode's `copy_share`)."""
    ok = rel <= tol
    row = dict(op=op, shape=shape, ours_ms=ours, baseline=base_name, baseline_ms=base, max_err=err,
               rel_err=rel, tol=tol, passed=ok, note=extra, **fields)
    row["speedup"] = (base[0] / ours[0]) if (ok and base and ours) else None
    RESULTS.append(row)
    print(f"  -> {op} [{base_name}] ours {ours and ours[0]:.4} ms base {base and base[0]} ms "
          f"err {err:.3e} rel {rel:.3e} {'PASS' if ok else 'FAIL'} {extra}", flush=True)


def best_config(name, fn_for_cfg, configs, args, carry=None, reps=20):
    best = None
    for cfg in configs:
        try:
            t = time_jax(fn_for_cfg(cfg), args(), reps=reps, carry=carry)
        except Exception as e:  # a config that does not compile (shared memory, registers) is skipped
            print(f"  sweep {name} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            SWEEPS.append(dict(op=name, cfg=cfg, ms=None, error=str(e)[:300]))
            continue
        print(f"  sweep {name} {cfg}: {t[0]:.4f} ms", flush=True)
        SWEEPS.append(dict(op=name, cfg=cfg, ms=t))
        if best is None or t[0] < best[1][0]:
            best = (cfg, t)
    return best


# ---------------------------------------------------------------- GDN decode


def _defaults(fn, names: tuple[str, ...]) -> tuple:
    """The default values of `fn`'s keyword arguments `names`, read from its signature: the configuration that
    callers who name none get, so that `--quick` times what users run."""
    params = inspect.signature(fn).parameters
    return tuple(params[k].default for k in names)


# the GDN decode kernel's default tile (values a program, warps): session 2's H200 sweep picked it
DEFAULT_GDN_DECODE = _defaults(fused_recurrent_gated_delta_rule_pallas, ("block_v", "num_warps"))


def gdn_decode_inputs(B, H, HV, K, V):
    """One GDN decode step's random inputs: (q, k, v, g, beta, state of B + 1 slots, the rows' slots 1..B in a random
    order); q and k unit vectors in bf16, the decay in (-0.5, 0]."""
    key = jax.random.split(jax.random.PRNGKey(0), 6)
    nrm = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = nrm(jax.random.normal(key[0], (B, H, K))).astype(jnp.bfloat16)
    k = nrm(jax.random.normal(key[1], (B, H, K))).astype(jnp.bfloat16)
    v = jax.random.normal(key[2], (B, HV, V)).astype(jnp.bfloat16)
    g = -jax.random.uniform(key[3], (B, HV)) * 0.5
    beta = jax.random.uniform(key[4], (B, HV))
    state = jax.random.normal(key[5], (B + 1, HV, K, V), jnp.float32) * 0.1
    slots = jnp.asarray(np.random.default_rng(0).permutation(np.arange(1, B + 1)).astype(np.int32))
    return q, k, v, g, beta, state, slots


def bench_gdn_decode(quick):
    B, H, HV, K, V = 256, 16, 16, 128, 128
    S = B + 1
    q, k, v, g, beta, state0, slots = gdn_decode_inputs(B, H, HV, K, V)
    shape = f"B{B} H{H} HV{HV} K{K} V{V} bf16 in, fp32 state"

    def make(cfg):
        bv, nw = cfg
        f = functools.partial(fused_recurrent_gated_delta_rule_pallas, block_v=bv, num_warps=nw)
        return jax.jit(f, donate_argnums=(5,))

    carry = lambda out, a: (*a[:5], out[1], a[6])  # noqa: E731
    # (fla's kernel gives each program a [K, 8] tile and one warp: the small tiles first)
    configs = [DEFAULT_GDN_DECODE] if quick else list(dict.fromkeys([
        DEFAULT_GDN_DECODE, (8, 1), (16, 1), (16, 2), (32, 1), (32, 2), (64, 2), (64, 4), (128, 4), (128, 8)]))
    fresh = lambda: (q, k, v, g, beta, state0 + 0.0, slots)  # noqa: E731
    cfg, ours = best_config("gdn_decode", make, configs, fresh, carry=carry)

    # correctness of the configuration timed (a few rows on the null slot too)
    slots_chk = slots.at[jnp.array([3, 100])].set(0)
    want_o, want_s = jax.jit(fused_recurrent_gated_delta_rule_reference)(q, k, v, g, beta, state0, slots_chk)
    got_o, got_s = make(cfg)(q, k, v, g, beta, state0 + 0.0, slots_chk)
    live = np.asarray(slots_chk) != 0
    e_o = errors(np.asarray(got_o, np.float32)[live], np.asarray(want_o, np.float32)[live])
    idx = np.asarray(slots_chk)[live]
    e_s = errors(np.asarray(got_s)[idx], np.asarray(want_s)[idx])
    print(f"gdn decode check {cfg}: out {e_o}, state {e_s}", flush=True)
    ref_fn = jax.jit(fused_recurrent_gated_delta_rule_reference, donate_argnums=(5,))
    t_ref = time_jax(ref_fn, fresh(), reps=10, carry=carry)
    ok = max(e_o[1], e_s[1])
    record("gdn_decode", shape, ours, "jnp reference (XLA)", t_ref, max(e_o[0], e_s[0]), ok, 1e-2, f"cfg={cfg}")
    bytes_moved = 2 * B * HV * K * V * 4
    print(f"  gdn decode state traffic {bytes_moved / 1e9:.3f} GB -> {bytes_moved / ours[0] / 1e9:.2f} TB/s")

    if torch is not None:
        try:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fr

            tt = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda()  # noqa: E731
            tq, tk, tv = (tt(x).to(torch.bfloat16)[:, None] for x in (q, k, v))  # [B, 1, H, K]
            tg, tb = tt(g)[:, None], tt(beta)[:, None]
            th0 = tt(state0[1:])  # [B, HV, K, V]
            o_f, s_f = fla_fr(tq, tk, tv, tg, beta=tb, initial_state=th0, output_final_state=True)
            want_o2, want_s2 = fused_recurrent_gated_delta_rule_reference(
                q, k, v, g, beta, state0, jnp.arange(1, S, dtype=jnp.int32))
            e_f = errors(o_f[:, 0].float().cpu().numpy(), np.asarray(want_o2, np.float32))
            t_fla = time_torch(lambda: fla_fr(tq, tk, tv, tg, beta=tb, initial_state=th0, output_final_state=True))
            print(f"  fla fused_recurrent err {e_f}", flush=True)
            record("gdn_decode", shape, ours, "fla fused_recurrent", t_fla, max(e_o[0], e_s[0]), ok, 1e-2,
                   f"cfg={cfg}; fla rel err {e_f[1]:.2e}")
        except Exception as e:
            print(f"  fla fused_recurrent baseline failed: {type(e).__name__}: {e}", flush=True)


# ---------------------------------------------------------------- GDN chunked prefill


def gdn_chunk_inputs(lengths, H, HV, K, V, dtype, seed):
    key = jax.random.split(jax.random.PRNGKey(seed), 6)
    T = int(sum(lengths))
    nrm = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = nrm(jax.random.normal(key[0], (T, H, K))).astype(dtype)
    k = nrm(jax.random.normal(key[1], (T, H, K))).astype(dtype)
    v = jax.random.normal(key[2], (T, HV, V)).astype(dtype)
    g = jax.nn.log_sigmoid(jax.random.normal(key[3], (T, HV)) + 3.0)  # mostly close to 0, as in models
    beta = jax.nn.sigmoid(jax.random.normal(key[4], (T, HV)))
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    B = len(lengths)
    state = jax.random.normal(key[5], (B + 2, HV, K, V), jnp.float32) * 0.1
    slots = jnp.arange(1, B + 1, dtype=jnp.int32)
    return q, k, v, g, beta, cu, state, slots


def check_chunk(label, args, **kw):
    want_o, want_s = jax.jit(chunk_gated_delta_rule_reference)(*args)
    got_o, got_s = jax.jit(chunk_fn(kw))(*args)
    slots = np.asarray(args[-1])
    live = slots[slots != 0]
    e_o = errors(np.asarray(got_o, np.float32), np.asarray(want_o, np.float32))
    e_s = errors(np.asarray(got_s)[live], np.asarray(want_s)[live])
    print(f"{label} check: out {e_o}, state {e_s}", flush=True)
    return max(e_o[0], e_s[0]), max(e_o[1], e_s[1])


def bench_gdn_chunk(quick):
    T, H, HV, K, V = 32768, 16, 16, 128, 128
    shape = f"B1 T{T} H{H} HV{HV} K{K} V{V} bf16"
    # ragged correctness: short, one-chunk, many-chunk rows, grouped value heads, a null-slot row
    rq = gdn_chunk_inputs([1, 64, 1000, 3001, 17], 4, 8, 128, 128, jnp.bfloat16, 1)
    rq = (*rq[:-1], rq[-1].at[1].set(0))
    e_r = check_chunk("gdn chunk ragged", rq)
    args = gdn_chunk_inputs([T], H, HV, K, V, jnp.bfloat16, 2)
    err, rel = check_chunk("gdn chunk B1 T32768", args)
    e_s = check_chunk("gdn chunk B1 T32768 split output", args, fused_output=False)
    rel = max(rel, e_r[1], e_s[1])

    def make(cfg):
        bv, nw, ns, fused = cfg
        f = functools.partial(chunk_gated_delta_rule_pallas, block_v=bv, num_warps=nw, num_stages=ns,
                              fused_output=fused)
        return jax.jit(f)

    configs = [(16, 4, 3, True)] if quick else [(16, 4, 3, True), (16, 4, 3, False), (32, 4, 3, True)]
    cfg, ours = best_config("gdn_chunk", make, configs, lambda: args, reps=10)
    t_ref = time_jax(jax.jit(chunk_gated_delta_rule_reference), args, reps=5, inner=1)
    record("gdn_chunk", shape, ours, "jnp reference (XLA)", t_ref, err, rel, 2e-2, f"cfg={cfg}")
    fla = fla_chunk_time(args)
    if fla:
        record("gdn_chunk", shape, ours, "fla chunk (Triton)", fla[0], err, rel, 2e-2,
               f"cfg={cfg}; fla rel err {fla[1][1]:.2e}")
    if not quick:
        chunk_stage_times(args)


AB_ONLY: set[str] = set()  # `--ab`: the CHUNK_AB variants to run (empty: all)
CHUNK_AB = {  # name: chunk_gated_delta_rule_pallas options (the default first)
    "default": {},
    "split output": dict(fused_output=False),
    "no scores": dict(scores=False),
    "scan (session 2 form)": dict(gcum=False, wy_precision="input"),
    "wy input": dict(wy_precision="input"),
    "bv32": dict(block_v=32),
    "s4": dict(num_stages=4),
    # longer chunks: half the sequential pass's steps (512 -> 256 at T32k), each with twice the work. In the H200
    # compile (`h200_aot`), 3 stages at 128 ask for 341 KB of shared memory (227 KB fit) and the WY kernel spills
    # 5.6 KB a thread at 4 warps (556 B at 8)
    "c128": dict(chunk_size=128, num_stages=2, wy_num_warps=8),
    "c128_split": dict(chunk_size=128, fused_output=False, num_stages=2, wy_num_warps=8),
    "c32": dict(chunk_size=32),
    # the model's form (`qk_l2norm`: q and k normalised over K first; the inputs here are unit vectors already, so
    # the reference holds): where the normalising happens. Not candidates for the row's best (more work)
    "l2_pass": dict(qk_l2norm=True, normed_qk=False),  # each kernel as it loads them
    "l2_wy": dict(qk_l2norm=True, normed_qk=True),  # the WY stage, writing normalised copies for the pass
    "l2_wy8": dict(qk_l2norm=True, normed_qk=True, wy_num_warps=8),
    "l2_xla": dict(xla_l2norm=True),  # an XLA fusion before the kernels (JHYBRID_GDN_KERNEL_QK_NORM=0's form)
}


def chunk_fn(kw):
    """`chunk_gated_delta_rule_pallas` with a `CHUNK_AB` entry's options (`xla_l2norm`: q and k normalised by XLA
    first)."""
    from jhybrid.models.layers import l2_normalize  # the model's own (gated_deltanet.KERNEL_QK_NORM off)

    kw = dict(kw)
    xla_l2norm = kw.pop("xla_l2norm", False)
    fn = functools.partial(chunk_gated_delta_rule_pallas, **kw)
    if not xla_l2norm:
        return fn
    return lambda q, k, *rest: fn(l2_normalize(q).astype(q.dtype), l2_normalize(k).astype(k.dtype), *rest)


def chunk_stage_times(args):
    """Each stage alone (ms): the WY stage's variants, the sequential passes, the output kernel."""
    from pallas_kernels.gated_delta_rule import chunk as ck

    q, k, v, g, beta, cu, state, slots = args
    c, scale = 64, q.shape[-1] ** -0.5
    qp, kp, vp, gp, bp, cup, lay = ck._prepare(q, k, v, g, beta, cu, slots, c, False)
    rows = {}

    def timed(name, fn, fargs):
        try:
            rows[name] = time_jax(jax.jit(fn), fargs, reps=10)[0]
            print(f"  stage {name}: {rows[name]:.4f} ms", flush=True)
        except Exception as e:  # a variant that does not compile is reported, not fatal
            print(f"  stage {name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)

    wy = functools.partial(ck.wy_stage, layout=lay, chunk_size=c, num_warps=4, interpret=False)
    timed("wy input", functools.partial(wy, wy_precision="input"), (kp, vp, gp, bp))
    timed("wy bf16", functools.partial(wy, wy_precision="bf16"), (kp, vp, gp, bp))
    timed("wy bf16 gcum", functools.partial(wy, wy_precision="bf16", gcum=True), (kp, vp, gp, bp))
    timed("wy bf16 gcum scores", lambda *a: wy(*a[1:], wy_precision="bf16", gcum=True, q=a[0], scale=scale),
          (qp, kp, vp, gp, bp))
    w, u, gc, sc = wy(kp, vp, gp, bp, wy_precision="bf16", gcum=True, q=qp, scale=scale)
    for bv, nw, ns in ((16, 4, 3), (16, 4, 2), (32, 4, 3), (16, 2, 3)):
        tune = dict(layout=lay, chunk_size=c, block_v=bv, num_warps=nw, num_stages=ns, interpret=False)
        tag = f"bv{bv} w{nw} s{ns}"
        timed(f"fused scan pass {tag}", functools.partial(ck.fused_state_stage, scale=scale, **tune),
              (qp, kp, vp, gp, w, u, cup, state, slots))
        timed(f"fused gcum pass {tag}", functools.partial(ck.fused_state_stage, scale=scale, gcum=True, **tune),
              (qp, kp, vp, gc, w, u, cup, state, slots))
        timed(f"fused gcum scores pass {tag}", lambda *a, t=tune: ck.fused_state_stage(
              *a[:-1], scale=scale, gcum=True, scores=a[-1], **t), (qp, kp, vp, gc, w, u, cup, state, slots, sc))
        timed(f"state gcum pass {tag}", functools.partial(ck.state_stage, gcum=True, **tune),
              (kp, gc, w, u, cup, state, slots))
    h, v_new, _ = ck.state_stage(kp, gc, w, u, cup, state, slots, lay, chunk_size=c, block_v=16, num_warps=4,
                                 num_stages=3, interpret=False, gcum=True)
    for obv in (128, 64):
        timed(f"output gcum bv{obv}", functools.partial(ck.output_stage, layout=lay, chunk_size=c, scale=scale,
              block_v=obv, num_warps=4, interpret=False, gcum=True), (qp, kp, gc, h, v_new))
    SWEEPS.append(dict(op="gdn_chunk_ab_stages", stages=rows))


def fla_chunk_time(args):
    """fla's chunk_gated_delta_rule on the same inputs: (ms triple, rel err vs the reference) or None."""
    if torch is None:
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError as e:
        print(f"  fla unavailable: {e}", flush=True)
        return None
    tt = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda()[None]  # noqa: E731
    q, k, v, g, beta = args[:5]
    tq, tk, tv = (tt(x).to(torch.bfloat16) for x in (q, k, v))
    tg, tb = tt(g), tt(beta).to(torch.bfloat16)
    th0 = tt(args[6][1])
    call = lambda: fla_chunk(tq, tk, tv, tg, tb, initial_state=th0, output_final_state=True)  # noqa: E731
    o_f, _ = call()
    want_o, _ = jax.jit(chunk_gated_delta_rule_reference)(*args)
    e_f = errors(o_f[0].float().cpu().numpy(), np.asarray(want_o, np.float32))
    return time_torch(call), e_f


def bench_gdn_chunk_ab(quick):
    """A/B of the chunked kernel's variants (each checked first), fla timed in the same run."""
    T, H, HV, K, V = 32768, 16, 16, 128, 128
    shape = f"B1 T{T} H{H} HV{HV} K{K} V{V} bf16"
    args = gdn_chunk_inputs([T], H, HV, K, V, jnp.bfloat16, 2)
    rq = gdn_chunk_inputs([1, 64, 1000, 3001, 17], 4, 8, 128, 128, jnp.bfloat16, 1)  # ragged, GQA 2, a null slot
    rq = (*rq[:-1], rq[-1].at[1].set(0))
    fla = fla_chunk_time(args)
    if fla:
        print(f"  gdn_chunk {shape} fla: {fla[0][0]:.4f} ms (p20 {fla[0][1]:.4f}, p80 {fla[0][2]:.4f}); rel err "
              f"{fla[1][1]:.2e}", flush=True)
    best = None
    for name, kw in CHUNK_AB.items():
        if AB_ONLY and name not in AB_ONLY:
            continue
        try:
            e_r = check_chunk(f"gdn chunk ragged {name}", rq, **kw)
            err = check_chunk(f"gdn chunk {name}", args, **kw)
            t = time_jax(jax.jit(chunk_fn(kw)), args, reps=10)
        except Exception as e:
            print(f"  gdn_chunk {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        ok = max(err[1], e_r[1]) < 2e-2
        SWEEPS.append(dict(op="gdn_chunk_ab", cfg=name, ms=t, err=err, ragged_err=e_r, ok=ok))
        vs = f"; {fla[0][0] / t[0]:.2f}x fla" if fla else ""
        print(f"  gdn_chunk {shape} {name}: {t[0]:.4f} ms (p20 {t[1]:.4f}, p80 {t[2]:.4f}); rel err "
              f"{err[1]:.2e} (ragged {e_r[1]:.2e}){vs}{'' if ok else ' CHECK FAILED'}", flush=True)
        if ok and not name.startswith("l2_") and (best is None or t[0] < best[1][0]):
            best = (name, t, err)
    if best:
        name, t, err = best
        if fla:
            record("gdn_chunk", shape, t, "fla chunk (Triton)", fla[0], err[0], err[1], 2e-2,
                   f"best A/B variant: {name} {CHUNK_AB[name]}; fla rel err {fla[1][1]:.2e}")
        else:
            record("gdn_chunk", shape, t, "none", None, err[0], err[1], 2e-2, f"best A/B variant: {name}")
    if not quick:
        chunk_stage_times(args)


# ---------------------------------------------------------------- paged decode attention


def _paged_read_kernel(tables_ref, k_ref, v_ref, o_ref, *, pages_per_block, pages_per_split, per_page):
    """The decode kernel's reads alone: program (t, h, s) walks split s of row t's pages as `_decode_kernel`
    does (a gathered `[NP * BS, D]` tile, or page by page) and sums them; no dot, no softmax."""
    from jax.experimental import pallas as pl

    t, s = pl.program_id(0), pl.program_id(2)
    head_dim = k_ref.shape[-1]

    def body(it, acc):
        first = s * pages_per_split + it * pages_per_block
        if per_page:
            for i in range(pages_per_block):
                page = tables_ref[t, first + i]
                acc = acc + k_ref[page].astype(jnp.float32) + v_ref[page].astype(jnp.float32)
            return acc
        pages = tables_ref[t, pl.ds(first, pages_per_block)]
        k = k_ref[pages].reshape(-1, head_dim).astype(jnp.float32)
        v = v_ref[pages].reshape(-1, head_dim).astype(jnp.float32)
        return acc + (k + v).reshape(pages_per_block, -1, head_dim).sum(0)

    acc = jnp.zeros((k_ref.shape[1], head_dim), jnp.float32)
    o_ref[...] = jax.lax.fori_loop(0, pages_per_split // pages_per_block, body, acc).sum(0)


def paged_read(k_pages, v_pages, tables, *, pages_per_block, num_splits, num_warps, num_stages, per_page):
    """`_paged_read_kernel` over every row's pages (`tables [B, M]`, M a multiple of NS * NP): per row, head and
    split, the `[D]` sum of its keys and values."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    num_pages, block_size, num_kv_heads, head_dim = k_pages.shape
    batch, max_pages = tables.shape
    pages_spec = pl.BlockSpec((num_pages, block_size, None, head_dim), lambda t, h, s: (0, 0, h, 0))
    kernel = functools.partial(_paged_read_kernel, pages_per_block=pages_per_block,
                               pages_per_split=max_pages // num_splits, per_page=per_page)
    return pl.pallas_call(
        kernel, grid=(batch, num_kv_heads, num_splits),
        in_specs=[pl.no_block_spec, pages_spec, pages_spec],
        out_specs=pl.BlockSpec((None, None, None, head_dim), lambda t, h, s: (t, h, s, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, num_splits, head_dim), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="paged_read_probe")(tables, k_pages, v_pages)


def paged_read_fn(cfg):
    """`paged_read` jitted at a decode configuration `(pages_per_block, num_splits, num_warps, num_stages,
    per_page[, block_softmax])` (the reads do not depend on the softmax's steps)."""
    npb, ns, nw, st, pp, *_ = cfg
    return jax.jit(functools.partial(paged_read, pages_per_block=npb, num_splits=ns, num_warps=nw, num_stages=st,
                                     per_page=pp))


def paged_read_rates(k_pages, v_pages, tables, cfg, kv_bytes):
    """TB/s of the decode kernel's reads without its math, at the decode kernel's best `cfg`, over the benchmark's
    scattered pages and over the same pages in order (each row's pages contiguous); and of a jnp sum of the whole
    cache (one contiguous read, no pages) and a torch sum of as many bytes. Each read sum is checked against
    numpy's first."""
    rates = {}
    fn = paged_read_fn(cfg)
    ordered = jnp.arange(1, 1 + tables.size, dtype=jnp.int32).reshape(tables.shape)
    for name, tab in (("scattered pages", tables), ("pages in order", ordered)):
        got = np.asarray(fn(k_pages, v_pages, tab)).sum(axis=(2,))  # [B, KVH, D]
        row = np.asarray(tab)[0]
        want = (np.asarray(k_pages[row], np.float32) + np.asarray(v_pages[row], np.float32)).sum(axis=(0, 1))
        if not np.allclose(got[0], want, rtol=1e-3, atol=1e-1):
            print(f"  paged read probe ({name}) FAILED its check", flush=True)
            continue
        ms = time_jax(fn, (k_pages, v_pages, tab), reps=20)[0]
        rates[name] = kv_bytes / (ms * 1e-3) / 1e12
    whole = jax.jit(lambda k, v: k.astype(jnp.float32).sum() + v.astype(jnp.float32).sum())
    ms = time_jax(whole, (k_pages, v_pages), reps=20)[0]
    rates["jnp sum of the whole cache"] = (k_pages.nbytes + v_pages.nbytes) / (ms * 1e-3) / 1e12
    if torch is not None:  # the same bytes through torch's reduction kernel: a plain read that is not XLA's
        tx = torch.empty(k_pages.size + v_pages.size, dtype=torch.bfloat16, device="cuda").normal_()
        ms = time_torch(lambda: tx.sum(dtype=torch.float32))[0]
        rates["torch sum of as many bytes"] = tx.numel() * 2 / (ms * 1e-3) / 1e12
        del tx
    return rates


# the configuration the engine runs: the paged decode kernel's defaults
ENGINE_PAGED_DECODE = _defaults(paged_attention_decode_pallas,
                                ("pages_per_block", "num_splits", "num_warps", "num_stages", "per_page"))


def bench_paged_decode(quick, copy_bw):
    B, ctx, H, KVH, D, BS = 64, 8192, 16, 2, 256, 16
    M = ctx // BS
    P = B * M + 1
    shape = f"B{B} ctx{ctx} H{H} KVH{KVH} D{D} BS{BS} bf16"
    key = jax.random.split(jax.random.PRNGKey(3), 3)
    k_pages = jax.random.normal(key[0], (P, BS, KVH, D), jnp.bfloat16)
    v_pages = jax.random.normal(key[1], (P, BS, KVH, D), jnp.bfloat16)
    q = jax.random.normal(key[2], (B, H, D), jnp.bfloat16)
    rng = np.random.default_rng(3)
    tables = jnp.asarray(1 + rng.permutation(B * M).reshape(B, M).astype(np.int32))
    token_seq = jnp.arange(B, dtype=jnp.int32)
    positions = jnp.full((B,), ctx - 1, jnp.int32)
    args = (q, k_pages, v_pages, tables, token_seq, positions)
    kv_bytes = 2 * B * ctx * KVH * D * 2

    # correctness: full-length rows, plus ragged lengths with a sliding window and LSE
    ref = jax.jit(functools.partial(paged_attention_reference, return_lse=True))
    want_o, want_lse = ref(*args)
    got_o, got_lse = jax.jit(functools.partial(paged_attention_decode_pallas, return_lse=True))(*args)
    e1, e2 = errors(np.asarray(got_o, np.float32), np.asarray(want_o, np.float32)), errors(got_lse, want_lse)
    pos_r = jnp.asarray(rng.integers(0, ctx, B).astype(np.int32)).at[0].set(0).at[1].set(BS - 1)
    args_r = (q, k_pages, v_pages, tables, token_seq, pos_r)
    kw_r = dict(return_lse=True, sliding_window=1000)
    want_r = jax.jit(functools.partial(paged_attention_reference, **kw_r))(*args_r)
    got_r = jax.jit(functools.partial(paged_attention_decode_pallas, **kw_r))(*args_r)
    got_p = jax.jit(functools.partial(paged_attention_decode_pallas, per_page=True, **kw_r))(*args_r)
    e5 = errors(np.asarray(got_p[0], np.float32), np.asarray(want_r[0], np.float32))
    e3 = errors(np.asarray(got_r[0], np.float32), np.asarray(want_r[0], np.float32))
    e4 = errors(got_r[1], want_r[1])
    print(f"paged decode check: out {e1} lse {e2}; ragged+window out {e3} lse {e4}; per_page {e5}", flush=True)
    err, rel = max(e1[0], e3[0], e5[0]), max(e1[1], e3[1], e2[1], e4[1], e5[1])

    def make(cfg):  # (pages_per_block, num_splits, num_warps, num_stages, per_page[, block_softmax (else default)])
        npb, ns, nw, st, pp, *bs = cfg
        return jax.jit(functools.partial(paged_attention_decode_pallas, pages_per_block=npb, num_splits=ns,
                                         num_warps=nw, num_stages=st, per_page=pp, block_softmax=bs[0] if bs else None))

    configs = [ENGINE_PAGED_DECODE] if quick else [ENGINE_PAGED_DECODE,
        (4, 8, 4, 2, True), (4, 8, 4, 3, True), (4, 8, 4, 4, True), (2, 8, 4, 3, True), (4, 16, 4, 2, True),
        # page by page with one softmax step a page (`block_softmax=False`; a step a block is the default)
        (4, 8, 4, 4, True, False), (4, 8, 4, 2, True, False), (8, 8, 4, 2, True, False), (4, 16, 4, 2, True, False),
        (4, 8, 8, 2, True), (4, 4, 4, 2, True), (2, 16, 4, 2, True), (8, 8, 4, 2, True), (4, 8, 2, 2, True),
        # gathered tiles (the --quick configuration until session 35 first), more splits, more stages, more warps
        (4, 16, 4, 3, False), (2, 16, 4, 3, False), (4, 32, 4, 3, False), (2, 32, 4, 2, False),
        (4, 16, 8, 3, False), (8, 16, 4, 2, False), (4, 16, 4, 4, False),
        # fewer splits: longer loops per program, fewer programs (the H200's 2,048 programs at 16 splits)
        (4, 8, 4, 3, False), (8, 8, 4, 3, False), (8, 8, 8, 3, False),
    ]
    configs = list(dict.fromkeys(configs))  # the engine's own configuration once
    cfg, ours = best_config("paged_decode", make, configs, lambda: args)
    if not quick:  # each configuration's reads alone beside its decode time: which load structure streams best
        for c in configs:
            timed = [r["ms"] for r in SWEEPS if r["op"] == "paged_decode" and r["cfg"] == c and r["ms"]]
            try:
                read_ms = time_jax(paged_read_fn(c), (k_pages, v_pages, tables), reps=10)[0]
            except Exception as e:  # noqa: BLE001  a configuration that does not compile is a result
                print(f"  paged read {c}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            dec = f"decode {kv_bytes / (timed[0][0] * 1e-3) / 1e12:.2f} TB/s" if timed else "decode failed"
            print(f"  paged read {c}: {dec}; reads alone {kv_bytes / (read_ms * 1e-3) / 1e12:.2f} TB/s", flush=True)
            SWEEPS.append(dict(op="paged_read", cfg=c, ms=read_ms))
    bw = kv_bytes / (ours[0] * 1e-3) / 1e12
    note = f"cfg={cfg}; KV read {bw:.2f} TB/s = {bw / copy_bw:.0%} of copy {copy_bw:.2f} TB/s"
    try:  # what the same reads cost without the math: the kernel's gather pattern against plain reads
        rates = paged_read_rates(k_pages, v_pages, tables, cfg, kv_bytes)
        note += "; reads alone: " + ", ".join(f"{k} {v:.2f} TB/s ({v / copy_bw:.0%})" for k, v in rates.items())
    except Exception as e:  # noqa: BLE001  the probe is an explanation, not the row
        print(f"  paged read probe failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    t_ref = time_jax(jax.jit(paged_attention_reference), args, reps=10)
    record("paged_decode", shape, ours, "jnp reference (XLA)", t_ref, err, rel, 2e-2, note, copy_share=bw / copy_bw)
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jpa

        kh, vh = jnp.transpose(k_pages, (2, 0, 1, 3)), jnp.transpose(v_pages, (2, 0, 1, 3))  # [KVH, P, BS, D]
        lengths = positions + 1
        base = jax.jit(functools.partial(jpa.paged_attention, block_h=16))
        o_j = base(q * D**-0.5, kh, vh, tables, lengths)  # jax's kernel applies no scale
        e_j = errors(np.asarray(o_j, np.float32), np.asarray(want_o, np.float32))
        t_j = time_jax(base, (q * D**-0.5, kh, vh, tables, lengths))
        record("paged_decode", shape, ours, "jax.experimental paged_attention", t_j, err, rel, 2e-2,
               f"{note}; baseline rel err {e_j[1]:.2e}", copy_share=bw / copy_bw)
    except Exception as e:
        print(f"  jax paged_attention baseline failed: {type(e).__name__}: {e}", flush=True)
    return bw


def matmul_rate():
    """bf16 dense matmul rate (TFLOP/s) of XLA on 8192^3, the ceiling prefill attention is compared with."""
    key = jax.random.split(jax.random.PRNGKey(7), 2)
    a = jax.random.normal(key[0], (8192, 8192), jnp.bfloat16)
    b = jax.random.normal(key[1], (8192, 8192), jnp.bfloat16)
    t = time_jax(jax.jit(jnp.dot), (a, b), reps=10, inner=3)
    rate = 2 * 8192**3 / (t[0] * 1e-3) / 1e12
    print(f"bf16 matmul 8192^3 (XLA): {t[0]:.3f} ms -> {rate:.1f} TFLOP/s", flush=True)
    return rate


def split_prefill(cu):
    """The engine's prefill attention, jitted: `(q, k_pages, v_pages, tables, token_seq, positions, k_new, v_new)`
    -> (o, lse), the step's own tokens by cuDNN and the rows' cached prefixes by the Pallas kernel."""
    return jax.jit(lambda *a: paged_attention(*a[:6], cu_seqlens=cu, impl="pallas", new_kv=a[6:], self_impl="cudnn",
                                              return_lse=True))


def bench_paged_prefill(quick):
    B, L, H, KVH, D, BS = 8, 2048, 16, 2, 256, 16
    T, M = B * L, L // BS
    shape = f"B{B} L{L} H{H} KVH{KVH} D{D} BS{BS} bf16"
    key = jax.random.split(jax.random.PRNGKey(5), 3)
    q = jax.random.normal(key[0], (T, H, D), jnp.bfloat16)
    k = jax.random.normal(key[1], (B, L, KVH, D), jnp.bfloat16)
    v = jax.random.normal(key[2], (B, L, KVH, D), jnp.bfloat16)
    rng = np.random.default_rng(5)
    page_of = 1 + rng.permutation(B * M).astype(np.int32)  # page 0 is the null page
    tables = jnp.asarray(page_of.reshape(B, M))
    k_pages = jnp.zeros((B * M + 1, BS, KVH, D), jnp.bfloat16).at[tables.reshape(-1)].set(k.reshape(B * M, BS, KVH, D))
    v_pages = jnp.zeros((B * M + 1, BS, KVH, D), jnp.bfloat16).at[tables.reshape(-1)].set(v.reshape(B * M, BS, KVH, D))
    token_seq = jnp.repeat(jnp.arange(B, dtype=jnp.int32), L)
    positions = jnp.tile(jnp.arange(L, dtype=jnp.int32), B)
    cu = jnp.arange(B + 1, dtype=jnp.int32) * L
    args = (q, k_pages, v_pages, tables, token_seq, positions)
    flops = 4 * H * D * B * (L * (L + 1) // 2)  # QK^T and PV over the causal triangle
    mm = matmul_rate()

    # correctness on a sample of query tokens (the reference gathers each token's whole context)
    idx = jnp.asarray(np.sort(rng.choice(T, 384, replace=False)).astype(np.int32))
    sub = (q[idx], k_pages, v_pages, tables, token_seq[idx], positions[idx])
    want_o, want_lse = jax.jit(functools.partial(paged_attention_reference, return_lse=True))(*sub)

    def make(cfg):
        bq, npb, nw, ns, pp = cfg
        return jax.jit(lambda *a: paged_attention_prefill_pallas(*a[:4], cu, a[5], block_q=bq, pages_per_block=npb,
                                                                   num_warps=nw, num_stages=ns, per_page=pp))

    configs = [(8, 4, 4, 2, False)] if quick else [
        (8, 2, 4, 2, True), (8, 4, 4, 2, False), (8, 2, 4, 2, False), (8, 4, 8, 2, False), (16, 4, 8, 2, False),
        (8, 8, 8, 2, False), (16, 2, 8, 2, False), (8, 4, 4, 3, False),
    ]
    checked = []
    for cfg in configs:  # every config is checked, not only the fastest
        got_o, got_lse = jax.jit(lambda *a: paged_attention_prefill_pallas(
            *a[:4], cu, a[5], block_q=cfg[0], pages_per_block=cfg[1], num_warps=cfg[2], num_stages=cfg[3],
            per_page=cfg[4], return_lse=True))(*args)
        e_o = errors(np.asarray(got_o[idx], np.float32), np.asarray(want_o, np.float32))
        e_l = errors(np.asarray(got_lse[idx]), np.asarray(want_lse))
        checked.append((cfg, e_o, e_l))
        print(f"paged prefill check {cfg}: out {e_o} lse {e_l}", flush=True)
    err = max(max(c[1][0], c[2][0]) for c in checked)
    rel = max(max(c[1][1], c[2][1]) for c in checked)
    cfg, ours = best_config("paged_prefill", make, configs, lambda: args, reps=10)
    tflops = flops / (ours[0] * 1e-3) / 1e12
    note = (f"cfg={cfg}; {flops / 1e9:.0f} GFLOP causal -> {tflops:.1f} TFLOP/s = {tflops / mm:.0%} of the bf16 "
            f"matmul rate {mm:.1f} TFLOP/s")
    try:  # the same attention unpaged, by cuDNN's fused kernel under XLA
        qd = q.reshape(B, L, H, D)
        dense = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn"))
        o_d = dense(qd, k, v)
        e_d = errors(np.asarray(o_d.reshape(T, H, D)[idx], np.float32), np.asarray(want_o, np.float32))
        t_d = time_jax(dense, (qd, k, v), reps=10)
        record("paged_prefill", shape, ours, "cuDNN attention, unpaged (XLA)", t_d, err, rel, 2e-2,
               f"{note}; cuDNN {flops / (t_d[0] * 1e-3) / 1e12:.1f} TFLOP/s, rel err {e_d[1]:.2e}")
        # the engine's path: the step's tokens by cuDNN (packed rows), the (here empty) prefixes by the kernel
        split = split_prefill(cu)
        sargs = args + (k.reshape(T, KVH, D), v.reshape(T, KVH, D))
        got_o, got_lse = split(*sargs)
        e_o = errors(np.asarray(got_o[idx], np.float32), np.asarray(want_o, np.float32))
        e_l = errors(np.asarray(got_lse[idx]), np.asarray(want_lse))
        print(f"split prefill check: out {e_o} lse {e_l}", flush=True)
        t_s = time_jax(split, sargs, reps=10)
        record("prefill_split", shape, t_s, "cuDNN attention, unpaged (XLA)", t_d, max(e_o[0], e_l[0]),
               max(e_o[1], e_l[1]), 2e-2, f"cuDNN self + Pallas prefix {flops / (t_s[0] * 1e-3) / 1e12:.1f} TFLOP/s; "
               f"the Pallas kernel alone {ours[0]:.3f} ms")
    except Exception as e:
        print(f"  cuDNN attention baseline failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        xla = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="xla"))
        t_x = time_jax(xla, (q.reshape(B, L, H, D), k, v), reps=10)
        record("paged_prefill", shape, ours, "XLA attention, unpaged", t_x, err, rel, 2e-2, note)


def probe_cudnn_packed():
    """cuDNN's packed (THD) attention on a tiny ragged batch (rows of 5, 0, 9 and 3 tokens, then padding) against
    the jnp form: its output and where its softmax statistics land (`self_attention._cudnn` reads them as
    [row, head, position within the row])."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    cu = jnp.asarray([0, 5, 5, 14, 17], jnp.int32)
    T, H, KVH, D = 24, 4, 2, 64
    key = jax.random.split(jax.random.PRNGKey(11), 3)
    q, k, v = (jax.random.normal(kk, (T, h, D), jnp.bfloat16) for kk, h in zip(key, (H, KVH, KVH)))
    want_o, want_lse = packed_causal_attention(q, k, v, cu, scale=D**-0.5, impl="reference")
    got_o, got_lse = jax.jit(functools.partial(packed_causal_attention, scale=D**-0.5, impl="cudnn"))(q, k, v, cu)
    lens = cu[1:] - cu[:-1]
    _, stats = dot_product_attention(q[None], k[None], v[None], q_seqlen=lens[None], kv_seqlen=lens[None],
                                     q_offsets=cu[None], kv_offsets=cu[None], scale=D**-0.5,
                                     mask_type=MaskType.PADDING_CAUSAL, qkv_layout="BTNH", return_residual=True)
    print(f"cuDNN packed probe: stats shape {stats.shape}; out {errors(got_o[:17], want_o[:17])} "
          f"lse {errors(got_lse[:17], want_lse[:17])}", flush=True)
    st, wl = np.asarray(stats, np.float64), np.asarray(want_lse, np.float64)
    for b in range(4):
        s_, e_ = int(cu[b]), int(cu[b + 1])
        if e_ > s_:
            print(f"  row {b}: want lse[:, 0] {np.round(wl[s_:e_, 0], 3).tolist()}", flush=True)
    for i in range(st.shape[0]):
        print(f"  stats[{i}, 0, :18] {np.round(st[i, 0, :18], 3).tolist()}", flush=True)


def bench_paged_prefill_suffix(quick):
    """A prefix-cache hit's step: B rows of S new query tokens after C cached tokens each (the 2.2 B model's
    attention shape). The kernel's default KV splits against the same kernel unsplit (the same-run baseline),
    both checked against the reference on a sample of queries; also each context length (the splits' work
    per program shrinks with the context, the tiles' does not)."""
    S, H, KVH, D, BS = 256, 16, 2, 256, 16
    contexts = [10240] if quick else [1024, 4096, 10240]
    for B, C in [(b, c) for b in (1, 5) for c in contexts]:  # one hit beside decodes; five hits at once
        L = C + S
        M = -(-L // BS)
        shape = f"B{B} S{S} after C{C} H{H} KVH{KVH} D{D} bf16"
        key = jax.random.split(jax.random.PRNGKey(C), 3)
        rng = np.random.default_rng(C)
        page_of = 1 + rng.permutation(B * M).astype(np.int32)
        tables = jnp.asarray(page_of.reshape(B, M))
        k_pages = jax.random.normal(key[1], (B * M + 1, BS, KVH, D), jnp.bfloat16)
        v_pages = jax.random.normal(key[2], (B * M + 1, BS, KVH, D), jnp.bfloat16)
        q = jax.random.normal(key[0], (B * S, H, D), jnp.bfloat16)
        token_seq = jnp.repeat(jnp.arange(B, dtype=jnp.int32), S)
        positions = jnp.tile(jnp.arange(C, L, dtype=jnp.int32), B)
        cu = jnp.arange(B + 1, dtype=jnp.int32) * S
        args = (q, k_pages, v_pages, tables, token_seq, positions)
        idx = jnp.asarray(np.sort(rng.choice(B * S, 256, replace=False)).astype(np.int32))
        want_o, want_lse = jax.jit(functools.partial(paged_attention_reference, return_lse=True))(
            q[idx], k_pages, v_pages, tables, token_seq[idx], positions[idx])
        runs = {}
        for splits in (1, None):
            fn = jax.jit(lambda *a, splits=splits: paged_attention_prefill_pallas(
                *a[:4], cu, a[5], num_splits=splits, return_lse=True))
            got_o, got_lse = fn(*args)
            e_o = errors(np.asarray(got_o[idx], np.float32), np.asarray(want_o, np.float32))
            e_l = errors(np.asarray(got_lse[idx]), np.asarray(want_lse))
            runs[splits] = (time_jax(fn, args, reps=10), max(e_o[0], e_l[0]), max(e_o[1], e_l[1]))
            print(f"paged prefill suffix C{C} num_splits={splits or 'default'}: {runs[splits][0][0]:.4f} ms, "
                  f"out {e_o} lse {e_l}", flush=True)
        # split: the 256 new tokens among themselves by cuDNN, the C cached ones by the kernel
        rows_, pos_ = np.repeat(np.arange(B), S), np.tile(np.arange(C, L), B)
        pages_ = tables[rows_, pos_ // BS]
        k_new, v_new = k_pages[pages_, pos_ % BS], v_pages[pages_, pos_ % BS]  # [B*S, KVH, D]
        split = split_prefill(cu)
        got_o, got_lse = split(*args, k_new, v_new)
        e_o = errors(np.asarray(got_o[idx], np.float32), np.asarray(want_o, np.float32))
        e_l = errors(np.asarray(got_lse[idx]), np.asarray(want_lse))
        t_s = time_jax(split, args + (k_new, v_new), reps=10)
        print(f"paged prefill suffix C{C} split: {t_s[0]:.4f} ms, out {e_o} lse {e_l}", flush=True)
        flops = 4 * H * D * B * S * (C + (S + 1) / 2)
        record("suffix_split", shape, t_s, "the Pallas kernel alone", runs[None][0], max(e_o[0], e_l[0]),
               max(e_o[1], e_l[1]), 2e-2, f"{flops / (t_s[0] * 1e-3) / 1e12:.1f} TFLOP/s split")
        (ours, err, rel), (base, err1, rel1) = runs[None], runs[1]
        record("prefill_suffix", shape, ours, "the same kernel, one KV split", base, max(err, err1), max(rel, rel1),
               2e-2, f"{flops / 1e9:.1f} GFLOP -> {flops / (ours[0] * 1e-3) / 1e12:.1f} TFLOP/s split, "
               f"{flops / (base[0] * 1e-3) / 1e12:.1f} unsplit")


def copy_bandwidth():
    x = jnp.ones((1024, 1024, 1024), jnp.bfloat16)  # 2 GiB
    f = jax.jit(lambda x: x + 1)
    t = time_jax(f, (x,), reps=10, inner=3)
    bw = 2 * x.nbytes / (t[0] * 1e-3) / 1e12
    print(f"copy bandwidth (jnp x+1, read+write of {x.nbytes / 2**30:.0f} GiB): {t[0]:.3f} ms -> {bw:.2f} TB/s")
    info = dict(jnp_ms=t, jnp_tbps=bw)
    if torch is not None:
        tx = torch.ones(1024 * 1024 * 1024, dtype=torch.bfloat16, device="cuda")
        ty = torch.empty_like(tx)
        tt = time_torch(lambda: ty.copy_(tx))
        info.update(torch_ms=tt, torch_tbps=2 * tx.numel() * 2 / (tt[0] * 1e-3) / 1e12)
        print(f"copy bandwidth (torch copy_): {tt[0]:.3f} ms -> {info['torch_tbps']:.2f} TB/s")
        del tx, ty
    return info


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--quick", action="store_true", help="one config per kernel, no sweeps")
    parser.add_argument("--commit", default=os.environ.get("JHYBRID_COMMIT"))
    parser.add_argument("--only", default="copy,decode,paged,chunk,probe,prefill,suffix")
    parser.add_argument("--ab", default="", help="chunk_ab: the CHUNK_AB variants to run, comma-separated (default "
                        "all); with --quick, no stage timings")
    a = parser.parse_args()
    AB_ONLY.update(filter(None, a.ab.split(",")))
    if AB_ONLY - set(CHUNK_AB):
        parser.error(f"--ab: unknown variant(s) {sorted(AB_ONLY - set(CHUNK_AB))}; choose from {list(CHUNK_AB)}")
    info = machine_info(a.commit)
    print("machine: " + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    only = a.only.split(",")
    # paged decode reports its read rate as a share of this run's copy rate: measure it whenever that row runs
    bwinfo = copy_bandwidth() if {"copy", "paged"} & set(only) else {}
    info["copy"] = bwinfo
    copy_bw = bwinfo.get("torch_tbps", bwinfo.get("jnp_tbps"))
    for name, fn in (("decode", bench_gdn_decode), ("paged", lambda q: bench_paged_decode(q, copy_bw)),
                     ("chunk", bench_gdn_chunk), ("probe", lambda q: probe_cudnn_packed()),
                     ("prefill", bench_paged_prefill), ("chunk_ab", bench_gdn_chunk_ab),
                     ("suffix", bench_paged_prefill_suffix)):
        if name in only:
            try:
                fn(a.quick)
            except Exception as e:
                import traceback

                traceback.print_exc()
                print(f"{name} FAILED: {type(e).__name__}: {e}", flush=True)
            if a.json:  # after each part: a run cut short by a time limit keeps the rows it measured
                write_json(a.json, info)
    print()
    print("machine: " + " ".join(f"{k}={v}" for k, v in info.items() if k != "copy"))
    print(f"copy bandwidth: " + ", ".join(f"{k}={v:.2f}" for k, v in bwinfo.items() if k.endswith("tbps")) + " TB/s")
    hdr = f"{'op':<13} {'shape':<44} {'ours ms':>9} {'baseline':<34} {'base ms':>9} {'speedup':>8} {'max err':>9} {'rel err':>9} {'ok':<4}"
    print(hdr)
    print("-" * len(hdr))
    for r in RESULTS:
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        base = f"{r['baseline_ms'][0]:.4f}" if r["baseline_ms"] else "-"
        print(f"{r['op']:<13} {r['shape']:<44} {r['ours_ms'][0]:>9.4f} {r['baseline']:<34} {base:>9} {sp:>8} "
              f"{r['max_err']:>9.2e} {r['rel_err']:>9.2e} {'PASS' if r['passed'] else 'FAIL':<4}")
    for r in RESULTS:
        if r["note"]:
            print(f"  {r['op']} vs {r['baseline']}: {r['note']}")
    if a.json:
        write_json(a.json, info)


def write_json(path: str, info: dict) -> None:
    with open(path, "w") as f:
        json.dump(dict(machine_info=info, results=RESULTS, sweeps=SWEEPS), f, indent=1, default=str)


if __name__ == "__main__":
    main()
