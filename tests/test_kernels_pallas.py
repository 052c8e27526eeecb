"""Pallas kernels against their pure-jnp references: interpret mode on CPU, and lowering for the H200.

Every kernel runs with `interpret=True` on small random inputs (lengths of 1, of exactly one block, and
spanning many blocks with a ragged tail; padded rows on the null slot / page; several GQA ratios and head
dims), with whatever the kernel must not read poisoned by NaN. `lower_for_h200` lowers a function for
CUDA on this CPU machine under an abstract H200 mesh (pallas_kernels/README.md), so a kernel that the
Triton lowering rejects fails CI; `test_lowering_check_can_fail` shows that it can.
"""

from __future__ import annotations

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.sharding import AbstractDevice, AbstractMesh

from pallas_kernels import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    paged_attention,
    paged_attention_reference,
    write_kv_pages,
)
from pallas_kernels.gated_delta_rule import (
    chunk_gated_delta_rule_reference,
    fused_recurrent_gated_delta_rule_reference,
)

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


# one Triton call in StableHLO: `custom_call @__gpu$xla.gpu.triton(...) {... ir = "<bytes>", name = "<name>", ...}`
TRITON_CALL = re.compile(r'stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\(.*? ir = "[^"]*", name = "([^"]*)"')


def assert_triton_kernels(text: str, kernels: list[str]) -> None:
    """The lowered StableHLO `text` calls exactly the Triton kernels `kernels` (regular expressions over the
    `pallas_call` names, in program order). Kernel names carry the tuning parameters, so this also checks
    which kernels a variant selects."""
    names = TRITON_CALL.findall(text)
    assert len(names) == len(kernels) and all(re.fullmatch(k, n) for k, n in zip(kernels, names)), (
        f"Triton kernels {names}, expected {kernels}")


def lower_for_h200(fn, *args, kernels: list[str]) -> str:
    """Lowers `jit(fn)(*args)` for CUDA under an abstract H200 mesh; returns the StableHLO text.

    Pallas calls lower to Triton IR here, so unsupported block shapes or primitives raise. The program must
    call exactly the Triton kernels `kernels` (`assert_triton_kernels`)."""
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=H200)):
        text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert_triton_kernels(text, kernels)
    return text


