"""A decode step's attention layer from its packed qkv projection to the decode kernel's queries, in one kernel.

Between the qkv projection and the paged decode kernel, XLA runs five kernels a layer at batch 1 (the H200 compile
of the qwen3_next-shaped step): the query slice, the q and k RMS norms with their RoPE, the scatter of the new key
into the pages, the scatter of the new value, and the zero padding of each kv head's query group to the decode
kernel's 16-row tile. Here one program per (token, kv head) does all of it, reading its parts of `qkv` in place:

- each of the group's G query heads: RMS norm (`qk_norm`), rotate-half RoPE on the first `rotary_dim` dims, stored
  in `[T, KVH, GP, D]` with rows G..GP zero (the layout `paged_attention_decode_pallas` takes pre-padded);
- the kv head's key (norm and RoPE as the queries) and value, stored at the token's flat cache slot
  (`slot_mapping`) of the pages, which are updated in place (aliased). Padding tokens point into the null page 0, as
  for `write_kv_pages`.

Rotate-half pairs dim i with dim i + R (R = rotary_dim / 2): a program loads and stores a head in power-of-two
pieces, the pair's halves [0, R) and [R, 2R) as two of them (Triton permutes no vector in registers), the dims
that pass through in the rest. The rounding follows `attention_qkv`: the norm in fp32 cast to the input dtype, then
RoPE with cos and sin in the input dtype, its products summed in fp32 and cast once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.paged_attention.decode import group_rows

_WHOLE = pl.no_block_spec


def decode_prologue_reference(
    qkv: Float[Array, "T X"], q_norm: Float[Array, "D"] | None, k_norm: Float[Array, "D"] | None,
    positions: Int[Array, "T"], inv_freq: Float[Array, "R"], slot_mapping: Int[Array, "T"],
    k_pages: Float[Array, "P BS KVH D"], v_pages: Float[Array, "P BS KVH D"], *,
    dims: tuple[int, int, int], gate: bool, eps: float, zero_centred: bool,
):
    """`attention_qkv`'s decode form in jnp: (q `[T, KVH, GP, D]` in the pages' dtype, rows past the group zero;
    k_pages; v_pages)."""
    from jhybrid.models.layers import apply_rope, rms_norm
    from pallas_kernels.paged_attention.reference import write_kv_pages

    heads, kv_heads, hd = dims
    tokens, q_out = qkv.shape[0], heads * hd * (2 if gate else 1)
    q = qkv[:, :q_out].reshape(tokens, heads, 2, hd)[:, :, 0] if gate else qkv[:, :q_out].reshape(tokens, heads, hd)
    k = qkv[:, q_out : q_out + kv_heads * hd].reshape(tokens, kv_heads, hd)
    v = qkv[:, q_out + kv_heads * hd : q_out + 2 * kv_heads * hd].reshape(tokens, kv_heads, hd)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps, zero_centred), rms_norm(k, k_norm, eps, zero_centred)
    q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
    k_pages, v_pages = write_kv_pages(k_pages, v_pages, k, v, slot_mapping)
    group = heads // kv_heads
    q4 = q.astype(k_pages.dtype).reshape(tokens, kv_heads, group, hd)
    return jnp.pad(q4, ((0, 0), (0, 0), (0, group_rows(group) - group), (0, 0))), k_pages, v_pages


def _pieces(start: int, size: int) -> list[tuple[int, int]]:
    """`[start, start + size)` as power-of-two pieces (Triton's vectors), largest first."""
    out = []
    while size:
        n = 1 << (size.bit_length() - 1)
        out.append((start, n))
        start, size = start + n, size - n
    return out


def _norm_rope(qkv_ref, t, start, w_ref, cos, sin, *, hd: int, half: int, eps: float, zero_centred: bool,
               has_norm: bool, dtype) -> list[tuple[int, jax.Array]]:
    """The head at column `start` of token t's `qkv_ref` row normalised (`rms_norm`'s rounding) and rotated, as
    (offset in the head, values in fp32) pieces: the rotate-half pair's two halves (dims [0, R) and [R, 2R), each
    the other's partner), then the dims that pass through."""
    if has_norm:
        xf = qkv_ref[t, pl.ds(start, hd)].astype(jnp.float32)
        rstd = jax.lax.rsqrt(jnp.mean(xf * xf) + eps)

    def piece(off: int, n: int):  # dims [off, off + n) normalised, in the input dtype
        x = qkv_ref[t, pl.ds(start + off, n)]
        if not has_norm:
            return x
        w = w_ref[pl.ds(off, n)]
        xf = x.astype(jnp.float32) * rstd
        return (xf * (1.0 + w.astype(jnp.float32))).astype(dtype) if zero_centred else w * xf.astype(dtype)

    out = []
    if half:
        a, b = piece(0, half).astype(jnp.float32), piece(half, half).astype(jnp.float32)
        out += [(0, a * cos - b * sin), (half, b * cos + a * sin)]
    out += [(off, piece(off, n).astype(jnp.float32)) for off, n in _pieces(2 * half, hd - 2 * half)]
    return out


def _kernel(positions_ref, slots_ref, qkv_ref, q_norm_ref, k_norm_ref, inv_freq_ref, k_in_ref, v_in_ref, q_ref,
            k_ref, v_ref, *, dims: tuple[int, int, int], gate: bool, eps: float, zero_centred: bool, has_norm: bool,
            half: int):
    del k_in_ref, v_in_ref  # aliased with k_ref and v_ref
    t, h = pl.program_id(0), pl.program_id(1)
    heads, kv_heads, hd = dims
    group = heads // kv_heads
    dtype = qkv_ref.dtype
    cos = sin = None
    if half:  # `apply_rope`'s: the angle in fp32, cos and sin rounded to the input dtype
        angle = positions_ref[t].astype(jnp.float32) * inv_freq_ref[...]
        cos, sin = jnp.cos(angle).astype(dtype).astype(jnp.float32), jnp.sin(angle).astype(dtype).astype(jnp.float32)
    rope = functools.partial(_norm_rope, cos=cos, sin=sin, hd=hd, half=half, eps=eps, zero_centred=zero_centred,
                             has_norm=has_norm, dtype=dtype)
    stride = hd * (2 if gate else 1)  # a query head's columns (its gate's after it)
    for j in range(group):
        for off, vals in rope(qkv_ref, t, (h * group + j) * stride, q_norm_ref):
            q_ref[j, pl.ds(off, vals.shape[0])] = vals.astype(dtype).astype(q_ref.dtype)
    for j in range(group, q_ref.shape[0]):
        q_ref[j, :] = jnp.zeros((hd,), q_ref.dtype)
    q_out = heads * stride
    slot = slots_ref[t]
    page, offset = slot // k_ref.shape[1], slot % k_ref.shape[1]
    for off, vals in rope(qkv_ref, t, q_out + h * hd, k_norm_ref):
        k_ref[page, offset, h, pl.ds(off, vals.shape[0])] = vals.astype(dtype).astype(k_ref.dtype)
    v_ref[page, offset, h, :] = qkv_ref[t, pl.ds(q_out + (kv_heads + h) * hd, hd)].astype(v_ref.dtype)


def decode_prologue_supported(dims: tuple[int, int, int], rotary_dim: int) -> bool:
    """Whether `decode_prologue_pallas` runs these heads: a power-of-two head dim from 16, heads a multiple of kv
    heads, and no RoPE or a rotary part of the head whose half is a power of two."""
    heads, kv_heads, hd = dims
    half = rotary_dim // 2
    return (hd >= 16 and hd & (hd - 1) == 0 and heads % kv_heads == 0 and rotary_dim % 2 == 0 and rotary_dim <= hd
            and half & (half - 1) == 0)


@functools.partial(jax.jit, static_argnames=("dims", "gate", "eps", "zero_centred", "num_warps", "interpret"))
def decode_prologue_pallas(
    qkv: Float[Array, "T X"], q_norm: Float[Array, "D"] | None, k_norm: Float[Array, "D"] | None,
    positions: Int[Array, "T"], inv_freq: Float[Array, "R"], slot_mapping: Int[Array, "T"],
    k_pages: Float[Array, "P BS KVH D"], v_pages: Float[Array, "P BS KVH D"], *,
    dims: tuple[int, int, int], gate: bool, eps: float, zero_centred: bool, num_warps: int = 1,
    interpret: bool = False,
):
    """`decode_prologue_reference` in one kernel, grid `(T, KVH)`; the pages updated in place (aliased: donate them
    under jit). `dims = (H, KVH, D)`; `qkv` is the projection's output `[q (with its gate per head if `gate`) | k |
    v]`; q_norm and k_norm both or neither (no qk norm); `inv_freq` of any length R <= D / 2 (0: no RoPE)."""
    heads, kv_heads, hd = dims
    half = inv_freq.shape[0]
    if not decode_prologue_supported(dims, 2 * half):
        raise ValueError(f"the decode prologue needs a power-of-two head dim from 16, H a multiple of KVH and "
                         f"rotary dims within the head, got {dims=} and {2 * half} rotary dims")
    q_out = heads * hd * (2 if gate else 1)
    if qkv.shape[1] < q_out + 2 * kv_heads * hd or k_pages.shape[2:] != (kv_heads, hd):
        raise ValueError(f"qkv {qkv.shape} and pages {k_pages.shape} do not hold {dims=} ({gate=})")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm: both or neither")
    has_norm = q_norm is not None
    unused = positions  # for the refs the kernel does not read (no norms, no RoPE): an operand already there (a
    # constant made here would be a kernel of its own)
    tokens, gp = qkv.shape[0], group_rows(heads // kv_heads)
    kernel = functools.partial(_kernel, dims=dims, gate=gate, eps=eps, zero_centred=zero_centred, has_norm=has_norm,
                               half=half)
    return pl.pallas_call(
        kernel,
        grid=(tokens, kv_heads),
        in_specs=[_WHOLE] * 8,
        out_specs=[pl.BlockSpec((None, None, gp, hd), lambda t, h: (t, h, 0, 0)), _WHOLE, _WHOLE],
        out_shape=[jax.ShapeDtypeStruct((tokens, kv_heads, gp, hd), k_pages.dtype),
                   jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={6: 1, 7: 2},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=f"attn_decode_prologue_w{num_warps}",
    )(positions.astype(jnp.int32), slot_mapping.astype(jnp.int32), qkv, q_norm if has_norm else unused,
      k_norm if has_norm else unused, jnp.asarray(inv_freq, jnp.float32) if half else unused, k_pages, v_pages)
