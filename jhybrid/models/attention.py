"""Full softmax attention over the paged KV cache (Qwen3-Next/3.5 gated variant, Qwen3, Llama, and the
hybrids' attention layers; Granite sets its own softmax scale, `cfg.attention_scale`)."""

from __future__ import annotations

import jax
from jaxtyping import Array, Float

from jhybrid.config import ModelConfig
from jhybrid.models.batch import Batch
from jhybrid.models.layers import apply_rope, rms_norm
from jhybrid.models.quant import in_projection, out_projection
from jhybrid.parallel.layout import num_shards, split_packed
from pallas_kernels import paged_attention, write_kv_pages
from pallas_kernels.paged_attention import (
    decode_prologue_applies,
    decode_prologue_pallas,
    merge_attention,
    paged_attention_decode_pallas,
)


def attention_layer(
    cfg: ModelConfig,
    p: dict,
    x: Float[Array, "T D"],
    k_pages: Array,
    v_pages: Array,
    batch: Batch,
    inv_freq: Array,
    decode: bool = False,
    kernels: dict | None = None,
    host=None,
    io: dict | None = None,
) -> tuple[Float[Array, "T D"], Array, Array]:
    """Projects, normalises and rotates q/k, writes this step's K/V into the pages, attends causally over
    each row's cache, gates (if the family does) and projects out. Returns (out, k_pages, v_pages).

    `host` (offloaded attention, `jhybrid.engine.offload.HostPart.layer(i)`): rows whose oldest KV blocks
    are in the host tier. Their block tables then hold only the device blocks, which start at position
    `host.offsets[t]` (a multiple of the block size), so the GPU part attends with positions shifted by
    it (RoPE already used the true positions); `host(q)` returns the host part's (o, lse) and the two are
    merged by LSE.

    `io` (a decode step without host KV: `jhybrid.models.hybrid._fused_io`): x is the layer's input before its norm,
    which the qkv projection's kernel applies, and out holds the residual added by the o projection's kernel."""
    kernels = kernels or {}
    dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    if (decode and host is None and not cfg.attention_bias and decode_prologue_applies(
            dims, 2 * inv_freq.shape[0], k_pages, impl=kernels.get("impl", "auto"), mesh=kernels.get("mesh"))):
        return _decode_in_one_prologue(cfg, p, x, k_pages, v_pages, batch, inv_freq, kernels, io)
    q, gate, k_pages, v_pages, new_kv = attention_qkv(cfg, p, x, k_pages, v_pages, batch, inv_freq, kernels, io)
    if host is None:
        o = paged_attention(
            q, k_pages, v_pages, batch.block_tables, batch.token_seq, batch.positions,
            cu_seqlens=batch.cu_seqlens, decode=decode, scale=cfg.attention_scale, new_kv=new_kv, **kernels,
        )
    else:
        o_dev, lse_dev = device_part(cfg, q, k_pages, v_pages, batch, host.offsets, decode, kernels, new_kv)
        o, _ = merge_attention(o_dev, lse_dev, *host(q))
    return attention_out(cfg, p, o, gate, x.dtype, io), k_pages, v_pages


