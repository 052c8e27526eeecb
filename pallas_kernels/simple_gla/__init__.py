"""Scalar-decay linear recurrence without the delta rule (lightning attention, Mamba2 SSD): references,
Pallas kernels and dispatch.

`chunk_simple_gla` (prefill, ragged packed sequences) and `fused_recurrent_simple_gla` (decode, one token
per sequence) are the entry points the model calls. `impl` picks the implementation:
  * "auto": the Pallas kernels on a GPU where they apply (`pallas_supported`), else the references;
  * "reference": the pure-jnp references; "recurrent" (chunk form only): the token-by-token scan;
  * "pallas": the Pallas kernels (`fused_recurrent.py`, `chunk.py`; power-of-two K and V >= 16);
    `interpret=True` runs them in the Pallas interpreter (CPU tests);
  * with `mesh` (a 1-D device mesh whose axis splits the heads: tensor parallelism) the Pallas kernels run
    per shard under `jax.shard_map` (key heads, value heads and the state slots' heads split alike); the
    references need no wrapping (XLA SPMD partitions them).
`_AUTO_PALLAS` lists the kernels "auto" routes to on GPU (checked by benchmarks/simple_gla_kernels.py).
The arguments mirror `pallas_kernels.gated_delta_rule` without `beta`.

`mamba2_decode` is a Mamba2 mixer's decode step after its convolution (step size, decay, the recurrence, the D
skip) from the layer's packed arrays: with `fused` (`MAMBA2_FUSED_DECODE`) and the Pallas recurrence chosen, one
kernel that reads them in place (`mamba2_decode.py`), else the parts one by one, the recurrence dispatched as above.
`lightning_decode` likewise for a MiniMax lightning mixer (`LIGHTNING_FUSED_DECODE`, `lightning_decode.py`).
`chunk_mamba2` is a Mamba2 mixer's chunked prefill from its conv output: with `MAMBA2_FUSED_PREFILL` and the Pallas
kernels chosen, the chunk kernels read x, B and C in place and apply the SiLU, the step size and the D skip
themselves (`chunk.chunk_mamba2_pallas`); else those parts in jnp around `chunk_simple_gla`.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta_rule import _per_head_shard, pallas_supported  # the same tile rule
from pallas_kernels.simple_gla.chunk import chunk_mamba2_pallas, chunk_simple_gla_pallas
from pallas_kernels.simple_gla.fused_recurrent import fused_recurrent_simple_gla_pallas
from pallas_kernels.simple_gla.mamba2_decode import (
    mamba2_decode_in_parts,
    mamba2_decode_pallas,
    mamba2_decode_reference,
)
from pallas_kernels.simple_gla.mamba2_decode import pallas_supported as mamba2_pallas_supported
from pallas_kernels.simple_gla.lightning_decode import (
    lightning_decode_in_parts,
    lightning_decode_pallas,
    lightning_decode_reference,
)
from pallas_kernels.simple_gla.lightning_decode import pallas_supported as lightning_pallas_supported
from pallas_kernels.simple_gla import mamba2_norm
from pallas_kernels.simple_gla.mamba2_norm import mamba2_gated_norm_pallas
from pallas_kernels.simple_gla.reference import (
    chunk_simple_gla_reference,
    fused_recurrent_simple_gla_reference,
    mamba2_gated_norm_reference,
    recurrent_simple_gla_reference,
)

_IMPLS = ("auto", "reference", "recurrent", "pallas")

# Which kernels "auto" routes to on GPU: both, checked against the fp32 reference and timed on the H200 at the
# MiniMax lightning and NemotronH Mamba2 shapes (decode 1.5-4.5x, chunked prefill 1.8-15x the references;
# benchmarks/RESULTS.md, session 16).
_AUTO_PALLAS: frozenset[str] = frozenset({"chunk", "fused_recurrent"})



def _pick(impl: str, kind: str, q, v) -> str:
    if impl not in _IMPLS:
        raise ValueError(f"unknown simple GLA {impl=}; choose one of {_IMPLS}")
    if impl == "auto":
        gpu = jax.default_backend() == "gpu"
        return "pallas" if gpu and kind in _AUTO_PALLAS and pallas_supported(q, v) else "reference"
    if impl == "pallas" and not pallas_supported(q, v):
        raise ValueError(
            f"simple GLA has no Pallas kernel for K={q.shape[-1]}, V={v.shape[-1]}: Triton tiles need power-of-two "
            "K and V >= 16; use impl='reference'"
        )
    return impl


def chunk_simple_gla(q, k, v, g, cu_seqlens, state, slot_ids, *, impl: str = "auto", interpret: bool = False,
                     scale: float = 1.0, chunk_size: int = 64, mesh=None, **tuning):
    """Same signature and result as `chunk_simple_gla_reference`.

    impl: "auto" (the reference for now), "reference" (chunked form), "recurrent" (token-by-token scan, the
    definition) or "pallas". With "pallas" the state is aliased in place (donate it under jit to avoid a copy);
    `tuning` (fused_output, block_v, num_warps, num_stages, out_block_v, out_num_warps, single_block_v,
    row_groups, precision) goes to the kernel.
    """
    args = (q, k, v, g, cu_seqlens, state, slot_ids)
    impl = _pick(impl, "chunk", q, v)
    if impl == "recurrent":
        return recurrent_simple_gla_reference(*args, scale=scale)
    if impl == "reference":
        return chunk_simple_gla_reference(*args, scale=scale, chunk_size=chunk_size)
    kernel = lambda *a: chunk_simple_gla_pallas(  # noqa: E731
        *a, scale=scale, chunk_size=chunk_size, interpret=interpret, **tuning
    )
    if mesh is not None and mesh.size > 1:
        kernel = _per_head_shard(kernel, mesh, "hhhhrsr")
    return kernel(*args)


def fused_recurrent_simple_gla(q, k, v, g, state, slot_ids, *, impl: str = "auto", interpret: bool = False,
                               scale: float = 1.0, mesh=None, **tuning):
    """Same signature and result as `fused_recurrent_simple_gla_reference` (one decode step).

    With impl "pallas" the state is aliased in place (donate it under jit to avoid a copy); `tuning`
    (block_v, num_warps, num_stages) goes to the kernel.
    """
    impl = _pick(impl, "fused_recurrent", q, v)
    if impl == "recurrent":
        raise ValueError("impl='recurrent' is for chunk_simple_gla; decode is already recurrent")
    if impl == "reference":
        return fused_recurrent_simple_gla_reference(q, k, v, g, state, slot_ids, scale=scale)
    kernel = lambda *a: fused_recurrent_simple_gla_pallas(*a, scale=scale, interpret=interpret, **tuning)  # noqa: E731
    if mesh is not None and mesh.size > 1:
        kernel = _per_head_shard(kernel, mesh, "hhhhsr")
    return kernel(q, k, v, g, state, slot_ids)


# the Mamba2 decode step as one kernel (`mamba2_decode`): on, measured on the H200 against the parts one by one with
# the conv kernel (a NemotronH-shaped batch-1 token 1.423 -> 1.345 ms, benchmarks/RESULTS.md, "Session 31");
# JHYBRID_MAMBA2_FUSED_DECODE=0 turns it off
MAMBA2_FUSED_DECODE = os.environ.get("JHYBRID_MAMBA2_FUSED_DECODE", "1") == "1"


def mamba2_decode(xbc, proj, dt_bias, a_log, d_skip, state, slot_ids, *, dims: tuple[int, int, int, int],
                  dt_offset: int, dt_range: tuple[float, float], out_dtype, gated: bool = False, impl: str = "auto",
                  interpret: bool = False, mesh=None, fused: bool | None = None, **tuning):
    """Same signature and result as `mamba2_decode_reference` (one device's unsharded packing). `fused` (default
    `MAMBA2_FUSED_DECODE`): the one-kernel form where the recurrence's impl is "pallas" (so "auto" on a GPU) and no
    mesh splits the heads; else the parts with `fused_recurrent_simple_gla` (its `impl`, `mesh`, `tuning`)."""
    fused = MAMBA2_FUSED_DECODE if fused is None else fused
    h, p, g, n = dims
    form = dict(dims=dims, dt_offset=dt_offset, dt_range=dt_range, out_dtype=out_dtype, gated=gated)
    if (fused and mamba2_pallas_supported(dims) and (mesh is None or mesh.size == 1)
            and _pick(impl, "fused_recurrent", jax.ShapeDtypeStruct((1, g, n), xbc.dtype),
                      jax.ShapeDtypeStruct((1, h, p), xbc.dtype)) == "pallas"):
        return mamba2_decode_pallas(xbc, proj, dt_bias, a_log, d_skip, state, slot_ids, **form, interpret=interpret,
                                    **tuning)
    recurrence = functools.partial(fused_recurrent_simple_gla, impl=impl, interpret=interpret, scale=1.0, mesh=mesh,
                                   **tuning)
    return mamba2_decode_in_parts(xbc, proj, dt_bias, a_log, d_skip, state, slot_ids, **form, recurrence=recurrence)


# a Mamba2 mixer's chunked prefill reading its conv output in place (`chunk_mamba2`). Off by default
# (JHYBRID_MAMBA2_FUSED_PREFILL=1 turns it on): it writes 8.5 GB less per NemotronH 8k prefill but its kernel was
# slower than the parts' (RESULTS, sessions 33-34: on an H100 the model's 8k prefill 67.2 -> 84.2 ms), when its dots
# were fp32 and the parts' too. Since session 41 it scans in `MAMBA2_SCAN_DTYPE` as the parts do (bf16 for a bf16
# model: the same roundings, bit for bit interpreted; its kernels no longer spill on the H200 compile). Still slower
# in that form on an H100: the 8k layer's scan 1.188 ms against the parts' 0.570, the model's 8k prefill 62.0 against
# ~53 ms (benchmarks/RESULTS.md, "Session 42")
MAMBA2_FUSED_PREFILL = os.environ.get("JHYBRID_MAMBA2_FUSED_PREFILL", "0") == "1"
# that form's kernel tuning where the caller gives none (`chunk_mamba2_pallas`'s keywords; JSON in
# JHYBRID_MAMBA2_PREFILL_TUNING): its one-pass form at 8 warps was the fastest of five on an H100 at NemotronH's 8k
# layer, 1.696 ms against 3.003 at the kernel's defaults (4 warps), still slower than the parts (1.314 one-pass,
# 1.114 split; RESULTS, session 34); its split form's output kernel spills 632 B a thread at 4 warps, none at 8
# (ptxas, `benchmarks.h200_aot spills`; not yet timed)
MAMBA2_PREFILL_TUNING = json.loads(os.environ.get("JHYBRID_MAMBA2_PREFILL_TUNING",
                                                  '{"num_warps": 8, "block_v": 32, "out_num_warps": 8}'))


# steps of at least this many tokens run the parts' chunk kernel in its split form (a sequential state pass, then
# every chunk's output in parallel) where the caller does not choose. On an H100 (benchmarks/RESULTS.md, session 34):
# the NemotronH layer's 8k scan 1.314 -> 1.114 ms, the model's 8k prefill 67.2 -> 62.4 ms, same machine; a
# serving-shaped step (63 one-token rows and a 313-token prompt) 0.222 ms fused against 0.237 split, so shorter
# steps keep the fused form. JHYBRID_MAMBA2_SPLIT_FROM_TOKENS=0 never splits
MAMBA2_SPLIT_FROM_TOKENS = int(os.environ.get("JHYBRID_MAMBA2_SPLIT_FROM_TOKENS", "4096"))
# the parts' split form's kernel tuning where the caller gives none (`chunk_simple_gla_pallas`'s keywords, and
# `chunk_size`; JSON in JHYBRID_MAMBA2_SPLIT_TUNING, for A/B runs). Timed at NemotronH's 8k layer on an H100 and not
# taken: the sequential pass in key blocks of 32 (`state_block_k`, 4x the programs), 0.602 ms against 0.565
# (benchmarks/RESULTS.md, "Session 42"); that pass loading each chunk one iteration ahead, 0.588 against 0.580
# ("Session 43"; built, timed, removed). Taken: 128-token chunks, which halve the sequential pass's steps, with the
# output kernel at 8 warps (255 registers and a spill at 4 on the H200 compile). At the layer 0.567 -> 0.553 ms (the
# pass 0.187 -> 0.128, the output 0.142 -> 0.202); through `LLM.generate`, NemotronH's 8k prefill 47.9 / 48.1 ->
# 46.8 / 46.4 ms, interleaved on one H100 (the pass waits longer on its loads in the model than alone: 0.315 ms a
# layer in the 8k step's profile; "Session 44")
MAMBA2_SPLIT_TUNING = json.loads(os.environ.get("JHYBRID_MAMBA2_SPLIT_TUNING",
                                                '{"chunk_size": 128, "out_num_warps": 8}'))


# the dtype of the parts' scan operands (B, C and v = x dt) where the scan is the Pallas kernel: "auto" (the
# default: the conv output's dtype, so bf16 for a bf16 model and fp32 for an fp32 one), "float32" or "bfloat16"
# (JHYBRID_MAMBA2_SCAN_DTYPE). The kernel's dots, its per-chunk states (split form) and its output take v's dtype;
# its state stays fp32. As mamba_ssm's Triton SSD does (x, B, C in the input dtype, the passed chunk states in C's
# dtype). bf16 halves what XLA writes for B, C and v and what the kernel reads and writes: on an H100, the NemotronH
# layer's 8k scan 1.164 -> 0.615 ms and the model's 8k prefill 62.8 -> 54.3 ms (medians of six); a bf16 model's
# logits 1.92e-2 -> 1.98e-2 from HF's fp32 model, where HF's own bf16 model is at 1.91e-2 (benchmarks/RESULTS.md,
# session 36)
MAMBA2_SCAN_DTYPE = os.environ.get("JHYBRID_MAMBA2_SCAN_DTYPE", "auto")


def chunk_mamba2_in_parts(xbc, dt, g, d_skip, cu_seqlens, state, slot_ids, z=None, *,
                          dims: tuple[int, int, int, int], out_dtype, chunk, scan_dtype=jnp.float32):
    """`chunk_mamba2`'s result from its parts in jnp around `chunk(q, k, v, g, cu_seqlens, state, slot_ids)` (a
    chunked simple-GLA scan): SiLU over the conv output, x / B / C split from it, `v = x dt` (B, C and v in
    `scan_dtype`), the scan, the D skip `y = o + D x` in fp32, y in `out_dtype`; given the gate `z`, `y SiLU(z)` in
    fp32. `d_skip` None: the scan's output `[T, Hm, P]` in its dtype, before the skip (`z` must be None)."""
    heads, head_dim, groups, state_dim = dims
    num_tokens = xbc.shape[0]
    x = jax.nn.silu(xbc.astype(jnp.float32))
    inner = heads * head_dim
    xs = x[:, :inner].reshape(num_tokens, heads, head_dim)
    b = x[:, inner:inner + groups * state_dim].reshape(num_tokens, groups, state_dim)  # the keys
    c = x[:, inner + groups * state_dim:].reshape(num_tokens, groups, state_dim)  # the queries
    v = xs * dt.astype(jnp.float32)[..., None]
    y, state = chunk(c.astype(scan_dtype), b.astype(scan_dtype), v.astype(scan_dtype), g, cu_seqlens, state, slot_ids)
    if d_skip is None:  # the scan's output as it is (`mamba2_gated_norm` adds the skip)
        return y, state
    y = (y.astype(jnp.float32) + xs * d_skip.astype(jnp.float32)[:, None]).astype(out_dtype)
    if z is not None:
        gate = z[:, :inner].reshape(num_tokens, heads, head_dim).astype(jnp.float32)
        y = y.astype(jnp.float32) * jax.nn.silu(gate)
    return y, state


