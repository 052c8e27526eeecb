"""Layers shared by the model families: norms, rotary embedding, MLPs, mixture of experts, causal conv."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def rms_norm(x: Float[Array, "... D"], w: Float[Array, "D"], eps: float, zero_centred: bool) -> Array:
    """RMSNorm in fp32. `zero_centred` (Qwen3-Next/3.5) scales by `1 + w` before casting back; otherwise
    (Llama/Qwen3) the normalised input is cast back first and scaled by `w`, as HF does."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if zero_centred:
        return (xf * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return w * xf.astype(x.dtype)


def gated_rms_norm(x: Float[Array, "... V"], gate: Float[Array, "... V"], w: Float[Array, "V"], eps: float) -> Array:
    """Gated DeltaNet output norm: `w * rmsnorm(x) * silu(gate)` with a plain (not zero-centred) weight."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    out = (w * xf.astype(x.dtype)).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    return out.astype(x.dtype)


def l2_normalize(x: Array, eps: float = 1e-6) -> Array:
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def rope_inv_freq(cfg) -> Array:
    """Inverse frequencies `[rotary_dim / 2]` (default, linear and llama3 scaling)."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
    if cfg.rope_type == "linear":
        inv = inv / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        low_wavelen = cfg.rope_original_max_position / cfg.rope_low_freq_factor
        high_wavelen = cfg.rope_original_max_position / cfg.rope_high_freq_factor
        wavelen = 2 * jnp.pi / inv
        smooth = (cfg.rope_original_max_position / wavelen - cfg.rope_low_freq_factor) / (
            cfg.rope_high_freq_factor - cfg.rope_low_freq_factor
        )
        mid = (1 - smooth) * inv / cfg.rope_factor + smooth * inv
        inv = jnp.where(wavelen > low_wavelen, inv / cfg.rope_factor, jnp.where(wavelen < high_wavelen, inv, mid))
    return inv


def apply_rope(x: Float[Array, "T NH D"], positions: Int[Array, "T"], inv_freq: Float[Array, "R"]) -> Array:
    """Rotate-half RoPE on the first `2R` dims of each head; the remaining dims pass through."""
    rot = 2 * inv_freq.shape[0]
    if rot == 0:
        return x
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, R]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, None, :]  # [T, 1, 2R]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


def dense_mlp(p: dict, x: Float[Array, "T D"]) -> Array:
    """SwiGLU MLP: `down(silu(gate(x)) * up(x))` with gate and up packed in `gate_up_proj [D, 2I]`."""
    gate_up = x @ p["gate_up_proj"]
    if "gate_up_bias" in p:
        gate_up = gate_up + p["gate_up_bias"]
    gate, up = jnp.split(gate_up, 2, axis=-1)
    out = (jax.nn.silu(gate) * up) @ p["down_proj"]
    return out + p["down_bias"] if "down_bias" in p else out


def moe(p: dict, x: Float[Array, "T D"], top_k: int, norm_topk_prob: bool) -> Array:
    """Top-k softmax-routed experts plus an optional sigmoid-gated shared expert (Qwen3-Next).

    Every expert runs on every token and the combine weights zero the unrouted ones: exact, simple, and
    E times the routed FLOPs; a grouped (sorted) expert matmul replaces it in the kernels work.
    """
    logits = x @ p["router"]  # [T, E]
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, top_k)  # [T, k]
    if norm_topk_prob:
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    combine = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], top_i].set(top_p)  # [T, E]
    combine = combine.astype(x.dtype)
    gate, up = jnp.split(jnp.einsum("td,edi->tei", x, p["gate_up_proj"]), 2, axis=-1)  # [T, E, Ie] x2
    h = jax.nn.silu(gate) * up
    out = jnp.einsum("tei,eid,te->td", h, p["down_proj"], combine)  # [T, D]
    if "shared" in p:
        out = out + jax.nn.sigmoid(x @ p["shared_gate"]) * dense_mlp(p["shared"], x)
    return out


def causal_conv1d(
    x: Float[Array, "T C"],
    conv_state: Float[Array, "S C W1"],
    weight: Float[Array, "C W"],
    cu_seqlens: Int[Array, "B+1"],
    slot_ids: Int[Array, "B"],
    token_seq: Int[Array, "T"],
) -> tuple[Float[Array, "T C"], Float[Array, "S C W1"]]:
    """Depthwise causal conv over packed sequences, continuing from each row's conv-state slot.

    `conv_state[s]` holds the last `W - 1` inputs of the sequence in slot s (oldest first); slot 0 (the
    null slot) reads as zeros. Returns the conv output (before activation, in x's dtype) and the state with
    each row's slot holding its last `W - 1` inputs.
    """
    num_tokens = x.shape[0]
    width = weight.shape[1]
    hist = width - 1
    h0 = conv_state[slot_ids]  # [B, C, W-1]
    h0 = jnp.where((slot_ids == 0)[:, None, None], 0.0, h0)
    xf = x.astype(jnp.float32)
    t = jnp.arange(num_tokens)
    local = t - cu_seqlens[token_seq]  # index of the token inside this step's part of its sequence
    out = jnp.zeros_like(xf)
    for i in range(width):
        d = width - 1 - i  # tap i reads the input d tokens back
        src_local = local - d
        from_x = xf[jnp.maximum(t - d, 0)]
        from_state = h0[token_seq, :, jnp.clip(hist + src_local, 0, max(hist - 1, 0))] if hist else from_x
        tap = jnp.where((src_local >= 0)[:, None], from_x, from_state)
        out = out + tap * weight[:, i].astype(jnp.float32)
    # new state: the last W-1 entries of [h0, this step's tokens]
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [B]
    idx = lengths[:, None] + jnp.arange(hist)[None, :]  # [B, W-1] index into the concatenation
    from_x = xf[jnp.clip(cu_seqlens[:-1, None] + idx - hist, 0, num_tokens - 1)]  # [B, W-1, C]
    from_h0 = jnp.take_along_axis(h0, jnp.clip(idx, 0, max(hist - 1, 0))[:, None, :], axis=2)  # [B, C, W-1]
    new = jnp.where((idx < hist)[:, None, :], from_h0, from_x.transpose(0, 2, 1))
    return out.astype(x.dtype), conv_state.at[slot_ids].set(new.astype(conv_state.dtype))
