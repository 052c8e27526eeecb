"""Decode attention on the CPU over KV blocks resident in the host tier (NumPy, no JAX), returning (o, lse)
so that `pallas_kernels.paged_attention.merge.merge_attention` can combine it with the GPU's part.

Status: wired into the engine as offloaded attention (`kv_offload="cpu"`, off by default; the engine side is
`jhybrid.engine.offload` and `jhybrid.engine.pipeline`; tests in tests/test_offload_attention.py). The design:

* Placement. A long sequence keeps its oldest `n_host` blocks in the host tier (whole blocks, the same
  layout as the device pool: `[HP, BS, KVH, hd]` per full layer) and the rest on the GPU. The host part is
  append-free: new tokens are always written on the GPU, and blocks move to the host only when they are
  old (a block table row becomes `host_table[:n_host] + device_table`). The GPU kernel reads the device
  blocks as today (positions offset by `n_host * BS`: the kernel uses positions only for the causal bound,
  RoPE was applied before the cache write), returning (o_gpu, lse_gpu); the CPU reads the host blocks
  (this function), returning (o_cpu, lse_cpu); the layer output is
  `merge_attention(o_gpu, lse_gpu, o_cpu, lse_cpu)`. A row with nothing on the host has lse_cpu = -inf.
* Overlap. Per layer the CPU part needs q (after the layer's projections and RoPE) and the layer's output
  needs the CPU's (o, lse), and layer i+1's input is layer i's output: the CPU cannot lag across layers
  (an earlier note here proposed letting it run "one layer ahead"; that is wrong for exactly this reason,
  even when the layers in between are linear-attention layers: they consume layer i's output). So a naive
  placement stalls every full layer on a D2H of q plus the CPU's attention plus an H2D. What can overlap is
  *other rows'* work: NEO-style two sub-batches (`jhybrid.engine.pipeline`): the decode batch is split
  into halves A and B; while the CPU attends for A's layer i, the GPU runs B's segment (its GPU attention
  part, then its layers up to its next full layer), and vice versa. Full layers are 1 in 4 in the target
  models, so three linear layers and four MLPs of the other half cover each CPU part.
  The CPU's work per step is `2 * n_host_tokens * KVH * hd * itemsize` bytes per full layer from host
  memory, so the CPU part hides when host memory bandwidth / (those bytes) exceeds the rate of the other
  half's GPU segments.
* What the H200 run measures (benchmarks/offload.py): host-device bandwidth, host memory bandwidth, this
  function's rate per full layer versus copying the blocks to the GPU and attending there, and end to end:
  recompute and swap preemption versus offloading with CPU attention (synchronous and pipelined) versus
  offloading with the blocks copied to the GPU every step ("copy"); CPU attention goes on by default only
  where it wins.
"""

from __future__ import annotations

import numpy as np


def host_paged_attention(
    q: np.ndarray,  # [B, H, D] one decode query per row
    k_pages: np.ndarray,  # [HP, BS, KVH, D] host KV of one full layer
    v_pages: np.ndarray,  # [HP, BS, KVH, D]
    block_tables: np.ndarray,  # [B, M] host block ids of each row, in position order
    lengths: np.ndarray,  # [B] host tokens of each row (keys 0..lengths[b]-1); 0: nothing on the host
    *,
    scale: float | None = None,
    soft_cap: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Attention of each row's query over all of its host-resident keys (they precede the query, so no
    causal mask applies within them).

    Returns:
      `o [B, H, D]` fp32 (0 for an empty row) and `lse [B, H]` fp32 (-inf for an empty row).
    """
    num_rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} must be a multiple of kv heads {num_kv_heads}")
    if block_tables.shape[0] != num_rows or lengths.shape != (num_rows,):
        raise ValueError(f"need block_tables [B, M] and lengths [B] for B={num_rows}, got {block_tables.shape=} "
                         f"{lengths.shape=}")
    if np.any(lengths > block_tables.shape[1] * block_size) or np.any(lengths < 0):
        raise ValueError(f"lengths {lengths} exceed the block tables' {block_tables.shape[1]} blocks of {block_size}")
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    o = np.zeros((num_rows, num_heads, head_dim), np.float32)
    lse = np.full((num_rows, num_heads), -np.inf, np.float32)
    for b in range(num_rows):
        n = int(lengths[b])
        if n == 0:
            continue
        pages = block_tables[b, : -(-n // block_size)]
        k = _gather_f32(k_pages, pages, n)  # [KVH, S, D] fp32, contiguous
        v = _gather_f32(v_pages, pages, n)
        q_g = q[b].astype(np.float32).reshape(num_kv_heads, group, head_dim)  # [KVH, G, D]
        s = np.matmul(q_g, k.transpose(0, 2, 1)) * scale  # [KVH, G, S]
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - m)
        denom = p.sum(axis=-1, keepdims=True)
        o[b] = (np.matmul(p, v) / denom).reshape(num_heads, head_dim)
        lse[b] = (m + np.log(denom))[..., 0].reshape(num_heads)
    return o, lse


def _gather_f32(pages: np.ndarray, ids: np.ndarray, n: int) -> np.ndarray:
    """Pages `ids` of `[P, BS, KVH, D]` as one fp32 `[KVH, S, D]` array (first n keys; one gather, one cast).

    bfloat16 is widened by shifting its bits (uint16 -> uint32 << 16): ml_dtypes' own cast runs at about
    1 GB/s and holds the GIL, so worker threads could not run it in parallel; integer casts and shifts are
    plain NumPy loops that release it."""
    num_kv_heads, head_dim = pages.shape[2], pages.shape[3]
    if pages.dtype.name == "bfloat16":
        x = pages.view(np.uint16)[ids].transpose(2, 0, 1, 3)  # [KVH, NB, BS, D]
        wide = np.ascontiguousarray(x, dtype=np.uint32)
        wide <<= 16
        out = wide.view(np.float32)
    else:
        out = np.ascontiguousarray(pages[ids].transpose(2, 0, 1, 3), dtype=np.float32)
    return out.reshape(num_kv_heads, -1, head_dim)[:, :n]