def chunk_mamba2(xbc, dt, g, d_skip, cu_seqlens, state, slot_ids, z=None, *, dims: tuple[int, int, int, int],
                 out_dtype, impl: str = "auto", interpret: bool = False, chunk_size: int | None = None, mesh=None,
                 fused: bool | None = None, scan_dtype: str | None = None, **tuning):
    """A Mamba2 mixer's chunked scan from its conv output (`chunk_mamba2_pallas` says what each argument is):
    (`y = o + D SiLU(x)` `[T, Hm, P]` in `out_dtype`, or given the gate `z` the gated norm's input in fp32; the
    state). `fused` (default `MAMBA2_FUSED_PREFILL`): the kernels reading `xbc` in place where the scan's impl is
    "pallas" (so "auto" on a GPU) and no mesh splits the heads; else `chunk_mamba2_in_parts` with
    `chunk_simple_gla` (its `impl`, `mesh`, `tuning`), whose scan operands are in `scan_dtype` (default
    `MAMBA2_SCAN_DTYPE`; "auto": `xbc`'s dtype) where that scan is the Pallas kernel. Either way the kernels' split form
    (`fused_output=False`) runs steps of `MAMBA2_SPLIT_FROM_TOKENS` tokens or more unless `tuning` names the form.
    `d_skip` None: the parts' scan output before the skip (`chunk_mamba2_in_parts`), for `mamba2_gated_norm`.
    `chunk_size` None: 64, or in the parts' split form `MAMBA2_SPLIT_TUNING`'s, whose other keywords that form takes
    where `tuning` does not set them."""
    fused = MAMBA2_FUSED_PREFILL if fused is None else fused
    scan_dtype = _scan_dtype(scan_dtype, xbc.dtype)
    heads, head_dim, groups, state_dim = dims
    q = jax.ShapeDtypeStruct((1, groups, state_dim), xbc.dtype)
    v = jax.ShapeDtypeStruct((1, heads, head_dim), xbc.dtype)
    pallas = _pick(impl, "chunk", q, v) == "pallas"
    tuning = _with_form(xbc.shape[0], tuning)
    if fused and d_skip is not None and (mesh is None or mesh.size == 1) and pallas:  # x, B, C read in xbc
        tuning = {**MAMBA2_PREFILL_TUNING, **tuning}
        return chunk_mamba2_pallas(xbc, dt, g, d_skip, cu_seqlens, state, slot_ids, z, dims=dims, out_dtype=out_dtype,
                                   chunk_size=chunk_size or 64, interpret=interpret,
                                   scan_dtype=jnp.dtype(scan_dtype).name, **tuning)
    chunk = _parts_chunk(impl, interpret, chunk_size, mesh, tuning)
    # the jnp scans keep fp32 operands (and the CPU's HF parity)
    scan_dtype = jnp.dtype(scan_dtype if pallas else jnp.float32)
    return chunk_mamba2_in_parts(xbc, dt, g, d_skip, cu_seqlens, state, slot_ids, z, dims=dims, out_dtype=out_dtype,
                                 chunk=chunk, scan_dtype=scan_dtype)


