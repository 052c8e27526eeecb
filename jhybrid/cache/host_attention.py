"""Decode attention on the CPU over KV blocks resident in the host tier (NumPy, no JAX), returning (o, lse)
so that `pallas_kernels.paged_attention.merge.merge_attention` can combine it with the GPU's part.

Status: the function and its merge are built and tested (tests/test_host_tier.py); offloaded attention is
NOT wired into the engine yet. The design it is meant for:

* Placement. A long sequence keeps its oldest `n_host` blocks in the host tier (whole blocks, the same
  layout as the device pool: `[HP, BS, KVH, hd]` per full layer) and the rest on the GPU. The host part is
  append-free: new tokens are always written on the GPU, and blocks move to the host only when they are
  old (a block table row becomes `host_table[:n_host] + device_table`). The GPU kernel reads the device
  blocks as today (positions offset by `n_host * BS`, a sliding-window-style lower bound), returning
  (o_gpu, lse_gpu); the CPU reads the host blocks (this function), returning (o_cpu, lse_cpu); the layer
  output is `merge_attention(o_gpu, lse_gpu, o_cpu, lse_cpu)`. A sequence with nothing on the host passes
  lse_cpu = -inf (weight 0).
* Overlap. Per layer the CPU part needs q (after the layer's projections and RoPE) and the GPU needs the
  CPU's (o, lse) before the output projection, so a naive placement stalls every full layer on a D2H of q
  plus the CPU's attention plus an H2D. Two ways to hide it, to be chosen by measurement:
  1. NEO-style two sub-batches: split the decode batch into A (sequences with host KV) and B (the rest);
     the GPU runs B's layer i (and A's non-attention work) while the CPU runs A's attention for layer i;
     host callbacks (`jax.pure_callback` / `io_callback` with an ordered effect) or a split jitted step
     per full layer carry q out and (o, lse) back. Full layers are 1 in 4 in the target models, so the
     three linear layers between them are the GPU work that covers the CPU's attention.
  2. Layer-ahead: the CPU computes layer i's host attention while the GPU runs layers i..i+3 (the linear
     layers do not need it), merging at layer i's output projection; only q must be ready early.
  Either way the CPU's work per step is `2 * n_host_tokens * KVH * hd * itemsize` bytes per full layer from
  host memory, so the CPU part hides when host memory bandwidth / (those bytes) exceeds the GPU step rate.
* What the H200 run must measure (benchmarks/offload.py): host-device bandwidth (pinned and pageable),
  host memory bandwidth (a NumPy read), this function's rate in tokens of host KV per second (with threads),
  and end-to-end decode throughput with CPU attention over host KV versus copying those blocks to the GPU
  every step (the alternative this must beat); CPU attention goes on by default only where it wins.
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
        k = k_pages[pages].reshape(-1, num_kv_heads, head_dim)[:n].astype(np.float32)  # [S, KVH, D]
        v = v_pages[pages].reshape(-1, num_kv_heads, head_dim)[:n].astype(np.float32)
        q_g = q[b].astype(np.float32).reshape(num_kv_heads, group, head_dim)  # [KVH, G, D]
        s = np.einsum("kgd,skd->kgs", q_g, k) * scale  # [KVH, G, S]
        if soft_cap is not None:
            s = soft_cap * np.tanh(s / soft_cap)
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - m)
        denom = p.sum(axis=-1, keepdims=True)
        o[b] = (np.einsum("kgs,skd->kgd", p, v) / denom).reshape(num_heads, head_dim)
        lse[b] = (m + np.log(denom))[..., 0].reshape(num_heads)
    return o, lse
