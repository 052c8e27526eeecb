"""Pallas (Triton lowering) kernel for the grouped matmul of `reference.py`: each tile of expert-sorted rows times
its expert's weight, with the epilogue and the rows' scales fused.

Grid `(MB, N_out / BN)`: program (i, j) reads `tile_expert[i]`; a negative one (an unused tile: the MoE layer's
tiles are sized for the worst case) returns at once. Otherwise it walks K in blocks of BK, loading the `[BM, BK]`
activation tile and that expert's `[BK, BN]` weight tile (an FP8 tile `[BN, BK]` is multiplied by its block
scale and cast to the activations' dtype in registers, W8A16), and accumulates in fp32. With the "silu_gate"
epilogue the program accumulates two tiles, the gate's columns `j*BN...` and the up projection's `n/2 + j*BN...`,
and writes `silu(gate) * up`: the `[M, n]` product never reaches memory.

With `split_k` S > 1 the grid gains a third axis: program (i, j, s) sums K's s-th S-th only and writes its fp32
partial sums (both the gate's and the up projection's for "silu_gate") to `[S, M, ...]`; the wrapper adds the S
parts and applies the epilogue and row scales in XLA. For steps of so few tiles that `(MB, N_out / BN)` leaves
most SMs idle (a batch-1 token's two experts: 2 x N_out / BN programs).

Only the experts a step routes to are read, each once per tile of its rows: at decode, the bytes read are those of
the chosen experts, not of all of them (the dense einsum's), and the FLOPs are the routed ones.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from pallas_kernels.fp8_matmul.reference import BLOCK
from pallas_kernels.grouped_matmul.reference import EPILOGUES, apply_epilogue

_WHOLE = pl.no_block_spec  # the whole array, indexed inside the kernel


def _grouped_kernel(tile_expert_ref, x_ref, w_ref, *refs, block_m: int, block_n: int, block_k: int, num_k: int,
                    up_offset: int | None, fp8: bool, scaled: bool, epilogue: str, split_k: int):
    scale_ref = refs[0] if fp8 else None
    row_scale_ref = refs[int(fp8)] if scaled else None
    o_ref = refs[-1]
    i, j = pl.program_id(0), pl.program_id(1)
    part = pl.program_id(2) if split_k > 1 else 0  # this program's part of K: blocks part * num_k ... + num_k
    e = tile_expert_ref[i]
    rows = pl.ds(pl.multiple_of(i * block_m, block_m), block_m)
    col0 = pl.multiple_of(j * block_n, block_n)

    def product(xk, c0, k0):  # [BM, BN] fp32: the activation tile times the expert's weight tile at (k0, c0)
        if not fp8:
            return jnp.dot(xk, w_ref[e, pl.ds(k0, block_k), pl.ds(c0, block_n)], preferred_element_type=jnp.float32)
        q = w_ref[e, pl.ds(c0, block_n), pl.ds(k0, block_k)].astype(jnp.float32)  # [BN, BK]
        wt = (q * scale_ref[e, c0 // BLOCK, k0 // BLOCK]).astype(xk.dtype)
        return jax.lax.dot_general(xk, wt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(e >= 0)
    def _():
        def body(kb, accs):
            k0 = pl.multiple_of((part * num_k + kb) * block_k, block_k)
            xk = x_ref[rows, pl.ds(k0, block_k)]  # [BM, BK]
            if up_offset is None:
                return (accs[0] + product(xk, col0, k0),)
            return accs[0] + product(xk, col0, k0), accs[1] + product(xk, up_offset + col0, k0)

        zero = jnp.zeros((block_m, block_n), jnp.float32)
        accs = jax.lax.fori_loop(0, num_k, body, (zero,) * (1 if up_offset is None else 2))
        if split_k > 1:  # partial sums: the wrapper adds them and applies the epilogue
            o_ref[part, rows, pl.ds(col0, block_n)] = accs[0]
            if up_offset is not None:
                o_ref[part, rows, pl.ds(up_offset + col0, block_n)] = accs[1]
            return
        y = jax.nn.silu(accs[0]) * accs[1] if up_offset is not None else apply_epilogue(accs[0], epilogue)
        if scaled:
            y = y * row_scale_ref[rows].astype(jnp.float32)[:, None]
        o_ref[rows, pl.ds(col0, block_n)] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("n", "block_m", "block_n", "block_k", "epilogue", "num_warps",
                                             "num_stages", "split_k", "interpret"))
def grouped_matmul_pallas(
    x: Float[Array, "M K"],
    w: Array,
    tile_expert: Int[Array, "MB"],
    *,
    n: int,
    block_m: int,
    scale: Float[Array, "E NB KB"] | None = None,
    row_scale: Float[Array, "M"] | None = None,
    epilogue: str = "none",
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    split_k: int = 1,
    interpret: bool = False,
) -> Array:
    """Same arguments and result as `grouped_matmul_reference` (rows of unused tiles: unspecified). `block_m`
    (the rows' tile, >= 16), `block_n` and `block_k` are powers of two; `block_n` must divide the output columns
    (`n`, or `n / 2` for "silu_gate") and `block_k` K; for FP8 weights both must divide 128. `split_k`: K's blocks
    in that many parts, one program each, summed after the kernel (it must divide `K / block_k`)."""
    m, k = x.shape
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown grouped_matmul {epilogue=}; choose one of {EPILOGUES}")
    n_out = n // 2 if epilogue == "silu_gate" else n
    fp8 = scale is not None
    problems = []
    if m % block_m or tile_expert.shape[0] * block_m != m:
        problems.append(f"M={m} is not {tile_expert.shape[0]} tiles of {block_m=}")
    if n_out % block_n or k % block_k:
        problems.append(f"{block_n=} must divide the {n_out} output columns and {block_k=} K={k}")
    if split_k < 1 or (k // block_k) % split_k:
        problems.append(f"{split_k=} must divide K's {k // block_k} blocks of {block_k}")
    if fp8 and (BLOCK % block_n or BLOCK % block_k):
        problems.append(f"FP8 weights need block_n and block_k dividing {BLOCK}, got {block_n}, {block_k}")
    if problems:
        raise ValueError("grouped_matmul_pallas: " + "; ".join(problems))
    split = split_k > 1
    scaled = row_scale is not None and not split  # split: the row scales apply after the parts are summed
    kernel = functools.partial(
        _grouped_kernel, block_m=block_m, block_n=block_n, block_k=block_k, num_k=k // block_k // split_k,
        up_offset=n_out if epilogue == "silu_gate" else None, fp8=fp8, scaled=scaled, epilogue=epilogue,
        split_k=split_k)
    operands = [tile_expert.astype(jnp.int32), x, w] + ([scale] if fp8 else []) + \
        ([row_scale.astype(jnp.float32)] if scaled else [])
    out_shape = jax.ShapeDtypeStruct((split_k, m, n), jnp.float32) if split else \
        jax.ShapeDtypeStruct((m, n_out), x.dtype)
    out = pl.pallas_call(
        kernel,
        grid=(tile_expert.shape[0], n_out // block_n) + ((split_k,) if split else ()),
        in_specs=[_WHOLE] * len(operands),
        out_specs=_WHOLE,
        out_shape=out_shape,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"grouped_matmul_{epilogue}_bm{block_m}_bn{block_n}_bk{block_k}{'_fp8' if fp8 else ''}"
             f"{f'_sk{split_k}' if split else ''}",
    )(*operands)
    if not split:
        return out
    acc = out.sum(0)  # [M, n] fp32
    y = apply_epilogue(acc, epilogue)  # "silu_gate": the gate's columns first, as the kernel wrote them
    if row_scale is not None:
        y = y * row_scale.astype(jnp.float32)[:, None]
    return y.astype(x.dtype)