def _scan_dtype(scan_dtype: str | None, dtype) -> str:
    scan_dtype = MAMBA2_SCAN_DTYPE if scan_dtype is None else scan_dtype
    if scan_dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"Mamba2 scan_dtype must be 'auto', 'float32' or 'bfloat16', got {scan_dtype!r}")
    if scan_dtype == "auto":
        scan_dtype = "bfloat16" if dtype == jnp.bfloat16 else "float32"
    return scan_dtype


def _with_form(num_tokens: int, tuning: dict) -> dict:
    """`tuning` with the kernels' split form (`fused_output=False`) for steps of `MAMBA2_SPLIT_FROM_TOKENS` tokens
    or more, unless it names the form."""
    if "fused_output" not in tuning and 0 < MAMBA2_SPLIT_FROM_TOKENS <= num_tokens:
        return dict(tuning, fused_output=False)
    return tuning


def _parts_chunk(impl: str, interpret: bool, chunk_size: int | None, mesh, tuning: dict):
    """The parts' scan, `chunk(q, k, v, g, cu_seqlens, state, slot_ids)`: `chunk_simple_gla` with its chunk size and
    the split form's `MAMBA2_SPLIT_TUNING` where `tuning` does not set them."""
    split = dict(MAMBA2_SPLIT_TUNING) if tuning.get("fused_output") is False else {}
    split_chunk = split.pop("chunk_size", 64)  # the parts' split form's alone: the in-place form keeps 64
    return functools.partial(chunk_simple_gla, impl=impl, interpret=interpret, scale=1.0,
                             chunk_size=chunk_size or split_chunk, mesh=mesh, **{**split, **tuning})