def _decode_in_one_prologue(cfg: ModelConfig, p: dict, x, k_pages, v_pages, batch: Batch, inv_freq, kernels: dict,
                            io: dict | None):
    """`attention_layer`'s decode step with the layer's work up to the attention in one kernel
    (`decode_prologue_pallas`: norms, RoPE, the K/V written, the queries padded as the decode kernel takes them)."""
    h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = in_projection(x, p["qkv_proj"], io)
    interpret = kernels.get("interpret", False)
    norms = (p["q_norm"], p["k_norm"]) if cfg.qk_norm else (None, None)
    q4, k_pages, v_pages = decode_prologue_pallas(
        qkv, *norms, batch.positions, inv_freq, batch.slot_mapping, k_pages, v_pages, dims=(h, kvh, hd),
        gate=cfg.attn_output_gate, eps=cfg.rms_norm_eps, zero_centred=cfg.norm_zero_centred, interpret=interpret)
    tuning = {k: v for k, v in kernels.items() if k in ("pages_per_block", "num_splits", "num_warps", "num_stages",
                                                          "per_page")}
    o = paged_attention_decode_pallas(q4, k_pages, v_pages, batch.block_tables, batch.token_seq, batch.positions,
                                      scale=cfg.attention_scale, group=h // kvh, interpret=interpret, **tuning)
    gate = None
    if cfg.attn_output_gate:  # per head: hd query dims, then hd gate dims
        gate = qkv[:, : 2 * h * hd].reshape(qkv.shape[0], h, 2, hd)[:, :, 1].reshape(qkv.shape[0], h * hd)
    return attention_out(cfg, p, o, gate, x.dtype, io), k_pages, v_pages


def attention_qkv(
    cfg: ModelConfig, p: dict, x: Float[Array, "T D"], k_pages: Array, v_pages: Array, batch: Batch, inv_freq: Array,
    kernels: dict | None = None, io: dict | None = None,
) -> tuple[Float[Array, "T H hd"], Array | None, Array, Array, tuple[Array, Array]]:
    """The layer up to the attention: q `[T, H, hd]` (normalised, rotated), the output gate `[T, H*hd]` (or
    None), the pages with this step's K/V written, and that K/V `([T, KVH, hd], [T, KVH, hd])`."""
    num_tokens = x.shape[0]
    h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_out = h * hd * (2 if cfg.attn_output_gate else 1)
    qkv = in_projection(x, p["qkv_proj"], io)  # [T, Q + 2*KVH*hd]: the packed q, k, v projections
    if cfg.attention_bias:
        qkv = qkv + p["qkv_bias"]
    shards = num_shards((kernels or {}).get("mesh"))  # packed shard-major under tensor parallelism
    q, k, v = split_packed(qkv, (q_out, kvh * hd, kvh * hd), shards)
    gate = None
    if cfg.attn_output_gate:
        q = q.reshape(num_tokens, h, 2, hd)  # per head: hd query dims, then hd gate dims
        q, gate = q[:, :, 0], q[:, :, 1].reshape(num_tokens, h * hd)
    q = q.reshape(num_tokens, h, hd)
    k = k.reshape(num_tokens, kvh, hd)
    v = v.reshape(num_tokens, kvh, hd)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps, cfg.norm_zero_centred)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps, cfg.norm_zero_centred)
    q = apply_rope(q, batch.positions, inv_freq)
    k = apply_rope(k, batch.positions, inv_freq)
    k_pages, v_pages = write_kv_pages(k_pages, v_pages, k, v, batch.slot_mapping)
    return q, gate, k_pages, v_pages, (k, v)


def device_part(cfg: ModelConfig, q, k_pages, v_pages, batch: Batch, offsets, decode: bool, kernels: dict | None,
                new_kv=None):
    """Offloaded attention's GPU part: (o `[T, H, hd]`, lse `[T, H]`) over the device blocks, whose first key
    sits at position `offsets[t]` of the sequence."""
    return paged_attention(
        q, k_pages, v_pages, batch.block_tables, batch.token_seq, batch.positions - offsets,
        cu_seqlens=batch.cu_seqlens, decode=decode, scale=cfg.attention_scale, return_lse=True, new_kv=new_kv,
        **(kernels or {}),
    )


def attention_out(cfg: ModelConfig, p: dict, o: Float[Array, "T H hd"], gate: Array | None, dtype,
                  io: dict | None = None) -> Float[Array, "T D"]:
    """Gates (if the family does) and projects the attention output out (with `io`: plus the residual)."""
    o = o.reshape(o.shape[0], -1)
    if gate is not None:
        o = o * jax.nn.sigmoid(gate)
    o = out_projection(o, p["o_proj"], io)
    if cfg.attention_bias:
        o = o + p["o_bias"]
    return o.astype(dtype)
