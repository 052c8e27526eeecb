"""The decode step of a depthwise causal convolution over state slots (the Gated DeltaNet and Mamba2 layers'
short convolution): a reference, a Pallas kernel and dispatch.

`conv_update(x, conv_state, weight, slot_ids, impl=...)`: "reference" (jnp), "pallas" (`kernel.py`; W a power of
two, C a multiple of 16) or "auto": the kernel on a GPU where it applies and `PALLAS_DECODE` is on, else the
reference. On by default since it was measured on the H200 with the one-kernel decode steps after it
(JHYBRID_CONV_UPDATE=0 turns it off).
"""

from __future__ import annotations

import os

import jax

from pallas_kernels.conv_update import prefill
from pallas_kernels.conv_update.kernel import block_channels, conv_update_pallas
from pallas_kernels.conv_update.prefill import conv_prefill_pallas
from pallas_kernels.conv_update.reference import conv_prefill_reference, conv_update_reference, finish

# on: with the other one-kernel decode steps it took a batch-1 decode token from 1.942 to 1.786 ms (qwen3_next-shaped)
# on the H200 (benchmarks/RESULTS.md, "Session 31"); JHYBRID_CONV_UPDATE=0 turns it off
PALLAS_DECODE = os.environ.get("JHYBRID_CONV_UPDATE", "1") == "1"
# steps of at least this many rows take the kernel's window form (`window=True`) at WINDOW_BLOCK channels a program:
# alone at 256 rows on the H200 it took 0.0638 ms against the taps' 0.0810; in the qwen3_next-shaped engine's decode
# step on an H100, 64 rows 4.659 -> 4.415 ms and 256 rows 11.951 -> 11.248 (benchmarks/RESULTS.md, "Session 40"); 32
# rows 3.428 -> 3.285 ms (-4.2%), 16 rows -1.4%, 8 rows +7.9% (one process each; "Session 41"), so from 32 rows.
# JHYBRID_CONV_WINDOW_ROWS sets the bound (0: the taps everywhere).
WINDOW_FROM_ROWS = int(os.environ.get("JHYBRID_CONV_WINDOW_ROWS", "32"))
WINDOW_BLOCK = 128
# a prefill (or mixed) step's conv as `prefill.py`'s kernel where "auto" runs on a GPU, instead of XLA's loop fusions
# (1.3-1.6 TB/s on an H100, benchmarks/RESULTS.md, "Session 41"). On an H100, with the Mamba2 norm kernel on, the 8k
# prefills through `LLM.generate` (two runs each, one machine): Qwen3-Next 72.9 / 71.5 -> 71.5 / 70.8 ms, NemotronH
# (52.8 with the norm kernel alone) -> 51.5 / 51.6 ("Session 42"). JHYBRID_CONV_PREFILL=0 turns it off
PALLAS_PREFILL = os.environ.get("JHYBRID_CONV_PREFILL", "1") == "1"
_IMPLS = ("auto", "reference", "pallas")


def pallas_supported(x, weight) -> bool:
    """Static check: a power-of-two kernel width and a power-of-two channel block >= 16 dividing C (the weight's
    channels: x may be wider)."""
    num_channels, width = weight.shape
    return width > 1 and width & (width - 1) == 0 and block_channels(num_channels) > 0


def resolve(impl: str, x, weight, mesh=None) -> str:
    """The implementation `conv_update` runs for `impl`: "pallas" or "reference"."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown conv update {impl=}; choose one of {_IMPLS}")
    if mesh is not None and mesh.size > 1:
        return "reference"  # XLA partitions it
    if impl == "auto":
        gpu = jax.default_backend() == "gpu"
        return "pallas" if gpu and PALLAS_DECODE and pallas_supported(x, weight) else "reference"
    if impl == "pallas" and not pallas_supported(x, weight):
        raise ValueError(f"the Pallas conv update needs a power-of-two width and C a multiple of 16, got "
                         f"{weight.shape=}; use impl='reference'")
    return impl


def conv_update(x, conv_state, weight, slot_ids, *, offset: int = 0, bias=None, activation: str | None = None,
                out_dtype=None, impl: str = "auto", interpret: bool = False, mesh=None, **tuning):
    """Same signature and result as `conv_update_reference` (`resolve` picks). `tuning` (block_c, num_warps,
    window) goes to the kernel; without it, steps of `WINDOW_FROM_ROWS` rows or more take the window form."""
    form = dict(offset=offset, bias=bias, activation=activation, out_dtype=out_dtype)
    if resolve(impl, x, weight, mesh) == "pallas":
        if not tuning and 0 < WINDOW_FROM_ROWS <= x.shape[0]:
            tuning = dict(window=True, block_c=block_channels(weight.shape[0], most=WINDOW_BLOCK))
        return conv_update_pallas(x, conv_state, weight, slot_ids, **form, interpret=interpret, **tuning)
    return conv_update_reference(x, conv_state, weight, slot_ids, **form)


def resolve_prefill(impl: str, x, weight, splits=None, mesh=None) -> str:
    """The implementation `conv_prefill` runs for `impl`: "pallas" or "reference" (`PALLAS_PREFILL` decides "auto" on
    a GPU)."""
    if impl not in _IMPLS:
        raise ValueError(f"unknown conv prefill {impl=}; choose one of {_IMPLS}")
    if mesh is not None and mesh.size > 1:
        return "reference"  # XLA partitions it
    applies = prefill.supported(x, weight, splits)
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" and PALLAS_PREFILL and applies else "reference"
    if impl == "pallas" and not applies:
        raise ValueError(f"the Pallas conv prefill needs a width of at least 2 and every split of the channels a "
                         f"multiple of 16, got {weight.shape=}, {splits=}; use impl='reference'")
    return impl


def conv_prefill(x, conv_state, weight, cu_seqlens, slot_ids, token_seq, *, offset: int = 0, bias=None,
                 activation: str | None = None, out_dtype=None, splits: tuple[int, ...] | None = None,
                 scale=None, scale_group: int = 1, impl: str = "auto", interpret: bool = False, mesh=None, **tuning):
    """Same signature and result as `conv_prefill_reference` (`resolve_prefill` picks). `tuning` (block_t, block_c,
    num_warps) goes to the kernel."""
    form = dict(offset=offset, bias=bias, activation=activation, out_dtype=out_dtype,
                splits=None if splits is None else tuple(splits), scale=scale, scale_group=scale_group)
    if resolve_prefill(impl, x, weight, splits, mesh) == "pallas":
        return conv_prefill_pallas(x, conv_state, weight, cu_seqlens, slot_ids, token_seq, **form,
                                   interpret=interpret, **tuning)
    return conv_prefill_reference(x, conv_state, weight, cu_seqlens, slot_ids, token_seq, **form)


__all__ = ["conv_prefill", "conv_prefill_pallas", "conv_prefill_reference", "conv_update", "conv_update_pallas",
           "conv_update_reference", "finish", "pallas_supported", "resolve", "resolve_prefill"]