# A Mamba2 mixer's prefill with the scan's operands written by its conv kernel (`mamba2_operands_dtype`,
# `chunk_mamba2_operands`): the conv applies the SiLU and writes x, B and C as three arrays and `v = x dt` as a
# fourth, in the scan's dtype, so that XLA no longer reads the conv output back to make B, C and v (at NemotronH's
# 8k prefill on an H100, `loop_convert_fusion` 0.93 ms and `loop_slice_fusion` 0.39 ms a step: benchmarks/RESULTS.md,
# "Session 44" §3), and the gated norm reads SiLU(x) (`x_activated`). The D skip then reads x rounded to that dtype
# after the SiLU, as HF's bf16 model does. On by default: the NemotronH-shaped 8k prefill through `LLM.generate` on
# an H100, three interleaved pairs, 48.3 / 48.2 / 48.8 ms off against 47.2 / 47.6 / 46.8 on (-2.3% by the medians;
# RESULTS "Session 46"). JHYBRID_MAMBA2_CONV_OPERANDS=0 turns it off
MAMBA2_CONV_OPERANDS = os.environ.get("JHYBRID_MAMBA2_CONV_OPERANDS", "1") == "1"


def mamba2_operands_dtype(impl: str, dims: tuple[int, int, int, int], dtype, mesh=None, scan_dtype=None):
    """The dtype in which a prefill step's conv kernel writes the scan's operands for `chunk_mamba2_operands`, or
    None where that form does not apply: `MAMBA2_CONV_OPERANDS` off, the in-place form on (`MAMBA2_FUSED_PREFILL`),
    the scan not the Pallas kernel (the jnp scans keep fp32 operands), or a mesh splitting the heads."""
    heads, head_dim, groups, state_dim = dims
    q = jax.ShapeDtypeStruct((1, groups, state_dim), dtype)
    v = jax.ShapeDtypeStruct((1, heads, head_dim), dtype)
    if (not MAMBA2_CONV_OPERANDS or MAMBA2_FUSED_PREFILL or (mesh is not None and mesh.size > 1)
            or _pick(impl, "chunk", q, v) != "pallas"):
        return None
    return jnp.dtype(_scan_dtype(scan_dtype, dtype))