def assert_close(label, got, want, rtol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{label}: NaN in output"
    err = np.abs(got - want).max() if got.size else 0.0
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert rel <= rtol, f"{label}: max abs err {err:.3e}, relative RMS err {rel:.3e} > {rtol}"


def test_lowering_check_can_fail():
    def bad(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def call(x, block):
        return pl.pallas_call(
            bad, grid=(x.shape[0] // block,), in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
            out_specs=pl.BlockSpec((block,), lambda i: (i,)), out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
        )(x)

    x = jnp.zeros((48,), jnp.float32)
    lower_for_h200(functools.partial(call, block=16), x, kernels=["bad"])  # power of two: lowers
    with pytest.raises(Exception, match="power of 2"):
        lower_for_h200(functools.partial(call, block=24), x, kernels=["bad"])
    with pytest.raises(AssertionError, match="Triton kernels"):  # and a kernel other than the expected one fails
        lower_for_h200(functools.partial(call, block=16), x, kernels=["good"])


# ---------------------------------------------------------------- gated delta rule: decode


def _gdn_decode_inputs(rng, batch, h, hv, dk, dv, num_slots, dtype):
    def unit(shape):
        x = rng.normal(size=shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    q = jnp.asarray(unit((batch, h, dk)), dtype)
    k = jnp.asarray(unit((batch, h, dk)), dtype)
    v = jnp.asarray(rng.normal(size=(batch, hv, dv)), dtype)
    g = jnp.asarray(-rng.uniform(0.0, 1.5, (batch, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (batch, hv)), jnp.float32)
    state = rng.normal(size=(num_slots, hv, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize(
    "batch,h,hv,dk,dv,dtype",
    [pytest.param(1, 1, 1, 16, 16, jnp.float32, marks=pytest.mark.slow), (5, 2, 4, 32, 64, jnp.float32),
     pytest.param(4, 2, 2, 64, 32, jnp.bfloat16, marks=pytest.mark.slow)],
)
def test_fused_recurrent_pallas_matches_reference(batch, h, hv, dk, dv, dtype):
    rng = np.random.default_rng(batch * 10 + dk)
    num_slots = batch + 4
    q, k, v, g, beta, state = _gdn_decode_inputs(rng, batch, h, hv, dk, dv, num_slots, dtype)
    slots = rng.permutation(np.arange(1, num_slots))[:batch].astype(np.int32)
    if batch > 2:
        slots[1] = slots[-1] = 0  # padded rows on the null slot
    state[0] = np.nan  # the null slot holds garbage; rows on it start from zeros
    free = np.setdiff1d(np.arange(1, num_slots), slots)
    state[free] = np.nan  # never read, never written
    args = (q, k, v, g, beta, jnp.asarray(state), jnp.asarray(slots))
    want_o, want_state = jax.jit(fused_recurrent_gated_delta_rule_reference)(*args)
    live = slots != 0
    rtol = 1e-5 if dtype == jnp.float32 else 1e-2
    # one program a tile, and the persistent form: 3 programs over the tiles, unevenly (checked to fail with the
    # persistent loop computing on the prefetched tile instead of its own)
    for tuning in (dict(block_v=16), dict(block_v=16, programs=3)):
        got_o, got_state = fused_recurrent_gated_delta_rule(*args, impl="pallas", interpret=True, **tuning)
        assert_close(f"decode output {tuning}", np.asarray(got_o, np.float32)[live],
                     np.asarray(want_o, np.float32)[live], rtol)
        real = slots[live]
        assert_close(f"decode state {tuning}", np.asarray(got_state)[real], np.asarray(want_state)[real], 1e-5)
        np.testing.assert_array_equal(np.asarray(got_state)[free], state[free])


def test_fused_recurrent_lowers_for_h200():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, state = _gdn_decode_inputs(rng, 8, 2, 4, 128, 128, 9, jnp.bfloat16)
    fn = functools.partial(fused_recurrent_gated_delta_rule, impl="pallas")
    kernels = [r"gdn_fused_recurrent_bv\d+_w\d+"]
    lower_for_h200(fn, q, k, v, g, beta, jnp.asarray(state), jnp.arange(8, dtype=jnp.int32), kernels=kernels)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    lower_for_h200(fn, f32(q), f32(k), v, g, beta, jnp.asarray(state), jnp.arange(8, dtype=jnp.int32), kernels=kernels)
    # the persistent form (the register double buffer), 4 programs an SM
    lower_for_h200(functools.partial(fn, block_v=32, num_warps=4, programs=528), q, k, v, g, beta, jnp.asarray(state),
                   jnp.arange(8, dtype=jnp.int32), kernels=[r"gdn_fused_recurrent_p\d+_bv32_w4"])


@pytest.mark.parametrize("batch,h,hv,dk,dv,dtype", [(5, 2, 4, 32, 64, jnp.float32), (4, 1, 2, 16, 256, jnp.bfloat16),
                                                   (1, 2, 2, 64, 16, jnp.float32)])
def test_fused_decode_pallas_matches_reference(batch, h, hv, dk, dv, dtype):
    """The Gated DeltaNet decode step in one kernel (q/k L2 norms, gates, recurrence, gated output norm:
    `gated_delta_decode`, fused) against its jnp form, whose recurrence is the reference's; padded rows on the
    null slot (NaN there: it must read as zeros) keep no state, free slots are neither read nor written. Checked to
    fail with the kernel's output norm dropped, and with its q left unnormalised."""
    from pallas_kernels.gated_delta_rule import gated_delta_decode, gated_delta_decode_reference

    rng = np.random.default_rng(batch + dv)
    num_slots = batch + 3
    q, k, v, *_ = _gdn_decode_inputs(rng, batch, h, hv, dk, dv, num_slots, dtype)
    q, k = q * 3.0, k * 0.5  # not unit vectors: the kernel normalises them
    a = jnp.asarray(rng.normal(size=(batch, hv)), dtype)
    b = jnp.asarray(rng.normal(size=(batch, hv)), dtype)
    z = jnp.asarray(rng.normal(size=(batch, hv, dv)), dtype)
    a_log = jnp.asarray(rng.uniform(-1.0, 2.0, hv), jnp.float32)
    dt_bias = jnp.asarray(rng.normal(size=hv), jnp.float32)
    norm_w = jnp.asarray(rng.uniform(0.5, 1.5, dv), dtype)
    state = rng.normal(size=(num_slots, hv, dk, dv)).astype(np.float32)
    slots = rng.permutation(np.arange(1, num_slots))[:batch].astype(np.int32)
    if batch > 2:
        slots[1] = 0
    state[0] = np.nan
    free = np.setdiff1d(np.arange(1, num_slots), slots)
    state[free] = np.nan
    args = (q, k, v, a, b, z, a_log, dt_bias, norm_w, jnp.asarray(state), jnp.asarray(slots))
    want_o, want_state = jax.jit(functools.partial(gated_delta_decode_reference, eps=1e-6))(*args)
    got_o, got_state = gated_delta_decode(*args, eps=1e-6, impl="pallas", interpret=True, fused=True)
    live = slots != 0
    rtol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert_close("fused decode output", np.asarray(got_o, np.float32)[live], np.asarray(want_o, np.float32)[live], rtol)
    assert_close("fused decode state", np.asarray(got_state)[slots[live]], np.asarray(want_state)[slots[live]], 1e-5)
    np.testing.assert_array_equal(np.asarray(got_state)[free], state[free])
    # unfused (the parts one by one, the Pallas recurrence): the same result
    parts_o, parts_state = gated_delta_decode(*args, eps=1e-6, impl="pallas", interpret=True, fused=False, block_v=16)
    assert_close("unfused decode output", np.asarray(parts_o, np.float32)[live], np.asarray(want_o, np.float32)[live],
                 rtol)


@pytest.mark.parametrize("batch,h,hv,dk,dv,dtype", [(3, 2, 4, 32, 16, jnp.float32), (2, 1, 2, 16, 64, jnp.bfloat16)])
def test_fused_decode_reads_the_packed_arrays(batch, h, hv, dk, dv, dtype):
    """`gated_delta_decode_packed`: the layer's packed arrays (the conv's q | k | v output, NaN columns after it,
    and the in_proj output q | k | v | z | b | a) in the fused kernel, read in place, against the reference on the
    parts packed; the unfused dispatch of the same packed arrays too, and the persistent form (`programs`: fewer
    programs than (row, head) pairs, unevenly shared). Row 1 is padding (the null slot 0): it stores nothing. Checked
    to fail with the kernel's a and b columns swapped, with its k read at q's offset, and with the persistent form
    computing on the prefetched tile (the next pair's) instead of the current one; and the split form (`block_v`:
    programs per column block of a head's tile) with its v read at block 0 and with its state stored at block 0."""
    from pallas_kernels.gated_delta_rule import gated_delta_decode_packed, gated_delta_decode_reference

    rng = np.random.default_rng(dk + dv)
    num_slots = batch + 2
    q, k, v = (jnp.asarray(rng.normal(size=(batch, n, d)), dtype) for n, d in ((h, dk), (h, dk), (hv, dv)))
    a, b = (jnp.asarray(rng.normal(size=(batch, hv)), dtype) for _ in range(2))
    z = jnp.asarray(rng.normal(size=(batch, hv, dv)), dtype)
    a_log = jnp.asarray(rng.uniform(-1.0, 2.0, hv), jnp.float32)
    dt_bias = jnp.asarray(rng.normal(size=hv), jnp.float32)
    norm_w = jnp.asarray(rng.uniform(0.5, 1.5, dv), dtype)
    state = jnp.asarray(rng.normal(size=(num_slots, hv, dk, dv)), jnp.float32)
    slots = jnp.asarray(rng.permutation(np.arange(1, num_slots))[:batch], jnp.int32).at[1].set(0)
    live = np.asarray(slots)[np.asarray(slots) != 0]
    flat = lambda x: x.reshape(batch, -1)  # noqa: E731
    qkv = jnp.concatenate([flat(q), flat(k), flat(v), jnp.full((batch, 16), jnp.nan, dtype)], axis=1)
    proj = jnp.concatenate([flat(q), flat(k), flat(v), flat(z), b, a], axis=1)
    want_o, want_state = gated_delta_decode_reference(q, k, v, a, b, z, a_log, dt_bias, norm_w, state, slots, eps=1e-6)
    rtol = 1e-5 if dtype == jnp.float32 else 1e-2
    split = dict(block_v=dv // 2) if dv >= 32 else {}  # the split form: two programs a head's tile
    for fused, tuning in ((True, {}), (True, dict(programs=5)), (True, split), (False, {})):
        got_o, got_state = gated_delta_decode_packed(qkv, proj, a_log, dt_bias, norm_w, state, slots,
                                                     dims=(h, dk, hv, dv), eps=1e-6, impl="pallas", interpret=True,
                                                     fused=fused, **tuning)
        what = f"({fused=}, {tuning})"
        assert_close(f"packed decode output {what}", np.asarray(got_o, np.float32), np.asarray(want_o, np.float32),
                     rtol)
        assert_close(f"packed decode state {what}", np.asarray(got_state)[live], np.asarray(want_state)[live], 1e-5)
        np.testing.assert_array_equal(np.asarray(got_state)[0], np.asarray(state)[0], err_msg=f"null slot {what}")


def _kernel_named(fn, args, prefix: str) -> str:
    """The name of the one Pallas kernel starting with `prefix` in `fn(*args)`'s jaxpr."""
    names = re.findall(rf"name=({prefix}\w*)", str(jax.make_jaxpr(fn)(*args)))
    assert len(names) == 1, names
    return names[0]


PROLOGUE_CASES = [  # (H, KVH, D, rotary dims, gate, qk norm, zero-centred norm, dtype)
    (4, 2, 32, 8, True, True, True, jnp.float32),  # Qwen3-Next's form: gated queries, partial RoPE, 1 + w norms
    (6, 2, 16, 16, False, True, False, jnp.bfloat16),  # Qwen3 / Llama: full RoPE, w * norm, a group of 3
    (2, 1, 16, 0, False, False, False, jnp.float32),  # NemotronH: neither RoPE nor norms
]


@pytest.mark.parametrize("heads,kv_heads,hd,rot,gate,qk_norm,zero_centred,dtype", PROLOGUE_CASES)
def test_decode_prologue_matches_reference(heads, kv_heads, hd, rot, gate, qk_norm, zero_centred, dtype):
    """The attention layer's decode prologue in one kernel (`decode_prologue_pallas`: q/k norms, RoPE, the new K/V
    written into the pages, the queries padded to the decode kernel's rows) against its jnp form, which is checked
    against `attention_qkv` itself (the model's code) with the queries padded as the decode kernel pads them. A
    padding token points at the null page 0. Checked to fail with the rotated halves' sines swapped in sign, with
    the key written at the value's columns, and with the padding rows left unwritten."""
    from jhybrid.models.attention import attention_qkv
    from pallas_kernels.paged_attention.decode_prologue import decode_prologue_pallas, decode_prologue_reference

    rng = np.random.default_rng(heads * hd + rot)
    tokens, num_pages, bs = 3, 6, 4
    q_out = heads * hd * (2 if gate else 1)
    qkv = jnp.asarray(rng.normal(size=(tokens, q_out + 2 * kv_heads * hd)), dtype)
    norms = [jnp.asarray(rng.uniform(-0.5, 0.5, hd), dtype) for _ in range(2)] if qk_norm else [None, None]
    inv_freq = jnp.asarray(10000.0 ** (-np.arange(0, rot, 2) / max(rot, 1)), jnp.float32)
    positions = jnp.asarray([5, 130, 17], jnp.int32)
    slots = jnp.asarray([7 * 1 + 2, 0, 5 * bs + 3], jnp.int32)  # token 1 pads into the null page
    pages = [jnp.asarray(rng.normal(size=(num_pages, bs, kv_heads, hd)), dtype) for _ in range(2)]
    kw = dict(dims=(heads, kv_heads, hd), gate=gate, eps=1e-6, zero_centred=zero_centred)
    want = decode_prologue_reference(qkv, *norms, positions, inv_freq, slots, *pages, **kw)
    got = decode_prologue_pallas(qkv, *norms, positions, inv_freq, slots, pages[0] + 0, pages[1] + 0, interpret=True,
                                 **kw)
    rtol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert_close("queries", np.asarray(got[0], np.float32), np.asarray(want[0], np.float32), rtol)
    for name, g, w in (("k pages", got[1], want[1]), ("v pages", got[2], want[2])):
        assert_close(name, np.asarray(g, np.float32)[1:], np.asarray(w, np.float32)[1:], rtol)
    # the jnp form is the model's attention_qkv on the same projection
    cfg = types.SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, attn_output_gate=gate,
                                attention_bias=False, qk_norm=qk_norm, rms_norm_eps=1e-6,
                                norm_zero_centred=zero_centred)
    p = dict(qkv_proj=jnp.eye(qkv.shape[1], dtype=dtype), q_norm=norms[0], k_norm=norms[1])
    batch = types.SimpleNamespace(positions=positions, slot_mapping=slots)
    q, _, k_pages, _, _ = attention_qkv(cfg, p, qkv, *pages, batch, inv_freq)
    group = heads // kv_heads
    padded = jnp.pad(q.reshape(tokens, kv_heads, group, hd), ((0, 0), (0, 0), (0, want[0].shape[2] - group), (0, 0)))
    assert_close("reference vs attention_qkv", np.asarray(want[0], np.float32), np.asarray(padded, np.float32), rtol)
    assert_close("reference vs attention_qkv, k", np.asarray(want[1], np.float32)[1:],
                 np.asarray(k_pages, np.float32)[1:], rtol)


def test_decode_prologue_lowers_for_h200():
    """Lowers at Qwen3-Next's attention layer (16 q / 2 kv heads of 256, the gate, 64 rotary dims, 1 + w norms; 8
    tokens, 16-token pages) and at NemotronH's (no RoPE, no norms)."""
    from pallas_kernels.paged_attention.decode_prologue import decode_prologue_pallas

    for heads, kv_heads, hd, rot, gate, norm in ((16, 2, 256, 64, True, True), (32, 8, 128, 0, False, False)):
        width = heads * hd * (2 if gate else 1) + 2 * kv_heads * hd
        fn = functools.partial(decode_prologue_pallas, dims=(heads, kv_heads, hd), gate=gate, eps=1e-6,
                               zero_centred=norm)
        norms = [jnp.zeros((hd,), jnp.bfloat16)] * 2 if norm else [None, None]
        args = (jnp.zeros((8, width), jnp.bfloat16), *norms, jnp.zeros((8,), jnp.int32),
                jnp.zeros((rot // 2,), jnp.float32), jnp.zeros((8,), jnp.int32),
                *[jnp.zeros((64, 16, kv_heads, hd), jnp.bfloat16)] * 2)
        lower_for_h200(lambda *a, fn=fn, n=norm: fn(*a) if n else fn(a[0], None, None, *a[1:]),
                       *[a for a in args if a is not None], kernels=["attn_decode_prologue_w1"])


def test_packed_decode_takes_the_split_form_from_its_row_bound(monkeypatch):
    """`SPLIT_FROM_ROWS` picks the packed kernel's split form (`block_v=SPLIT_BLOCK_V`) for steps of that many rows
    or more, the whole tile below it and everywhere when 0; explicit tuning wins. Read from the kernel's name in the
    jaxpr. Checked to fail with the bound compared the wrong way round."""
    import pallas_kernels.gated_delta_rule as gdr

    dims = (2, 16, 4, 128)

    def kernel_name(rows, **tuning):
        args = (jnp.ones((rows, 2 * 2 * 16 + 4 * 128), jnp.bfloat16),
                jnp.ones((rows, 2 * 2 * 16 + 2 * 4 * 128 + 8), jnp.bfloat16), jnp.zeros((4,)), jnp.zeros((4,)),
                jnp.ones((128,), jnp.bfloat16), jnp.zeros((rows + 1, 4, 16, 128)), jnp.arange(rows) + 1)
        fn = functools.partial(gdr.gated_delta_decode_packed, dims=dims, eps=1e-6, impl="pallas", interpret=True,
                               **tuning)
        return _kernel_named(fn, args, "gdn_fused_decode_packed")

    monkeypatch.setattr(gdr, "SPLIT_FROM_ROWS", 0)
    assert kernel_name(8) == "gdn_fused_decode_packed_w4"
    monkeypatch.setattr(gdr, "SPLIT_FROM_ROWS", 8)
    assert kernel_name(4) == "gdn_fused_decode_packed_w4"
    assert kernel_name(8) == f"gdn_fused_decode_packed_bv{gdr.SPLIT_BLOCK_V}_w4"
    assert kernel_name(8, num_warps=8) == "gdn_fused_decode_packed_w8"


def test_fused_decode_lowers_for_h200():
    """Lowers at the head dims of the supported families (Qwen3-Next / Qwen3.5: K = V = 128) and at V = 256, bf16
    activations and fp32 ones."""
    from pallas_kernels.gated_delta_rule import gated_delta_decode

    fn = functools.partial(gated_delta_decode, eps=1e-6, impl="pallas", fused=True)
    for h, hv, dk, dv, dtype in ((16, 32, 128, 128, jnp.bfloat16), (2, 4, 64, 256, jnp.float32)):
        args = [jnp.zeros((8, h, dk), dtype), jnp.zeros((8, h, dk), dtype), jnp.zeros((8, hv, dv), dtype),
                jnp.zeros((8, hv), dtype), jnp.zeros((8, hv), dtype), jnp.zeros((8, hv, dv), dtype),
                jnp.zeros((hv,), jnp.float32), jnp.zeros((hv,), jnp.float32), jnp.zeros((dv,), dtype),
                jnp.zeros((9, hv, dk, dv), jnp.float32), jnp.arange(8, dtype=jnp.int32)]
        lower_for_h200(fn, *args, kernels=["gdn_fused_decode_w4"])
    # the packed form at Qwen3-Next's layer: the conv's output [8, 8192] and the in_proj output [8, 12352]
    from pallas_kernels.gated_delta_rule import gated_delta_decode_packed

    packed = functools.partial(gated_delta_decode_packed, dims=(16, 128, 32, 128), eps=1e-6, impl="pallas", fused=True)
    args = [jnp.zeros((8, 8192), jnp.bfloat16), jnp.zeros((8, 12352), jnp.bfloat16), jnp.zeros((32,), jnp.float32),
            jnp.zeros((32,), jnp.float32), jnp.zeros((128,), jnp.bfloat16), jnp.zeros((9, 32, 128, 128), jnp.float32),
            jnp.arange(8, dtype=jnp.int32)]
    lower_for_h200(packed, *args, kernels=["gdn_fused_decode_packed_w4"])
    # its persistent form, one program per SM
    lower_for_h200(functools.partial(packed, programs=132, num_warps=8), *args,
                   kernels=["gdn_fused_decode_packed_p132_w8"])
    # its split form, a program per [128, 64] block
    lower_for_h200(functools.partial(packed, block_v=64), *args, kernels=["gdn_fused_decode_packed_bv64_w4"])


@pytest.mark.parametrize("batch,hk,hv,dk,dv,dtype", [(4, 2, 4, 16, 32, jnp.bfloat16), (3, 2, 6, 32, 16, jnp.float32),
                                                     (2, 1, 1, 16, 16, jnp.float32)])
def test_conv_decode_kernel_matches_the_two_steps(batch, hk, hv, dk, dv, dtype):
    """`gated_delta_conv_decode_pallas` (the conv update folded into the packed decode, a program per key head)
    against the two steps in jnp (`conv_update_reference`, then `gated_delta_decode_reference`) at G = 2, 3 and 1
    value heads a key head: the output, both states of the live slots; the null slot (row 1, padding) and free slots,
    NaN, are neither read into a live row nor written. Checked to fail with the key head's k channels read at q's
    offset, with the new conv window left unstored, and with value head j's state tile read from head
    0 of its key head."""
    from pallas_kernels.gated_delta_rule.conv_decode import (
        gated_delta_conv_decode_pallas,
        gated_delta_conv_decode_reference,
    )

    rng = np.random.default_rng(hv * dk + dv)
    num_slots, width = batch + 3, 4
    conv = 2 * hk * dk + hv * dv
    proj = jnp.asarray(rng.normal(size=(batch, conv + hv * dv + 2 * hv)), dtype)
    weight = jnp.asarray(rng.normal(size=(conv, width)) * 0.5, dtype)
    a_log = jnp.asarray(rng.uniform(-1.0, 2.0, hv), jnp.float32)
    dt_bias = jnp.asarray(rng.normal(size=hv), jnp.float32)
    norm_w = jnp.asarray(rng.uniform(0.5, 1.5, dv), dtype)
    slots = rng.permutation(np.arange(1, num_slots))[:batch].astype(np.int32)
    slots[1] = 0
    live = slots[slots != 0]
    free = np.setdiff1d(np.arange(1, num_slots), slots)
    conv_state = rng.normal(size=(num_slots, conv, width - 1)).astype(np.float32)
    state = (rng.normal(size=(num_slots, hv, dk, dv)) * 0.3).astype(np.float32)
    want = gated_delta_conv_decode_reference(proj, jnp.asarray(conv_state), weight, a_log, dt_bias, norm_w,
                                             jnp.asarray(state), jnp.asarray(slots), dims=(hk, dk, hv, dv), eps=1e-6)
    for s in (conv_state, state):  # what no live row may read, and no step may write
        s[0] = np.nan
        s[free] = np.nan
    got = gated_delta_conv_decode_pallas(proj, jnp.asarray(conv_state), weight, a_log, dt_bias, norm_w,
                                         jnp.asarray(state), jnp.asarray(slots), dims=(hk, dk, hv, dv), eps=1e-6,
                                         interpret=True)
    rows = slots != 0
    rtol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert_close("conv decode output", np.asarray(got[0], np.float32)[rows], np.asarray(want[0], np.float32)[rows],
                 rtol)
    assert_close("conv decode conv state", np.asarray(got[1])[live], np.asarray(want[1])[live], 1e-6)
    assert_close("conv decode state", np.asarray(got[2])[live], np.asarray(want[2])[live], 1e-5)
    for name, before, after in (("conv state", conv_state, got[1]), ("state", state, got[2])):
        np.testing.assert_array_equal(np.asarray(after)[free], before[free], err_msg=f"free slots' {name}")
        assert np.isnan(np.asarray(after)[0]).all(), f"the null slot's {name} was written"


def test_conv_decode_kernel_lowers_for_h200():
    """At Qwen3-Next's layer (HK 16, HV 32, K = V = 128, conv width 4; the in_proj output [8, 12352]) and at
    Qwen3.5-27B's G = 3 (HK 16, HV 48)."""
    from pallas_kernels.gated_delta_rule.conv_decode import gated_delta_conv_decode_pallas

    for hk, hv in ((16, 32), (16, 48)):
        conv = 2 * hk * 128 + hv * 128
        fn = functools.partial(gated_delta_conv_decode_pallas, dims=(hk, 128, hv, 128), eps=1e-6)
        args = [jnp.zeros((8, conv + hv * 128 + 2 * hv), jnp.bfloat16), jnp.zeros((9, conv, 3), jnp.float32),
                jnp.zeros((conv, 4), jnp.bfloat16), jnp.zeros((hv,), jnp.float32), jnp.zeros((hv,), jnp.float32),
                jnp.zeros((128,), jnp.bfloat16), jnp.zeros((9, hv, 128, 128), jnp.float32),
                jnp.arange(8, dtype=jnp.int32)]
        lower_for_h200(fn, *args, kernels=["gdn_conv_decode_w4"])


# ---------------------------------------------------------------- short convolution: decode


@pytest.mark.parametrize("batch,channels,width,dtype", [(5, 96, 4, jnp.float32), (3, 64, 2, jnp.bfloat16),
                                                        (1, 8192, 4, jnp.bfloat16)])
def test_conv_update_pallas_matches_reference(batch, channels, width, dtype):
    """The decode step of the causal convolution as one kernel (`pallas_kernels.conv_update`) against its jnp
    form: each row's output and its slot's new window; padded rows on the null slot (NaN there) write nothing,
    free slots are neither read nor written. The jnp form is itself checked against the prefill convolution
    (`causal_conv1d`) on the same rows. Both forms: the taps one strided load each, and the window read and written
    as one tile (`window`). Checked to fail with the kernel's new window shifted by one (the newest input stored
    twice), in each form, and with the tile form leaving the new input out of its window."""
    from jhybrid.models.layers import causal_conv1d
    from pallas_kernels.conv_update import conv_update, conv_update_reference

    rng = np.random.default_rng(batch * channels)
    num_slots = batch + 3
    x = jnp.asarray(rng.normal(size=(batch, channels)), dtype)
    weight = jnp.asarray(rng.normal(size=(channels, width)), dtype)
    state = rng.normal(size=(num_slots, channels, width - 1)).astype(np.float32)
    slots = rng.permutation(np.arange(1, num_slots))[:batch].astype(np.int32)
    if batch > 2:
        slots[1] = 0
    live = slots != 0
    clean = state.copy()
    state[0] = np.nan
    free = np.setdiff1d(np.arange(1, num_slots), slots)
    state[free] = np.nan
    want_o, want_state = jax.jit(conv_update_reference)(x, jnp.asarray(state), weight, jnp.asarray(slots))
    rtol = 1e-6 if dtype == jnp.float32 else 1e-2
    for window in (False, True):  # the taps one strided load each, or the window as one tile (`_window_step`)
        got_o, got_state = conv_update(x, jnp.asarray(state), weight, jnp.asarray(slots), impl="pallas",
                                       interpret=True, window=window)
        assert_close(f"conv output ({window=})", np.asarray(got_o, np.float32)[live],
                     np.asarray(want_o, np.float32)[live], rtol)
        np.testing.assert_array_equal(np.asarray(got_state)[slots[live]], np.asarray(want_state)[slots[live]])
        np.testing.assert_array_equal(np.asarray(got_state)[free], state[free])
        np.testing.assert_array_equal(np.asarray(got_state)[0], state[0])  # the null slot: never written
    # the reference is the prefill convolution's decode case (one token a row)
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    conv_o, conv_state = causal_conv1d(x, jnp.asarray(clean), weight, cu, jnp.asarray(slots), jnp.arange(batch))
    assert_close("reference vs causal_conv1d", np.asarray(want_o, np.float32)[live],
                 np.asarray(conv_o, np.float32)[live], 1e-6)
    np.testing.assert_allclose(np.asarray(want_state)[slots[live]], np.asarray(conv_state)[slots[live]], rtol=1e-6)


def test_conv_update_takes_the_window_form_from_its_row_bound(monkeypatch):
    """`WINDOW_FROM_ROWS` picks the kernel's window form at 128 channels a program for steps of that many rows or
    more, the taps below it and everywhere when 0; explicit tuning wins. Read from the kernel's name in the jaxpr.
    Checked to fail with the bound compared the wrong way round."""
    import pallas_kernels.conv_update as cu

    weight = jnp.ones((256, 4), jnp.bfloat16)

    def kernel_name(rows, **tuning):
        x, state = jnp.ones((rows, 256), jnp.bfloat16), jnp.zeros((rows + 1, 256, 3), jnp.float32)
        fn = functools.partial(cu.conv_update, impl="pallas", interpret=True, **tuning)
        return _kernel_named(fn, (x, state, weight, jnp.arange(rows) + 1), "conv_update_bc")

    monkeypatch.setattr(cu, "WINDOW_FROM_ROWS", 0)
    assert kernel_name(8) == "conv_update_bc256_w4"
    monkeypatch.setattr(cu, "WINDOW_FROM_ROWS", 8)
    assert kernel_name(4) == "conv_update_bc256_w4"
    assert kernel_name(8) == "conv_update_bc128_w4_win"
    assert kernel_name(8, block_c=64) == "conv_update_bc64_w4"


@pytest.mark.parametrize("dtype,offset,with_bias", [(jnp.float32, 0, False), (jnp.bfloat16, 0, False),
                                                     (jnp.bfloat16, 32, True)])
def test_conv_update_reads_a_packed_input_and_applies_silu(dtype, offset, with_bias):
    """The layers' forms: the conv's channels are columns `[offset, offset + C)` of a wider packed projection (the
    columns around them NaN: never read), the output goes through SiLU in registers, with a bias first and an fp32
    result (Mamba2's) or without. Against the plain reference on those columns, then the bias and `jax.nn.silu` of
    its rounded output. Checked to fail with the kernel reading its channels at an offset of one block, with the
    activation dropped, and with the bias dropped."""
    from pallas_kernels.conv_update import conv_update, conv_update_reference

    rng = np.random.default_rng(7)
    batch, channels, width, extra = 4, 64, 4, 48
    x = rng.normal(size=(batch, channels)).astype(np.float32)
    nan = lambda n: np.full((batch, n), np.nan, np.float32)  # noqa: E731
    packed = jnp.asarray(np.concatenate([nan(offset), x, nan(extra)], axis=1), dtype)
    weight = jnp.asarray(rng.normal(size=(channels, width)), dtype)
    bias = jnp.asarray(rng.normal(size=channels), dtype) if with_bias else None
    out_dtype = jnp.float32 if with_bias else None
    state = jnp.asarray(rng.normal(size=(batch + 1, channels, width - 1)), jnp.float32)
    slots = jnp.asarray([1, 3, 2, 4], jnp.int32)
    plain_o, want_state = conv_update_reference(jnp.asarray(x, dtype), state, weight, slots)
    if with_bias:
        plain_o = plain_o + bias
    want_o = jax.nn.silu(plain_o.astype(jnp.float32)).astype(out_dtype or dtype)
    for impl in ("reference", "pallas"):
        got_o, got_state = conv_update(packed, state, weight, slots, offset=offset, bias=bias, activation="silu",
                                       out_dtype=out_dtype, impl=impl, interpret=True, block_c=16)
        assert got_o.shape == (batch, channels) and got_o.dtype == want_o.dtype
        rtol = 1e-6 if dtype == jnp.float32 else 1e-2
        assert_close(f"{impl} conv output", np.asarray(got_o, np.float32), np.asarray(want_o, np.float32), rtol)
        np.testing.assert_array_equal(np.asarray(got_state), np.asarray(want_state))


def test_conv_update_lowers_for_h200():
    """At Qwen3-Next's GDN conv (C = 8192, W = 4) and a NemotronH-shaped Mamba2 conv, bf16 inputs, fp32 state."""
    from pallas_kernels.conv_update import conv_update

    fn = functools.partial(conv_update, impl="pallas")
    for channels, width in ((8192, 4), (3328, 4)):
        args = (jnp.zeros((8, channels), jnp.bfloat16), jnp.zeros((9, channels, width - 1), jnp.float32),
                jnp.zeros((channels, width), jnp.bfloat16), jnp.arange(8, dtype=jnp.int32))
        lower_for_h200(fn, *args, kernels=[r"conv_update_bc\d+_w4"])
    # Qwen3-Next's packed in_proj output (conv channels first), SiLU applied
    packed = (jnp.zeros((8, 12352), jnp.bfloat16), jnp.zeros((9, 8192, 3), jnp.float32),
              jnp.zeros((8192, 4), jnp.bfloat16), jnp.arange(8, dtype=jnp.int32))
    lower_for_h200(functools.partial(fn, activation="silu"), *packed, kernels=[r"conv_update_bc\d+_w4_silu"])
    # the window read and written as one tile (`window`)
    lower_for_h200(functools.partial(fn, activation="silu", window=True), *packed,
                   kernels=[r"conv_update_bc\d+_w4_silu_win"])


# ---------------------------------------------------------------- paged attention


def _paged_inputs(rng, lengths, new, h, kvh, d, bs, dtype):
    """Pages with each row's cached prefix + its new tokens written; unused pages (page 0 too) are NaN."""
    max_blocks = max(-(-n // bs) for n in lengths) + 1
    num_pages = 1 + max_blocks * len(lengths) + 2
    k_pages = np.full((num_pages, bs, kvh, d), np.nan, np.float32)
    v_pages = np.full((num_pages, bs, kvh, d), np.nan, np.float32)
    perm = rng.permutation(np.arange(1, num_pages))
    tables = np.zeros((len(lengths), max_blocks), np.int32)
    for b, n in enumerate(lengths):
        nb = -(-n // bs)
        tables[b, :nb] = perm[b * max_blocks : b * max_blocks + nb]
        for pos in range(n):
            k_pages[tables[b, pos // bs], pos % bs] = rng.normal(size=(kvh, d))
            v_pages[tables[b, pos // bs], pos % bs] = rng.normal(size=(kvh, d))
    token_seq = np.concatenate([[b] * new[b] for b in range(len(lengths))]).astype(np.int32)
    positions = np.concatenate([np.arange(n - m, n) for n, m in zip(lengths, new)]).astype(np.int32)
    q = rng.normal(size=(len(token_seq), h, d))
    return (jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
            jnp.asarray(tables), jnp.asarray(token_seq), jnp.asarray(positions))


DECODE_CASES = [
    # lengths (one query per row, at the last position), H, KVH, D, BS
    ([1], 4, 4, 64, 16),  # a single token
    ([16, 33, 1], 8, 2, 128, 16),  # exactly one block; decode just past a block boundary
    ([300, 7, 129, 64], 16, 2, 256, 16),  # many blocks with a ragged tail, GQA 8
    ([40, 5, 77], 6, 3, 64, 8),  # GQA 2, group padded to 16 rows
    ([200, 3], 2, 1, 64, 8),  # MQA-like ratio 2
]


@pytest.mark.parametrize("variant,lengths,h,kvh,d,bs", [  # fast tier: every variant on the GQA-8 case
    pytest.param(variant, *case, marks=() if i == 2 else pytest.mark.slow, id=f"{variant}-case{i}")
    for variant in ["plain", "window", "softcap", "window-per-page", "softcap-block"]
    for i, case in enumerate(DECODE_CASES)])
def test_paged_decode_pallas_matches_reference(lengths, h, kvh, d, bs, variant):
    rng = np.random.default_rng(sum(lengths) + d)
    args = _paged_inputs(rng, lengths, [1] * len(lengths), h, kvh, d, bs, jnp.float32)
    kw = dict(sliding_window=37 if "window" in variant else None, soft_cap=2.0 if "softcap" in variant else None)
    reference = jax.jit(paged_attention_reference,
                        static_argnames=("scale", "sliding_window", "soft_cap", "return_lse"))
    want_o, want_lse = reference(*args, return_lse=True, **kw)
    cu = jnp.arange(len(lengths) + 1, dtype=jnp.int32)
    got_o, got_lse = paged_attention(
        *args, cu_seqlens=cu, decode=True, impl="pallas", interpret=True, return_lse=True,
        pages_per_block=2, num_splits=3, per_page=variant.endswith(("per-page", "block")),
        block_softmax=variant.endswith("block"), **kw,
    )
    assert_close("decode attention output", got_o, want_o, 1e-5)
    assert_close("decode attention lse", got_lse, want_lse, 1e-5)


@pytest.mark.parametrize("variant", ["plain", "window", "softcap-block", "window-per-page", "gather", "static"])
def test_paged_decode_tail_mask_matches_reference(variant, monkeypatch):
    """`TAIL_MASK`: only a split's last block (and under a window its first) is masked; the blocks between take no
    mask and no V select. Rows of 300 (10 blocks of 2 pages over 3 splits: unmasked middles), 129 (a key just past a
    page) and 7 tokens, NaN in every unused page and in the unused slots of each row's last page, against the
    reference, with each page loop, a window, a soft cap and the static splits; lowers for the H200. (Checked to
    fail: with the unmasked loop run to `last_it`, NaN reaches the output; with the window's first block left
    unmasked, the window variants miss the reference.)"""
    import sys

    module = sys.modules["pallas_kernels.paged_attention.decode"]
    monkeypatch.setattr(module, "DYNAMIC_SPLITS", variant != "static")
    jax.clear_caches()
    rng = np.random.default_rng(11)
    lengths = [300, 7, 129]
    args = _paged_inputs(rng, lengths, [1] * len(lengths), 16, 2, 64, 16, jnp.float32)
    # a window of 200 at 299: the 300-token row's pages 6-18, 7 blocks over 3 splits, the first split's first block
    # (keys 96-127) half outside it
    kw = dict(sliding_window=200 if "window" in variant else None, soft_cap=2.0 if "softcap" in variant else None)
    want_o, want_lse = paged_attention_reference(*args, return_lse=True, **kw)
    cu = jnp.arange(len(lengths) + 1, dtype=jnp.int32)
    call = functools.partial(paged_attention, cu_seqlens=cu, decode=True, impl="pallas", return_lse=True,
                             pages_per_block=2, num_splits=3, per_page=variant != "gather", tail_mask=True,
                             block_softmax=variant != "window-per-page", **kw)
    got_o, got_lse = call(*args, interpret=True)
    assert_close("tail-masked decode output", got_o, want_o, 1e-5)
    assert_close("tail-masked decode lse", got_lse, want_lse, 1e-5)
    bf16 = [x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in args]
    lower_for_h200(call, *bf16, kernels=[r"paged_decode_\w+"])
    jax.clear_caches()


def _walked_pages(lo, hi, num_splits, ppb, pages_per_split, min_blocks=1):
    """Per split, the pages `split_pages` has it walk (blocks of `ppb` from its base), as lists."""
    from pallas_kernels.paged_attention.decode import split_pages

    out = []
    for s in range(num_splits):
        base, first, last = (int(x) for x in split_pages(lo, hi, s, num_splits=num_splits, pages_per_block=ppb,
                                                           pages_per_split=pages_per_split, min_blocks=min_blocks))
        out.append([base + i * ppb + j for i in range(first, last) for j in range(ppb)])
    return out


@pytest.mark.parametrize("dynamic,min_blocks", [(True, 1), (True, 3), (True, 8), (False, 1)])
def test_split_pages_walk_every_attended_page_once(dynamic, min_blocks):
    """Every page of `[lo, hi)` is walked by exactly one split, none before `lo`, at most a block's overrun past
    `hi` (within the kernel's table padding), for short and long contexts, windows and tables of any width; with
    `min_blocks`, no split that walks anything walks fewer blocks unless the query has fewer in all."""
    for table in (4, 13, 64, 256):
        for ns, ppb in ((8, 4), (3, 2), (1, 4), (5, 1)):
            ns = max(1, min(ns, -(-table // ppb)))
            pps = -(-table // (ns * ppb)) * ppb
            for hi in range(0, table + 1, max(1, table // 16)):
                for lo in {0, hi // 2, max(hi - 1, 0)}:
                    walked = _walked_pages(lo, hi, ns, ppb, None if dynamic else pps, min_blocks)
                    flat = [p for w in walked for p in w if p < hi]
                    blocks = -(-(hi - lo) // ppb)
                    assert all(len(w) >= min(min_blocks, blocks) * ppb for w in walked if w), (ns, ppb, lo, hi)
                    assert sorted(p for p in flat if p >= lo) == list(range(lo, hi)), (table, ns, ppb, lo, hi)
                    pad = ppb if dynamic else ns * pps - table
                    assert all(p < table + pad for w in walked for p in w), (table, ns, ppb, lo, hi)


def test_dynamic_splits_spread_a_short_context_over_every_split():
    """A 600-token row (38 pages of 16) in a 4,096-token table (256 pages), 8 splits of 4-page blocks: the dynamic
    form gives each of the 8 splits work (1 or 2 of its 10 blocks), where the table's columns leave it in 2 splits, the
    first walking 8 blocks. Checked to fail with `split_pages` given the static `pages_per_split`."""
    walked = _walked_pages(0, 38, 8, 4, None)
    assert sum(bool(w) for w in walked) == 8 and max(len(w) for w in walked) == 2 * 4
    static = _walked_pages(0, 38, 8, 4, 32)
    assert sum(bool(w) for w in static) == 2 and max(len(w) for w in static) == 8 * 4


def test_dynamic_splits_keep_a_short_row_whole_in_a_large_batch():
    """`dynamic_splits`: a batch-1 step (the 4-query bucket, 2 kv heads, 8 splits) splits a row down to single
    blocks; 256 queries take 8 blocks a split, so a 512-token row (32 pages, 8 blocks) stays whole in one split and a
    4,096-token row still spreads over all 8; in a table of 13 blocks (776 tokens) no row could use a second split,
    so the call has one. Checked to fail with `min_blocks` left at 1 (the row over 8 splits)."""
    from pallas_kernels.paged_attention.decode import dynamic_splits

    assert dynamic_splits(4, 2, 8, 64) == (8, 1) and dynamic_splits(64, 2, 8, 64) == (8, 2)
    assert dynamic_splits(256, 2, 8, 13) == (1, 8) and dynamic_splits(256, 2, 8, 20) == (2, 8)
    ns, mb = dynamic_splits(256, 2, 8, 64)
    assert (ns, mb) == (8, 8)
    assert [len(w) for w in _walked_pages(0, 32, 8, 4, None, mb)] == [32] + [0] * 7
    assert [len(w) for w in _walked_pages(0, 256, 8, 4, None, mb)] == [32] * 8
    assert [len(w) for w in _walked_pages(0, 100, 8, 4, None, mb)] == [32, 32, 36] + [0] * 5  # 25 blocks: 8, 8, 9


@pytest.mark.parametrize("dynamic", [True, False, "min_blocks", "skip_empty"])
def test_paged_decode_in_a_wide_table_matches_reference(dynamic, monkeypatch):
    """Short contexts in a block table far wider than any of them (as a server's max_model_len makes it), NaN in
    every unused page: both split forms (the dynamic one also with 2 blocks a split at least, and with the empty
    splits' outputs left unwritten, which the interpreter fills with NaN) against the reference, with and without a
    sliding window; each lowers for the H200. (`skip_empty` checked to fail with the merge's mask of empty splits
    taken out.)"""
    import sys

    module = sys.modules["pallas_kernels.paged_attention.decode"]
    monkeypatch.setattr(module, "DYNAMIC_SPLITS", bool(dynamic))
    if dynamic == "min_blocks":  # 3 queries x 2 kv heads x 4 splits = 24 programs: 2 blocks a split at least
        monkeypatch.setattr(module, "SPLIT_PROGRAMS", 12)
    monkeypatch.setattr(module, "SKIP_EMPTY", dynamic == "skip_empty")
    jax.clear_caches()
    rng = np.random.default_rng(5)
    q, kp, vp, tables, seq, pos = _paged_inputs(rng, [70, 3, 33], [1, 1, 1], 8, 2, 64, 8, jnp.float32)
    tables = jnp.pad(tables, ((0, 0), (0, 40)))  # 51 columns for contexts of 1-9 pages
    cu = jnp.arange(4, dtype=jnp.int32)
    for window in (None, 20):
        want_o, want_lse = paged_attention_reference(q, kp, vp, tables, seq, pos, return_lse=True,
                                                     sliding_window=window)
        got_o, got_lse = paged_attention(q, kp, vp, tables, seq, pos, cu_seqlens=cu, decode=True, impl="pallas",
                                         interpret=True, return_lse=True, sliding_window=window, pages_per_block=2,
                                         num_splits=4)
        assert_close("wide-table decode output", got_o, want_o, 1e-5)
        assert_close("wide-table decode lse", got_lse, want_lse, 1e-5)
    fn = lambda *a: paged_attention(*a, cu_seqlens=cu, decode=True, impl="pallas", sliding_window=20)  # noqa: E731
    bf16 = [x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in (q, kp, vp, tables, seq, pos)]
    lower_for_h200(fn, *bf16, kernels=[r"paged_decode_p[bp]\d+_ns\d+_gp\d+_w\d+_s\d+"])  # the form lowers too
    jax.clear_caches()


@pytest.mark.parametrize("h,kvh,d,per_page", [(16, 2, 256, False), (16, 2, 256, True), (8, 8, 64, False),
                                             (32, 4, 128, True), (16, 2, 256, "block")])
def test_paged_decode_lowers_for_h200(h, kvh, d, per_page):
    rng = np.random.default_rng(1)
    args = _paged_inputs(rng, [40, 17], [1, 1], h, kvh, d, 16, jnp.bfloat16)
    cu = jnp.arange(3, dtype=jnp.int32)
    fn = lambda *a: paged_attention(  # noqa: E731
        *a, cu_seqlens=cu, decode=True, impl="pallas", return_lse=True, sliding_window=64, per_page=bool(per_page),
        block_softmax=per_page == "block",
    )
    loop = {"block": "pb", True: "pp", False: "np"}[per_page]
    kernels = [rf"paged_decode_{loop}\d+_ns\d+_gp\d+_w\d+_s\d+"]  # the page loop asked for
    lower_for_h200(fn, *args, kernels=kernels)
    # fp32 queries over bf16 pages (the model)
    lower_for_h200(fn, args[0].astype(jnp.float32), *args[1:], kernels=kernels)


# ---------------------------------------------------------------- gated delta rule: chunked prefill


def _gdn_chunk_inputs(rng, lengths, h, hv, dk, dv, num_slots, dtype, pad=3):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v, g, beta, state = _gdn_decode_inputs(rng, int(cu[-1]) + pad, h, hv, dk, dv, num_slots, dtype)
    return q, k, v, g, beta, jnp.asarray(cu), state


CHUNK_CASES = [
    # lengths, H, HV, K, V, chunk size, dtype
    ([1], 1, 1, 16, 16, 16, jnp.float32),  # a single token
    ([16, 1], 2, 2, 16, 32, 16, jnp.float32),  # exactly one chunk
    ([1, 63, 0, 37], 2, 4, 32, 16, 16, jnp.float32),  # many chunks, ragged tails, an empty row, GQA 2
    ([40, 9], 1, 2, 64, 64, 32, jnp.bfloat16),
    # a mixed step: one-token (decode) rows beside a prompt whose last chunk holds one token, padding rows
    ([1, 17, 1, 1, 0, 0], 2, 2, 16, 16, 16, jnp.float32),
]


CHUNK_VARIANTS = {  # the default (G and the scores from the WY stage, fused output, bf16 WY dots) and the others
    "default": {},
    "split_output": dict(fused_output=False),
    "no_scores": dict(scores=False),
    "scan": dict(gcum=False),
    "scan_split": dict(gcum=False, fused_output=False),
    # with qk_l2norm: the WY stage writes q and k normalised, the sequential pass reads them (`normed_qk`)
    "wy_normed_qk": dict(normed_qk=True),
    "wy_input": dict(wy_precision="input"),
    "wy_tf32": dict(wy_precision="tf32"),
    # one program per value tile walks every row of more than one token (the rows loop of the sequential pass)
    "one_row_group": dict(row_groups=1),
    "one_row_group_split": dict(row_groups=1, fused_output=False),
}


# fast tier: the default on many chunks and on the mixed step. The other variants change the chunk stages only,
# which a lone one-token row (case 0) never enters and which one chunk (case 1) exercises as a part of case 2:
# they run cases 2-4.
@pytest.mark.parametrize("variant,lengths,h,hv,dk,dv,c,dtype", [
    pytest.param(variant, *case, marks=() if variant == "default" and i in (2, 4) else pytest.mark.slow,
                 id=f"{variant}-case{i}")
    for variant in CHUNK_VARIANTS for i, case in enumerate(CHUNK_CASES) if variant == "default" or i >= 2])
def test_chunk_pallas_matches_reference(lengths, h, hv, dk, dv, c, dtype, variant):
    rng = np.random.default_rng(sum(lengths) + dk)
    num_slots = len(lengths) + 3
    q, k, v, g, beta, cu, state = _gdn_chunk_inputs(rng, lengths, h, hv, dk, dv, num_slots, dtype)
    slots = np.arange(1, len(lengths) + 1, dtype=np.int32)[::-1].copy()
    if len(lengths) > 2:
        slots[1] = 0  # a row on the null slot starts from zeros
    state[0] = np.nan
    free = np.setdiff1d(np.arange(1, num_slots), slots)
    state[free] = np.nan
    args = (q, k, v, g, beta, cu, jnp.asarray(state), jnp.asarray(slots))
    want_o, want_state = jax.jit(chunk_gated_delta_rule_reference, static_argnames="chunk_size")(*args, chunk_size=c)
    got_o, got_state = chunk_gated_delta_rule(*args, impl="pallas", interpret=True, chunk_size=c, block_v=16,
                                            **CHUNK_VARIANTS[variant])
    rtol = 1e-5 if dtype == jnp.float32 else 1e-2
    assert_close("chunk output", np.asarray(got_o, np.float32), np.asarray(want_o, np.float32), rtol)
    assert np.all(np.asarray(got_o, np.float32)[int(cu[-1]):] == 0), "padding tokens must produce zeros"
    live = slots[slots != 0]
    # bf16 inputs: w, u and the dot operands are bf16 (fp32 accumulation), as in fla
    assert_close("chunk final state", np.asarray(got_state)[live], np.asarray(want_state)[live], rtol)
    np.testing.assert_array_equal(np.asarray(got_state)[free], state[free])


@pytest.mark.parametrize("variant", ["default", "split_output", "no_scores", "wy_normed_qk"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_chunk_pallas_normalises_q_and_k_as_it_loads_them(variant, dtype):
    """`qk_l2norm=True` on raw q / k (not unit length, as the layer's conv output) gives what the kernel gives on
    q / k normalised by jnp first (fp32, rounded to their dtype), in every stage that reads them: the WY stage, the
    fused or split sequential pass and the one-token rows; with `normed_qk`, the sequential pass reading the WY
    stage's normalised copies. (Checked to fail with `_l2norm` ignoring `on` in the one-token rows only, and in the
    sequential pass only; `normed_qk` with the WY stage writing k's copy from q, and with it written for the first
    group's heads only.)"""
    from pallas_kernels.gated_delta_rule.fused_decode import _l2_normalize

    lengths = [1, 63, 0, 37, 1]  # one-token rows, many chunks, an empty row
    rng = np.random.default_rng(11)
    q, k, v, g, beta, cu, state = _gdn_chunk_inputs(rng, lengths, 2, 4, 32, 16, 9, dtype)
    q, k = q * 3.0, k * 0.5  # raw: far from unit length
    slots = jnp.arange(1, len(lengths) + 1, dtype=jnp.int32)
    run = lambda q, k, **kw: chunk_gated_delta_rule(  # noqa: E731
        q, k, v, g, beta, cu, jnp.asarray(state), slots, impl="pallas", interpret=True, chunk_size=16, block_v=16,
        **CHUNK_VARIANTS[variant], **kw)
    want_o, want_state = run(_l2_normalize(q, dtype), _l2_normalize(k, dtype))
    got_o, got_state = run(q, k, qk_l2norm=True)
    np.testing.assert_allclose(np.asarray(got_o, np.float32), np.asarray(want_o, np.float32), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_state), np.asarray(want_state), rtol=1e-5, atol=1e-6)
    ref_o, _ = chunk_gated_delta_rule(q, k, v, g, beta, cu, jnp.asarray(state), slots, impl="reference",
                                      chunk_size=16, qk_l2norm=True)  # the reference path normalises in jnp
    assert_close("reference with qk_l2norm", np.asarray(ref_o, np.float32), np.asarray(want_o, np.float32),
                 1e-5 if dtype == jnp.float32 else 1e-2)


_WY, _SINGLE = r"gdn_chunk_wy_c\d+_bf16_w\d+", r"gdn_chunk_single_bv\d+_w\d+"
_FUSED, _STATE = r"gdn_chunk_fused_c\d+_bv\d+_w\d+_s\d+", r"gdn_chunk_state_c\d+_bv\d+_w\d+_s\d+"
_OUTPUT = r"gdn_chunk_output_c\d+_bv\d+_w\d+"
CHUNK_KERNELS = {  # the kernels each variant lowers to: WY stage, sequential pass (+ output), one-token rows
    "default": [_WY + "_gc_sc", _FUSED + "_gc_sc", _SINGLE],
    "split_output": [_WY + "_gc", _STATE + "_gc", _OUTPUT + "_gc", _SINGLE],
    "no_scores": [_WY + "_gc", _FUSED + "_gc", _SINGLE],
    "scan": [_WY, _FUSED, _SINGLE],
    "scan_split": [_WY, _STATE, _OUTPUT, _SINGLE],
    "wy_normed_qk": [_WY + "_gc_sc_qk", _FUSED + "_gc_sc", _SINGLE],
}


@pytest.mark.parametrize("hv,dk,dv,variant", [(2, 128, 128, "default"), (4, 64, 128, "default"),
                                               (2, 128, 128, "split_output"), (2, 128, 128, "no_scores"),
                                               (2, 128, 128, "scan"), (2, 128, 128, "scan_split"),
                                               (4, 128, 128, "wy_normed_qk")])
def test_chunk_lowers_for_h200(hv, dk, dv, variant):
    rng = np.random.default_rng(2)
    q, k, v, g, beta, cu, state = _gdn_chunk_inputs(rng, [100, 30], 2, hv, dk, dv, 4, jnp.bfloat16)
    fn = functools.partial(chunk_gated_delta_rule, impl="pallas", **CHUNK_VARIANTS[variant],
                           **({"qk_l2norm": True} if variant == "wy_normed_qk" else {}))
    kernels = CHUNK_KERNELS[variant]
    lower_for_h200(fn, q, k, v, g, beta, cu, jnp.asarray(state), jnp.array([1, 2], jnp.int32), kernels=kernels)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731  the model passes fp32 q/k (l2-normed) with bf16 v
    lower_for_h200(fn, f32(q), f32(k), v, g, beta, cu, jnp.asarray(state), jnp.array([1, 2], jnp.int32),
                   kernels=kernels)


def _jaxprs(fn, args):
    """`jax.make_jaxpr(fn)(*args)`'s jaxpr and every jaxpr nested in it (Pallas kernels, `pl.when`'s cond, loops)."""
    from jax.extend import core as jex_core

    todo = [jax.make_jaxpr(fn)(*args).jaxpr]
    while todo:
        jaxpr = todo.pop()
        yield jaxpr
        for eqn in jaxpr.eqns:
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if isinstance(inner, jex_core.Jaxpr):
                        todo.append(inner)


def _dtype_round_trips(fn, args) -> list[str]:
    """In the Pallas kernels (and every nested jaxpr) of `jax.make_jaxpr(fn)(*args)`, the values converted to a
    wider float and straight back to their own dtype (`x.astype(f32).astype(bf16)`): a bf16 tile that Triton then
    holds in fp32 registers for nothing. Returned as 'dtype -> wide -> dtype' per occurrence."""
    found = []
    for jaxpr in _jaxprs(fn, args):
        made_by = {}
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "convert_element_type":
                (x,), (y,) = eqn.invars, eqn.outvars
                src = made_by.get(x)
                if (src is not None and src.invars[0].aval.dtype == y.aval.dtype
                        and x.aval.dtype.itemsize > y.aval.dtype.itemsize):  # widened, then narrowed back
                    found.append(f"{y.aval.dtype} -> {x.aval.dtype} -> {y.aval.dtype}")
                made_by[y] = eqn
    return found


def test_chunk_kernels_load_bf16_q_and_k_without_a_round_trip():
    """The chunk stages load a bf16 q / k tile as bf16 when they do not normalise it (`qk_l2norm` off): taken
    through fp32 and back, the fused pass held fp32 tiles (118 -> 158 registers a thread on the H200 compile; issue
    20's GDN chunk row went 1.16 -> 1.33 ms between the two trees). With `qk_l2norm` the fp32 step is the norm's own.
    Checked to fail with `_load_qk` loading through `_l2norm` when off, as it did."""
    from pallas_kernels.gated_delta_rule import chunk_gated_delta_rule_pallas

    rng = np.random.default_rng(0)
    q, k, v, g, beta, cu, state = _gdn_chunk_inputs(rng, [40, 1, 9], 2, 4, 32, 32, 4, jnp.bfloat16)
    fn = functools.partial(chunk_gated_delta_rule_pallas, chunk_size=16)
    assert _dtype_round_trips(fn, (q, k, v, g, beta, cu, state, jnp.array([1, 2, 3], jnp.int32))) == []


def _state_reads(fn, args, state_shape, writes: bool = False) -> list[tuple[str, bool]]:
    """How the Pallas kernels inside `jax.make_jaxpr(fn)(*args)` read (`writes`: write) refs of `state_shape`:
    (primitive, masked) per access, through nested jaxprs (`pl.when`'s cond, loops)."""
    reads = []
    kinds = ("swap", "masked_swap") if writes else ("get", "masked_load")
    for jaxpr in _jaxprs(fn, args):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in kinds and getattr(eqn.invars[0].aval, "shape", None) == state_shape:
                masked = False
                if eqn.primitive.name.startswith("masked"):
                    mask = eqn.params["args_tree"].unflatten(eqn.invars)[-1 if writes else 2]
                    masked = mask is not None
                reads.append((eqn.primitive.name, masked))
    return reads


def test_decode_kernels_read_no_state_for_padding_rows():
    """Every decode kernel reads a row's state tile with a load predicated on the row's slot (`null_slot.load_state`):
    a padding row (the null slot 0) moves none of the state's bytes, where it read the null slot's tile before (a
    batch-1 step runs in a 4-row bucket: three padding rows reading one row's worth of null-slot state; the values
    were already zeros, which the kernels' tests check). Read at each kernel's jaxpr: no plain read of the state
    array, and at least one masked load. Checked to fail with the GDN packed decode kernel's and the conv kernel's
    plain reads back."""
    from pallas_kernels.conv_update.kernel import conv_update_pallas
    from pallas_kernels.gated_delta_rule.fused_decode import gated_delta_decode_packed_pallas
    from pallas_kernels.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_pallas
    from pallas_kernels.simple_gla.fused_recurrent import fused_recurrent_simple_gla_pallas
    from pallas_kernels.simple_gla.lightning_decode import lightning_decode_pallas
    from pallas_kernels.simple_gla.mamba2_decode import mamba2_decode_pallas

    b, h, d = 2, 2, 16
    z = lambda *shape, dtype=jnp.float32: jnp.zeros(shape, dtype)  # noqa: E731
    slots = jnp.arange(b, dtype=jnp.int32)
    state = z(b + 1, h, d, d)
    conv = 2 * h * d + h * d
    cases = {
        "gdn fused_recurrent": (fused_recurrent_gated_delta_rule_pallas,
                                (z(b, h, d), z(b, h, d), z(b, h, d), z(b, h), z(b, h), state, slots)),
        "gdn fused_recurrent, persistent": (functools.partial(fused_recurrent_gated_delta_rule_pallas, programs=3),
                                            (z(b, h, d), z(b, h, d), z(b, h, d), z(b, h), z(b, h), state, slots)),
        "gdn packed": (functools.partial(gated_delta_decode_packed_pallas, dims=(h, d, h, d), eps=1e-6),
                       (z(b, conv), z(b, conv + h * d + 2 * h), z(h), z(h), z(d), state, slots)),
        "gdn packed, persistent": (functools.partial(gated_delta_decode_packed_pallas, dims=(h, d, h, d), eps=1e-6,
                                                     programs=3),
                                   (z(b, conv), z(b, conv + h * d + 2 * h), z(h), z(h), z(d), state, slots)),
        "simple_gla fused_recurrent": (fused_recurrent_simple_gla_pallas,
                                       (z(b, h, d), z(b, h, d), z(b, h, d), z(b, h), state, slots)),
        "lightning": (functools.partial(lightning_decode_pallas, num_heads=h, head_dim=d),
                      (z(b, 3 * h * d), z(h), state, slots)),
        "mamba2": (functools.partial(mamba2_decode_pallas, dims=(h, d, 1, d), dt_offset=h * d + 2 * d,
                                     dt_range=(0.0, float("inf")), out_dtype=jnp.float32),
                   (z(b, h * d + 2 * d), z(b, h * d + 2 * d + h), z(h), z(h), z(h), state, slots)),
        "conv_update": (conv_update_pallas, (z(b, 64), z(b + 1, 64, 3), z(64, 4), slots)),
        "conv_update, window": (functools.partial(conv_update_pallas, window=True),
                                (z(b, 64), z(b + 1, 64, 3), z(64, 4), slots)),
    }
    for name, (fn, args) in cases.items():
        state_shape = args[1 if name.startswith("conv_update") else -2].shape  # (the conv kernel's: its second)
        reads = _state_reads(fn, args, state_shape)
        assert reads and all("load" in prim and masked for prim, masked in reads), (name, reads)
    # the conv window's tile store covers one column past the window (the next channel's first input): masked
    # (interpret mode pads the state instead of aliasing that column, so only this check sees the mask)
    fn, args = cases["conv_update, window"]
    writes = _state_reads(fn, args, args[1].shape, writes=True)
    assert writes and all(masked for _, masked in writes), writes
