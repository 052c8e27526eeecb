"""The two-sub-batch pipeline (NEO-style) of a decode step with host-resident KV ("cpu" offloaded attention).

A plain step would stall the GPU at every full layer while the CPU attends over the host blocks. Here the
decode batch is split into two halves A and B (the runner spreads the host-KV rows over both) and each
half's layers run as *segments* cut at the full layers' attention:

    A: embed..q(f0) start_A(f0) | B: embed..q(f0) start_B(f0) | A: finish_A(f0) ..q(f1) start_A(f1) | B: ...

`start` (an `io_callback`) sends the half's queries to the CPU workers (`HostAttention.start`) and returns
a job id at once; `finish` blocks until the CPU's (o, lse) are ready and they are merged with the GPU part
(computed right after `start`). While the CPU attends for one half, the GPU runs the other half's segment:
its GPU attention part, its linear-attention layers and MLPs. Data dependencies alone would let XLA move
a `finish` up to its `start`, so every segment begins with an `optimization_barrier` over its own inputs
and the other half's latest outputs (its hidden state and job id): a segment (with its `finish`) cannot
run before the other half's previous segment (with its `start`) has.

What hides: per full layer the CPU part of half A against the GPU work of half B between its two full
layers (and vice versa); `HostAttention.stats.cpu_wait_seconds` is the time `finish` still waited. The
pipeline costs two smaller GPU batches instead of one (more kernel launches, smaller matmuls).
The layer bodies are `jhybrid.models.hybrid`'s and `jhybrid.models.attention`'s pieces; the loop mirrors
`jhybrid.models.hybrid.forward` (decode only, no tensor parallelism).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import io_callback

from jhybrid.cache.state import HybridState
from jhybrid.config import ModelConfig
from jhybrid.models.attention import attention_out, attention_qkv, device_part
from jhybrid.models.batch import Batch
from jhybrid.models.hybrid import _linear_mixer, _residual, embed, lm_head, mlp_block
from jhybrid.models.layers import rms_norm, rope_inv_freq
from pallas_kernels.paged_attention import merge_attention


def _half(batch: Batch, lo: int, hi: int) -> Batch:
    """Decode rows [lo, hi) (one token each) as a batch of their own."""
    n = hi - lo
    return Batch(token_ids=batch.token_ids[lo:hi], positions=batch.positions[lo:hi],
                 token_seq=jnp.clip(batch.token_seq[lo:hi] - lo, 0, n - 1), slot_mapping=batch.slot_mapping[lo:hi],
                 cu_seqlens=jnp.arange(n + 1, dtype=batch.cu_seqlens.dtype), block_tables=batch.block_tables[lo:hi],
                 slot_ids=batch.slot_ids[lo:hi], logits_index=jnp.arange(n, dtype=batch.logits_index.dtype))


@dataclasses.dataclass
class _Half:
    batch: Batch
    x: jax.Array  # [n, D] hidden state
    first_row: int  # its rows are the step's rows first_row .. first_row + n - 1
    offsets: jax.Array  # [n] host tokens of each row (0: none; the CPU skips those rows)
    job: jax.Array  # int32 scalar: the pending CPU job (0: none)
    pending: tuple | None = None  # (normed, x, gate, o_dev, lse_dev, p) of the full layer awaiting its CPU part


def forward_pipelined(cfg: ModelConfig, params: dict, state: HybridState, batch: Batch, host, *, kernels: dict):
    """`jhybrid.models.hybrid.forward` for a decode batch with host-KV rows (`host`: the step's
    `jhybrid.engine.offload.HostPart`), run as two pipelined halves. Returns (logits `[B, V]`, state)."""
    attn = host.attn
    num_rows = batch.token_ids.shape[0]
    half = max(1, num_rows // 2)
    x_all = embed(cfg, params, batch)
    halves = [_Half(batch=_half(batch, lo, hi), x=x_all[lo:hi], first_row=lo, offsets=host.row_lengths[lo:hi],
                    job=jnp.zeros((), jnp.int32)) for lo, hi in ((0, half), (half, num_rows))]
    inv_freq = rope_inv_freq(cfg)
    caches = dict(k=list(state.k_pages), v=list(state.v_pages), conv=list(state.conv), ssm=list(state.ssm))
    layers = list(zip(cfg.layer_kinds, cfg.mlp_kinds, params["layers"]))
    full = [i for i, (kind, _, _) in enumerate(layers) if kind == "full_attention"]
    bounds = [-1] + full + [len(layers)]  # segment g: finish full[g-1], layers between, start full[g]
    lin_index = {}
    for i, (kind, _, _) in enumerate(layers):
        if kind not in ("none", "full_attention"):
            lin_index[i] = len(lin_index)

    for g in range(len(bounds) - 1):
        for me, other in ((0, 1), (1, 0)):
            h, o = halves[me], halves[other]
            # this segment runs after the other half's previous one (and its `start`): see the docstring
            h.x, h.job, _, _ = jax.lax.optimization_barrier((h.x, h.job, o.x, o.job))
            if h.pending is not None:  # the CPU part of full layer full[g-1]
                normed, x_in, gate, o_dev, lse_dev, p = h.pending
                shapes = (jax.ShapeDtypeStruct(o_dev.shape, jnp.float32), jax.ShapeDtypeStruct(lse_dev.shape, jnp.float32))
                o_cpu, lse_cpu = io_callback(attn.finish, shapes, h.job, ordered=False)  # -inf: no host KV
                o_att, _ = merge_attention(o_dev, lse_dev, o_cpu, lse_cpu)
                out = attention_out(cfg, p["attn"], o_att, gate, x_in.dtype)
                x = _residual(normed if cfg.residual_from_norm else x_in, out, cfg.full_attn_alpha, cfg.full_attn_beta)
                h.x = mlp_block(cfg, layers[bounds[g]][1], p, x)
                h.pending = None
            for i in range(bounds[g] + 1, bounds[g + 1]):
                kind, mlp_kind, p = layers[i]
                if kind != "none":
                    j = lin_index[i]
                    normed = rms_norm(h.x, p["input_norm"], cfg.rms_norm_eps, cfg.norm_zero_centred)
                    out, caches["conv"][j], caches["ssm"][j] = _linear_mixer(
                        cfg, kind, p, normed, caches["conv"][j], caches["ssm"][j], h.batch, i, True, kernels)
                    h.x = _residual(normed if cfg.residual_from_norm else h.x, out, cfg.linear_attn_alpha,
                                    cfg.linear_attn_beta)
                h.x = mlp_block(cfg, mlp_kind, p, h.x)
            if g < len(full):  # full layer full[g]: its GPU part now, its CPU part started
                f = g  # the g-th full layer owns caches["k"][g]
                _, _, p = layers[full[g]]
                normed = rms_norm(h.x, p["input_norm"], cfg.rms_norm_eps, cfg.norm_zero_centred)
                q, gate, caches["k"][f], caches["v"][f], _ = attention_qkv(
                    cfg, p["attn"], normed, caches["k"][f], caches["v"][f], h.batch, inv_freq, kernels)
                n = q.shape[0]
                h.job = io_callback(functools.partial(attn.start, f), jax.ShapeDtypeStruct((), jnp.int32), host.step,
                                    jnp.int32(h.first_row), q.astype(jnp.float32), h.offsets, ordered=False)
                o_dev, lse_dev = device_part(cfg, q, caches["k"][f], caches["v"][f], h.batch, h.offsets, True, kernels)
                h.pending = (normed, h.x, gate, o_dev, lse_dev, p)
                h.x = o_dev.reshape(n, -1)[:, :1].astype(h.x.dtype)  # progress marker for the barrier only
    x = jnp.concatenate([h.x for h in halves])[batch.logits_index]
    logits = lm_head(cfg, params, x)
    new_state = dataclasses.replace(state, k_pages=tuple(caches["k"]), v_pages=tuple(caches["v"]),
                                    conv=tuple(caches["conv"]), ssm=tuple(caches["ssm"]))
    return logits, new_state