def chunk_mamba2_operands(c, b, v, g, cu_seqlens, state, slot_ids, *, impl: str = "auto", interpret: bool = False,
                          chunk_size: int | None = None, mesh=None, **tuning):
    """The parts' scan of `chunk_mamba2` (the same form and tuning for the step's length) on operands made already:
    C `[T, G, N]` (the queries), B (the keys) and `v = x dt` `[T, Hm, P]`. Returns (the scan's output before the D
    skip, in v's dtype, for `mamba2_gated_norm` with `x_activated`; the state)."""
    tuning = {k: w for k, w in tuning.items() if k not in ("scan_dtype", "fused")}  # `chunk_mamba2`'s own
    chunk = _parts_chunk(impl, interpret, chunk_size, mesh, _with_form(v.shape[0], tuning))
    return chunk(c, b, v, g, cu_seqlens, state, slot_ids)


# a Mamba2 mixer's prefill output after its scan (D skip, gate, grouped RMS norm) as one kernel where "auto" runs
# on a GPU (`mamba2_gated_norm`), instead of XLA's two (the gated product written and read back in fp32). On an H100
# at NemotronH's 8k layer 0.212 -> 0.118 ms alone; in the model's 8k prefill step the kernels' sum 43.77 -> 42.38 ms
# (benchmarks/RESULTS.md, "Session 42"). JHYBRID_MAMBA2_FUSED_NORM=0 turns it off
MAMBA2_FUSED_NORM = os.environ.get("JHYBRID_MAMBA2_FUSED_NORM", "1") == "1"


