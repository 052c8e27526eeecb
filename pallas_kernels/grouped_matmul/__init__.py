"""Grouped (per-expert) matmul over expert-sorted row tiles: the MoE layer's routed experts computed only for the
tokens routed to them. Reference, Pallas kernel, dispatch, and `expert_tiles` (the sorted layout's metadata).

`expert_tiles(expert_ids, E, block_m)` lays P (token, expert) pairs out as rows sorted by expert, each expert's run
padded to whole tiles of `block_m` rows, in a static worst-case number of tiles; `grouped_matmul` multiplies each
tile by its expert's weight (`reference.py` defines it); `impl` picks how:
  * "reference": pure jnp (every row times its expert's weight, gathered: small shapes and tests only);
  * "pallas": the Pallas kernel (`kernel.py`); `interpret=True` runs it in the Pallas interpreter (CPU tests);
  * "auto": the kernel on a GPU where `pallas_supported` says the shapes fit it, else the reference.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.fp8_matmul.reference import BLOCK
from pallas_kernels.grouped_matmul.kernel import grouped_matmul_pallas
from pallas_kernels.grouped_matmul.reference import EPILOGUES, grouped_matmul_reference

_IMPLS = ("auto", "reference", "pallas")


def num_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most tiles `num_pairs` pairs can need: each expert's run rounds up to whole tiles, and at most
    min(E, P) experts have a run."""
    return -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m)


