"""Where the GDN decode kernel's time goes: its state traffic against what the same access pattern can reach.

One decode step of a Gated DeltaNet layer reads and writes the rows' fp32 state: at the qwen3_next-shaped model's
layer (16 key heads, 32 value heads, K = V = 128) and 256 rows, 1.07 GB, 18 layers of which are 72% of the bytes
floor of `benchmarks.floors`' batch-256 step. fla's kernel and ours both move state at about 2.9 TB/s on an H200
whose torch copy reaches 4.3 (issue 20's B256 H16 row). This script times, in one process, on the same state:

- torch `copy_` (out of place) and an in-place `mul_` of the same bytes: the ceilings;
- a Pallas "touch" kernel that only loads each program's `[K, BV]` tile of a row's slot and stores it back
  scaled, with the recurrence kernel's grid and slot indirection (`touch_slot`), and without the indirection
  (`touch_block`, the state tiled by a BlockSpec): what the access pattern alone reaches;
- the recurrence kernel (`fused_recurrent`) by configuration, and persistent forms of it (`persistent`): a fixed
  number of programs each walking tiles in a loop, so that the next tile's loads can be in flight while the current
  one computes (Triton's pipelining, `num_stages`, a form of this script's; or the library kernel's `programs=`
  form, which loads the next tile ahead itself: "prefetch");
- the engine's fused decode kernel (`packed`: norms, gates, recurrence and gated norm of a (row, head) in one
  program), one program per pair, in its persistent form (`programs`: register double buffer) and in its split form
  (`block_v`: a program per column block, the gated norm after it), and the same step in parts (XLA norms and gates
  around `fused_recurrent`);
- the layer's conv update (`conv_update_pallas`), which reads the fp32 conv state one strided tap at a time or
  (`window=True`) as one contiguous tile, by channel block;
- the layer's two decode kernels (conv update, then the packed decode) against the one kernel that does both
  (`conv_decode`: `gated_delta_conv_decode_pallas`, a program per key head);
- fla's `fused_recurrent_gated_delta_rule` when it is installed.

Every kernel's output and state are checked against the jnp reference before it is timed.

    PYTHONPATH=. python -m benchmarks.gdn_decode_probe [--json out.json] [--only touch,recurrent,...]
        [--heads 16,32] [--rows 256]
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from benchmarks.kernels import errors, gdn_decode_inputs, machine_info, time_jax, time_torch, torch
from pallas_kernels.gated_delta_rule.fused_decode import (
    decode_in_parts,
    gated_delta_decode_packed_pallas,
    gated_delta_decode_reference,
    split_packed_decode,
)
from pallas_kernels.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_pallas, recurrent_step
from pallas_kernels.gated_delta_rule.reference import fused_recurrent_gated_delta_rule_reference
from pallas_kernels.null_slot import load_state

B, H, HV, K, V = 256, 16, 32, 128, 128  # (set by --rows, --heads)
_WHOLE = pl.no_block_spec


def _touch_slot_kernel(slot_ids_ref, s_in, s_out, *, block_v):
    i, j, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot, vs = slot_ids_ref[b], pl.ds(i * block_v, block_v)
    s_out[slot, j, :, vs] = s_in[slot, j, :, vs] * 1.0001


def _touch_block_kernel(s_in, s_out):
    s_out[...] = s_in[...] * 1.0001


def touch(state, slots, *, block_v, num_warps, indirect, interpret=False):
    """Every row's slot scaled by 1.0001 in place, `[K, block_v]` a program."""
    nv = V // block_v
    params = plt.CompilerParams(num_warps=num_warps, num_stages=1)
    if indirect:
        return pl.pallas_call(
            functools.partial(_touch_slot_kernel, block_v=block_v), grid=(nv, HV, B), in_specs=[_WHOLE, _WHOLE],
            out_specs=_WHOLE, out_shape=jax.ShapeDtypeStruct(state.shape, state.dtype), input_output_aliases={1: 0},
            compiler_params=params, interpret=interpret, name=f"touch_slot_bv{block_v}_w{num_warps}")(slots, state)
    spec = pl.BlockSpec((None, None, K, block_v), lambda i, j, b: (b + 1, j, 0, i))
    return pl.pallas_call(
        _touch_block_kernel, grid=(nv, HV, B), in_specs=[spec], out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(state.shape, state.dtype), input_output_aliases={0: 0},
        compiler_params=params, interpret=interpret, name=f"touch_block_bv{block_v}_w{num_warps}")(state)