def mamba2_norm_impl(impl: str, inner: int, group_size: int, mesh=None) -> str:
    """"pallas" where `mamba2_gated_norm` runs its kernel: impl "pallas", or "auto" on a GPU with
    `MAMBA2_FUSED_NORM`, on shapes it takes (`mamba2_norm.supported`), on one device; else "reference"."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown simple GLA {impl=}; choose one of {_IMPLS}")
    wanted = impl == "pallas" or (impl == "auto" and MAMBA2_FUSED_NORM and jax.default_backend() == "gpu")
    one_device = mesh is None or mesh.size == 1
    return "pallas" if wanted and one_device and mamba2_norm.supported(inner, group_size) else "reference"


def mamba2_gated_norm(o, xbc, z, d_skip, weight, *, group_size: int, eps: float, out_dtype, impl: str = "auto",
                      interpret: bool = False, mesh=None, x_activated: bool = False):
    """Same signature and result as `mamba2_gated_norm_reference`: the kernel where `mamba2_norm_impl` says so,
    else the reference."""
    heads, head_dim = o.shape[1:]
    form = dict(group_size=group_size, eps=eps, out_dtype=out_dtype, x_activated=x_activated)
    if mamba2_norm_impl(impl, heads * head_dim, group_size, mesh) == "pallas":
        return mamba2_gated_norm_pallas(o, xbc, z, d_skip, weight, **form, interpret=interpret)
    return mamba2_gated_norm_reference(o, xbc, z, d_skip, weight, **form)


# the lightning decode step as one kernel (`lightning_decode`): on (a MiniMax-shaped batch-1 token 0.892 -> 0.860 ms on
# the H200, the same logits bit for bit; benchmarks/RESULTS.md, "Session 31"); JHYBRID_LIGHTNING_FUSED_DECODE=0
LIGHTNING_FUSED_DECODE = os.environ.get("JHYBRID_LIGHTNING_FUSED_DECODE", "1") == "1"


def lightning_decode(proj, slopes, state, slot_ids, *, num_heads: int, head_dim: int, impl: str = "auto",
                     interpret: bool = False, mesh=None, fused: bool | None = None, **tuning):
    """Same signature and result as `lightning_decode_reference` (one device's unsharded packing). `fused`
    (default `LIGHTNING_FUSED_DECODE`): the one-kernel form where the recurrence's impl is "pallas" and no mesh
    splits the heads; else the parts with `fused_recurrent_simple_gla` (its `impl`, `mesh`, `tuning`)."""
    fused = LIGHTNING_FUSED_DECODE if fused is None else fused
    shape = jax.ShapeDtypeStruct((1, num_heads, head_dim), proj.dtype)
    if (fused and lightning_pallas_supported(head_dim) and (mesh is None or mesh.size == 1)
            and _pick(impl, "fused_recurrent", shape, shape) == "pallas"):
        return lightning_decode_pallas(proj, slopes, state, slot_ids, num_heads=num_heads, head_dim=head_dim,
                                       interpret=interpret, **tuning)
    recurrence = functools.partial(fused_recurrent_simple_gla, impl=impl, interpret=interpret, scale=1.0, mesh=mesh,
                                   **tuning)
    return lightning_decode_in_parts(proj, slopes, state, slot_ids, num_heads=num_heads, head_dim=head_dim,
                                     recurrence=recurrence)


__all__ = [
    "chunk_mamba2",
    "chunk_mamba2_pallas",
    "chunk_simple_gla",
    "chunk_simple_gla_pallas",
    "chunk_simple_gla_reference",
    "fused_recurrent_simple_gla",
    "fused_recurrent_simple_gla_pallas",
    "fused_recurrent_simple_gla_reference",
    "lightning_decode",
    "lightning_decode_pallas",
    "lightning_decode_reference",
    "mamba2_decode",
    "mamba2_decode_pallas",
    "mamba2_decode_reference",
    "mamba2_gated_norm",
    "mamba2_gated_norm_pallas",
    "mamba2_gated_norm_reference",
    "pallas_supported",
    "recurrent_simple_gla_reference",
]