def default_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per tile from the mean rows an expert gets: 16 (a tensor-core tile) below 24, 64 below 256, else 128
    (the fastest in benchmarks/moe.py's sweep on the H200 at 64 and 512 experts)."""
    mean = num_pairs / max(num_experts, 1)
    return 16 if mean < 24 else 64 if mean < 256 else 128


# `expert_tiles` ranks pairs within their expert by comparing every pair with every other (a [P, P] mask, one
# fusion) up to this many pairs, and by a stable sort beyond: a sort on the GPU is several kernels and device copies a
# layer, a cost that matters in decode steps (few pairs)
RANK_BY_COMPARISON_MAX = 1024


def expert_tiles(expert_ids: Int[Array, "P"], num_experts: int, block_m: int) -> tuple[Array, Array, Array]:
    """The expert-sorted row layout of P (token, expert) pairs; a pair whose expert is outside `[0, E)` is dropped
    (another device's expert under expert splitting). Returns
      * `pair_row [P]`: the row each pair lands in (M = num_tiles * block_m for a dropped pair);
      * `row_pair [M]`: the pair each row holds (P for a padding row);
      * `tile_expert [num_tiles]`: each tile's expert, -1 for the unused tiles after the last run.
    A pair keeps its order among its expert's pairs (a stable sort)."""
    p = expert_ids.shape[0]
    tiles_total = num_tiles(p, num_experts, block_m)
    m = tiles_total * block_m
    valid = (expert_ids >= 0) & (expert_ids < num_experts)
    e = jnp.where(valid, expert_ids, num_experts).astype(jnp.int32)  # dropped pairs: a last group of their own
    if p <= RANK_BY_COMPARISON_MAX:
        ids = jnp.arange(p, dtype=jnp.int32)
        earlier_same = (e[:, None] == e[None, :]) & (ids[None, :] < ids[:, None])  # [P, P]: q before p, same expert
        rank = jnp.sum(earlier_same, axis=1, dtype=jnp.int32)  # [P]
        counts = jnp.sum(e[None, :] == jnp.arange(num_experts, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32)
    else:
        counts = jnp.bincount(e, length=num_experts + 1)[:num_experts]  # [E]
        order = jnp.argsort(e, stable=True)  # [P]
        first_pair = jnp.cumsum(counts) - counts  # [E]: where each expert's pairs start in sorted order
        sorted_rank = jnp.arange(p, dtype=jnp.int32) - first_pair[jnp.minimum(e[order], num_experts - 1)]
        rank = jnp.zeros(p, jnp.int32).at[order].set(sorted_rank.astype(jnp.int32))
    tiles = (counts + block_m - 1) // block_m  # [E]
    tile_end = jnp.cumsum(tiles)  # [E]
    row_start = (tile_end - tiles) * block_m  # [E]: the first row of each expert's run
    pair_row = jnp.where(valid, row_start[jnp.minimum(e, num_experts - 1)] + rank, m).astype(jnp.int32)
    row_pair = jnp.full(m, p, jnp.int32).at[pair_row].set(jnp.arange(p, dtype=jnp.int32), mode="drop")
    # each tile's expert (`compare_all`: one comparison and sum; the default method is a `scan`, an XLA while loop
    # that the GPU runs from the host, iteration by iteration, with device copies of its carry)
    tile_expert = jnp.searchsorted(tile_end, jnp.arange(tiles_total, dtype=tile_end.dtype), side="right",
                                   method="compare_all")
    tile_expert = jnp.where(tile_expert < num_experts, tile_expert, -1).astype(jnp.int32)
    return pair_row, row_pair, tile_expert


# Decode steps of at most this many row tiles (a batch-1 or batch-4 step's per-pair tiles: `layers.PER_PAIR_TILES_MAX`)
# take `few_tile_tuning`'s tiles instead of `default_tuning`'s; 0: never (JHYBRID_MOE_NARROW_TILES=0).
# JHYBRID_MOE_NARROW_TUNING (JSON: the kernel's keywords) replaces them for sweeps. `SPLIT_DECODE_TUNING`: K split 8
# ways over 32-column programs (2 tiles: 2 x 32 x 8 = 512 programs where 64 columns gave 16 and 16 columns 128).
# Measured on an H100 (benchmarks/RESULTS.md, "Session 45" and "Session 46"), MiniMax-shaped batch-1 tokens:
# - in a 1-row program (2 tiles; `floors --device-loop`, interleaved): 0.841 / 0.840 / 0.843 ms with session 44's 16
#   columns -> 0.817 / 0.809 / 0.804 / 0.797; the gate/up kernel 9.8 -> 5.5 us a layer, the down kernel 4.2 -> 4.0,
#   the XLA sum of the partials +1 us;
# - served, in the engine's 4-row bucket (`runner.MIN_ROWS`: 8 tiles of which 2 are used; `device_loop
#   --engine-rows 256 --engine-steps 8`, 8-step programs): 0.994 / 0.986 ms with 16 columns -> 0.920 / 0.917.
# The layer alone with every one of 8 tiles used was fastest at 64 columns (`benchmarks.moe`, session 45), but a
# decode bucket's tiles are mostly its padding's; 10 tiles (top-10 of 512 experts at batch 1) split 16 ways took a
# 4-layer Qwen3-Next-80B-shaped token 0.703 -> 0.724 ms, so the bound stays at 8.
NARROW_DECODE_TILES = int(os.environ.get("JHYBRID_MOE_NARROW_TILES", "8"))
NARROW_DECODE_TUNING = json.loads(os.environ.get("JHYBRID_MOE_NARROW_TUNING", "null"))  # None: `few_tile_tuning`
SPLIT_DECODE_TUNING = dict(block_n=32, block_k=128, num_warps=4, num_stages=4, split_k=8)


def few_tile_tuning() -> dict:
    """The kernel's tiles for a decode step of at most `NARROW_DECODE_TILES` row tiles (see above)."""
    return dict(SPLIT_DECODE_TUNING if NARROW_DECODE_TUNING is None else NARROW_DECODE_TUNING)


def default_tuning(block_m: int, fp8: bool, num_tiles: int = 0) -> dict:
    """The kernel's tiles for `block_m` rows per tile and `num_tiles` tiles: the fastest of benchmarks/moe.py's
    sweep on the H200 (RESULTS.md, session 23). Small tiles (decode) are bound by the experts' bytes: 64 columns a
    program, unless there are tiles enough (many experts in use) to keep the SMs busy with 128, or so few
    (`NARROW_DECODE_TILES`) that `few_tile_tuning` applies."""
    if block_m <= 32 and 0 < num_tiles <= NARROW_DECODE_TILES:
        return few_tile_tuning()
    if block_m <= 32:
        if num_tiles >= 256:
            return dict(block_n=128, block_k=64, num_warps=8, num_stages=3)
        return dict(block_n=64, block_k=128, num_warps=4, num_stages=4) if fp8 else \
            dict(block_n=64, block_k=64, num_warps=4, num_stages=3)
    return dict(block_n=128, block_k=64, num_warps=8 if block_m >= 128 else 4, num_stages=3)


def pallas_supported(k: int, n_out: int, fp8: bool, block_n: int = 16) -> bool:
    """Whether the kernel tiles K and the output columns: multiples of 16 (of a 16-wide tile dividing 128 for FP8)."""
    return k % block_n == 0 and n_out % block_n == 0 and (not fp8 or k % BLOCK == 0)


def grouped_matmul(
    x: Float[Array, "M K"],
    w: Array,
    tile_expert: Int[Array, "MB"],
    *,
    n: int,
    block_m: int,
    scale: Array | None = None,
    row_scale: Array | None = None,
    epilogue: str = "none",
    impl: str = "auto",
    interpret: bool = False,
    **tuning,
) -> Array:
    """See `reference.py`. `tuning` (block_n, block_k, num_warps, num_stages, split_k) goes to the kernel (default:
    `default_tuning`, with block_n, block_k and split_k shrunk to divide the shapes)."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown grouped_matmul {impl=}; choose one of {_IMPLS}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"unknown grouped_matmul {epilogue=}; choose one of {EPILOGUES}")
    k = x.shape[1]
    n_out = n // 2 if epilogue == "silu_gate" else n
    fp8 = scale is not None
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" and pallas_supported(k, n_out, fp8) else "reference"
    if impl == "reference":
        return grouped_matmul_reference(x, w, tile_expert, n=n, block_m=block_m, scale=scale, row_scale=row_scale,
                                        epilogue=epilogue)
    cfg = {**default_tuning(block_m, fp8, tile_expert.shape[0]), **tuning}
    while n_out % cfg["block_n"]:
        cfg["block_n"] //= 2
    while k % cfg["block_k"]:
        cfg["block_k"] //= 2
    while (k // cfg["block_k"]) % cfg.get("split_k", 1):  # K's blocks in whole parts
        cfg["split_k"] //= 2
    return grouped_matmul_pallas(x, w, tile_expert, n=n, block_m=block_m, scale=scale, row_scale=row_scale,
                                 epilogue=epilogue, interpret=interpret, **cfg)


__all__ = ["EPILOGUES", "default_block_m", "default_tuning", "expert_tiles", "few_tile_tuning", "grouped_matmul",
           "grouped_matmul_pallas", "grouped_matmul_reference", "num_tiles", "pallas_supported"]