def _persistent_kernel(slot_ids_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_in, o_ref, s_out, *, block_v, programs,
                       scale):
    """Program p takes tiles p, p + programs, ... in a loop whose loads Triton's pipelining (`num_stages`) may overlap
    with the previous tile's work (the library's `programs=` form double-buffers the tiles itself)."""
    nv, tiles = V // block_v, B * HV * V // block_v

    def body(t, carry):
        i, j, b = t % nv, (t // nv) % HV, t // (nv * HV)
        slot, vs = slot_ids_ref[b], pl.ds(i * block_v, block_v)
        kh = j // (HV // H)
        o, h = recurrent_step(load_state(s_in.at[slot, j, :, vs], slot), q_ref[b, kh, :], k_ref[b, kh, :],
                              v_ref[b, j, vs], g_ref[b, j], beta_ref[b, j], scale)
        o_ref[b, j, vs] = o.astype(o_ref.dtype)

        @pl.when(slot != 0)
        def _():
            s_out[slot, j, :, vs] = h

        return carry

    pid = pl.program_id(0)
    jax.lax.fori_loop(0, (tiles - pid + programs - 1) // programs, lambda n, c: body(pid + n * programs, c), 0)


def persistent(q, k, v, g, beta, state, slots, *, block_v, num_warps, num_stages, programs, interpret=False):
    kernel = functools.partial(_persistent_kernel, block_v=block_v, programs=programs, scale=K**-0.5)
    return pl.pallas_call(
        kernel, grid=(programs,), in_specs=[_WHOLE] * 7, out_specs=[_WHOLE, _WHOLE],
        out_shape=[jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(state.shape, state.dtype)],
        input_output_aliases={6: 1}, compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name=f"gdn_persistent_bv{block_v}_w{num_warps}_s{num_stages}_p{programs}",
    )(slots, q, k, v, g, beta, state)


def main(argv=None) -> int:
    global B, H, HV, K, V, time_jax  # the shape of the run (the kernels above read it), the timer
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--only", default="ceiling,touch,recurrent,persistent,packed,conv,conv_decode,fla")
    ap.add_argument("--heads", default=f"{H},{HV}", help="key heads, value heads (issue 20's kernel row: 16,16)")
    ap.add_argument("--rows", type=int, default=B, help="rows a step (at a few rows each timed call is bound by the "
                    "host's dispatch, not the device: time batch-1 kernels in a loop program, benchmarks.device_loop)")
    ap.add_argument("--dims", default=f"{K},{V}", help="key and value head dims")
    ap.add_argument("--interpret", action="store_true", help="Pallas in interpret mode (a CPU check of the script at "
                    "small --rows/--dims; its timings mean nothing)")
    args = ap.parse_args(argv)
    B, (H, HV), (K, V) = args.rows, (int(x) for x in args.heads.split(",")), (int(x) for x in args.dims.split(","))
    kw = dict(interpret=True) if args.interpret else {}
    only = set(args.only.split(","))
    info = machine_info(None)
    print("machine: " + " ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    q, k, v, g, beta, state, slots = gdn_decode_inputs(B, H, HV, K, V)
    gbytes = 2 * B * HV * K * V * 4 / 1e9
    rows = []

    def row(name, ms, err=None, moved=gbytes):  # moved: GB read and written (the recurrent state's by default)
        rate = moved / ms  # GB / ms = TB/s
        rows.append(dict(name=name, ms=ms, tbps=rate, rel_err=err))
        print(f"{name:48s} {ms:8.4f} ms  {rate:5.2f} TB/s" + (f"  rel err {err:.1e}" if err is not None else ""),
              flush=True)

    want_o, want_s = jax.jit(fused_recurrent_gated_delta_rule_reference)(q, k, v, g, beta, state, slots)
    idx = np.asarray(slots)

    def check(o, s):
        e_o = errors(np.asarray(o, np.float32), np.asarray(want_o, np.float32))[1]
        e_s = errors(np.asarray(s)[idx], np.asarray(want_s)[idx])[1]
        return max(e_o, e_s)

    if args.interpret:
        time_jax = functools.partial(time_jax, reps=1, inner=1, warmup=1)  # noqa: F811  (a check, not a timing)
    if "ceiling" in only and torch is not None and torch.cuda.is_available():
        tx = torch.randn(B * HV * K * V, device="cuda")
        ty = torch.empty_like(tx)
        row("torch copy_ (out of place)", time_torch(lambda: ty.copy_(tx))[0])
        row("torch mul_ (in place)", time_torch(lambda: tx.mul_(1.0001))[0])
        del tx, ty
    if "ceiling" in only:
        f = jax.jit(lambda s: s.at[1:].multiply(1.0001), donate_argnums=0)
        row("jnp slots 1.. scaled in place (XLA)", time_jax(f, (state + 0.0,), carry=lambda o, a: (o,))[0])
    if "touch" in only:
        for indirect in (True, False):
            for bv, nw in ((128, 4), (128, 8), (64, 4), (32, 2), (32, 4)):
                f = jax.jit(functools.partial(touch, block_v=min(bv, V), num_warps=nw, indirect=indirect, **kw),
                            donate_argnums=0)
                name = f"touch_{'slot' if indirect else 'block'} bv{bv} w{nw}"
                try:
                    row(name, time_jax(f, (state + 0.0, slots), carry=lambda o, a: (o, a[1]))[0])
                except Exception as e:  # noqa: BLE001  every configuration is tried
                    print(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    carry = lambda out, a: (*a[:5], out[1], a[6])  # noqa: E731
    if "recurrent" in only:
        for bv, nw in ((128, 4), (128, 8), (64, 4), (32, 2)):
            f = jax.jit(functools.partial(fused_recurrent_gated_delta_rule_pallas, block_v=bv, num_warps=nw, **kw),
                        donate_argnums=5)
            err = check(*f(q, k, v, g, beta, state + 0.0, slots))
            row(f"fused_recurrent bv{bv} w{nw}", time_jax(f, (q, k, v, g, beta, state + 0.0, slots), carry=carry)[0],
                err)
    if "persistent" in only:
        # Triton's pipelining (num_stages), then the library's register double buffer (`programs=`), its programs as
        # many as fit the 132 SMs at once by `ptxas -v` on the H200 compile: (64, 4) 234 registers, 2 an SM; (64, 8)
        # 128, 2; (32, 4) 126, 4; (32, 2) 234, 4; (128, 8) 246, 1
        for bv, nw, ns, progs, pre in ((128, 8, 1, 264, False), (128, 8, 2, 264, False), (64, 4, 2, 396, False),
                                       (64, 4, 3, 396, False), (32, 2, 3, 792, False), (64, 4, 2, 792, False),
                                       (64, 4, 1, 264, True), (64, 8, 1, 264, True), (32, 4, 1, 528, True),
                                       (32, 2, 1, 528, True), (128, 8, 1, 132, True)):
            name = f"persistent bv{bv} w{nw} s{ns} p{progs}" + (" prefetch" if pre else "")
            form = fused_recurrent_gated_delta_rule_pallas if pre else persistent
            f = jax.jit(functools.partial(form, block_v=min(bv, V), num_warps=nw, num_stages=ns, programs=progs,
                                          **kw),
                        donate_argnums=5)
            try:
                err = check(*f(q, k, v, g, beta, state + 0.0, slots))
                row(name, time_jax(f, (q, k, v, g, beta, state + 0.0, slots), carry=carry)[0], err)
            except Exception as e:  # noqa: BLE001
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    if "packed" in only:
        rng = jax.random.split(jax.random.PRNGKey(1), 4)
        conv = 2 * H * K + HV * V
        qkv = jax.random.normal(rng[0], (B, conv), jnp.bfloat16)
        proj = jax.random.normal(rng[1], (B, conv + HV * V + 2 * HV), jnp.bfloat16)
        a_log, dt_bias = jax.random.normal(rng[2], (HV,)) * 0.5, jax.random.normal(rng[3], (HV,)) * 0.5
        norm_w = jnp.ones((V,), jnp.bfloat16)
        dims = (H, K, HV, V)
        ref = jax.jit(functools.partial(gated_delta_decode_reference, eps=1e-6))(
            *split_packed_decode(qkv, proj, dims), a_log, dt_bias, norm_w, state, slots)
        packed_args = (qkv, proj, a_log, dt_bias, norm_w)
        for tuning in (dict(num_warps=4), dict(num_warps=8), dict(num_warps=16), dict(num_warps=8, programs=132),
                       dict(num_warps=16, programs=132), dict(num_warps=8, programs=264),
                       dict(num_warps=4, block_v=64), dict(num_warps=2, block_v=32), dict(num_warps=4, block_v=32)):
            f = jax.jit(functools.partial(gated_delta_decode_packed_pallas, dims=dims, eps=1e-6, **tuning, **kw),
                        donate_argnums=5)
            name = "packed " + " ".join(f"{k}={v}" for k, v in tuning.items())
            try:
                o, s = f(*packed_args, state + 0.0, slots)
                err = max(errors(np.asarray(o, np.float32), np.asarray(ref[0], np.float32))[1],
                          errors(np.asarray(s)[idx], np.asarray(ref[1])[idx])[1])
                row(name, time_jax(f, (*packed_args, state + 0.0, slots), carry=carry)[0], err)
            except Exception as e:  # noqa: BLE001
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        for bv, nw in ((128, 4), (64, 4), (32, 2)):
            recurrence = functools.partial(fused_recurrent_gated_delta_rule_pallas, block_v=bv, num_warps=nw, **kw)
            f = jax.jit(lambda qkv, proj, a_log, dt_bias, norm_w, state, slots, r=recurrence: decode_in_parts(
                *split_packed_decode(qkv, proj, dims), a_log, dt_bias, norm_w, state, slots, eps=1e-6, recurrence=r),
                donate_argnums=5)
            o, s = f(*packed_args, state + 0.0, slots)
            err = max(errors(np.asarray(o, np.float32), np.asarray(ref[0], np.float32))[1],
                      errors(np.asarray(s)[idx], np.asarray(ref[1])[idx])[1])
            row(f"in parts: XLA norms + fused_recurrent bv{bv} w{nw}",
                time_jax(f, (*packed_args, state + 0.0, slots), carry=carry)[0], err)
    if "conv" in only:  # the layer's conv update before the recurrence: its fp32 conv state, read tap by tap
        from pallas_kernels.conv_update import conv_update_reference
        from pallas_kernels.conv_update.kernel import block_channels, conv_update_pallas

        conv, width = 2 * H * K + HV * V, 4
        rng = jax.random.split(jax.random.PRNGKey(2), 3)
        x = jax.random.normal(rng[0], (B, conv), jnp.bfloat16)
        cstate = jax.random.normal(rng[1], (B + 1, conv, width - 1), jnp.float32)
        w = jax.random.normal(rng[2], (conv, width), jnp.bfloat16)
        want = conv_update_reference(x, cstate, w, slots)
        cbytes = 2 * B * conv * (width - 1) * 4 / 1e9
        # (small blocks: more programs for the few rows of a batch-1 step, `--rows 1`)
        for block_c, window in ((1024, False), (256, False), (128, False), (64, False), (1024, True), (256, True),
                                (128, True), (64, True)):
            f = jax.jit(functools.partial(conv_update_pallas, block_c=block_channels(conv, block_c), window=window,
                                          **kw), donate_argnums=1)
            o, cs = f(x, cstate + 0.0, w, slots)
            err = max(errors(np.asarray(o, np.float32), np.asarray(want[0], np.float32))[1],
                      errors(np.asarray(cs)[idx], np.asarray(want[1])[idx])[1])
            ms = time_jax(f, (x, cstate + 0.0, w, slots), carry=lambda out, a: (a[0], out[1], *a[2:]))[0]
            row(f"conv_update bc{block_c}" + (" window" if window else " taps"), ms, err, moved=cbytes)
    if "conv_decode" in only:  # the layer's two decode kernels (conv update, packed decode) against one (conv_decode)
        from pallas_kernels.conv_update.kernel import conv_update_pallas
        from pallas_kernels.gated_delta_rule.conv_decode import (
            gated_delta_conv_decode_pallas,
            gated_delta_conv_decode_reference,
        )

        conv, width, dims = 2 * H * K + HV * V, 4, (H, K, HV, V)
        rng = jax.random.split(jax.random.PRNGKey(3), 6)
        proj = jax.random.normal(rng[0], (B, conv + HV * V + 2 * HV), jnp.bfloat16)
        cstate = jax.random.normal(rng[1], (B + 1, conv, width - 1), jnp.float32)
        w = (jax.random.normal(rng[2], (conv, width)) * 0.5).astype(jnp.bfloat16)
        a_log, dt_bias = jax.random.normal(rng[3], (HV,)) * 0.5, jax.random.normal(rng[4], (HV,)) * 0.5
        norm_w = jnp.ones((V,), jnp.bfloat16)
        want = jax.jit(functools.partial(gated_delta_conv_decode_reference, dims=dims, eps=1e-6))(
            proj, cstate, w, a_log, dt_bias, norm_w, state, slots)
        moved = gbytes + 2 * B * conv * (width - 1) * 4 / 1e9  # both states read and written

        def two_kernels(proj, cstate, w, a_log, dt_bias, norm_w, state, slots, **tuning):
            qkv, cstate = conv_update_pallas(proj, cstate, w, slots, activation="silu", **kw)
            o, state = gated_delta_decode_packed_pallas(qkv, proj, a_log, dt_bias, norm_w, state, slots, dims=dims,
                                                        eps=1e-6, **tuning, **kw)
            return o, cstate, state

        forms = [("conv_update + packed w4 (the engine's two kernels)", functools.partial(two_kernels, num_warps=4))]
        forms += [(f"conv_decode w{nw} (one kernel)", functools.partial(
            gated_delta_conv_decode_pallas, dims=dims, eps=1e-6, num_warps=nw, **kw)) for nw in (4, 8, 16)]
        for name, form in forms:
            f = jax.jit(form, donate_argnums=(1, 6))
            try:
                o, cs, s = f(proj, cstate + 0.0, w, a_log, dt_bias, norm_w, state + 0.0, slots)
                err = max(errors(np.asarray(o, np.float32), np.asarray(want[0], np.float32))[1],
                          errors(np.asarray(cs)[idx], np.asarray(want[1])[idx])[1],
                          errors(np.asarray(s)[idx], np.asarray(want[2])[idx])[1])
                ms = time_jax(f, (proj, cstate + 0.0, w, a_log, dt_bias, norm_w, state + 0.0, slots),
                              carry=lambda out, a: (a[0], out[1], *a[2:6], out[2], a[7]))[0]
                row(name, ms, err, moved=moved)
            except Exception as e:  # noqa: BLE001
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    if "fla" in only and torch is not None and torch.cuda.is_available():
        try:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fr

            tt = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda()  # noqa: E731
            tq, tk, tv = (tt(x).to(torch.bfloat16)[:, None] for x in (q, k, v))
            tg, tb, th0 = tt(g)[:, None], tt(beta)[:, None], tt(state[1:])
            row("fla fused_recurrent_gated_delta_rule", time_torch(
                lambda: fla_fr(tq, tk, tv, tg, beta=tb, initial_state=th0, output_final_state=True))[0])
        except Exception as e:  # noqa: BLE001
            print(f"fla: FAILED {type(e).__name__}: {e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=info, gbytes=gbytes, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
