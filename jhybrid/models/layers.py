"""Layers shared by the model families: norms, rotary embedding, MLPs, mixture of experts, causal conv."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jhybrid.models.quant import expert_weights, linear
from jhybrid.parallel.layout import split_packed


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


def dense_mlp(p: dict, x: Float[Array, "T D"], act: str = "silu", num_shards: int = 1) -> Array:
    """`act="silu"`: SwiGLU `down(silu(gate(x)) * up(x))` with gate and up packed in `gate_up_proj [D, 2I]`
    (shard-major over `num_shards` under tensor parallelism, `jhybrid.parallel.layout`);
    `act="relu2"` (NemotronH): `down(relu(up(x))^2)`, no gate."""
    if act == "relu2":
        up = linear(x, p["up_proj"])
        if "up_bias" in p:
            up = up + p["up_bias"]
        out = linear(jnp.square(jax.nn.relu(up)), p["down_proj"])
        return out + p["down_bias"] if "down_bias" in p else out
    gate_up = linear(x, p["gate_up_proj"])
    if "gate_up_bias" in p:
        gate_up = gate_up + p["gate_up_bias"]
    half = gate_up.shape[-1] // 2
    gate, up = split_packed(gate_up, (half, half), num_shards)
    out = linear(jax.nn.silu(gate) * up, p["down_proj"])
    return out + p["down_bias"] if "down_bias" in p else out


def moe(p: dict, x: Float[Array, "T D"], top_k: int, norm_topk_prob: bool, *, act: str = "silu",
        router: str = "softmax", n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
        num_shards: int = 1) -> Array:
    """Top-k routed experts plus an optional shared expert (sigmoid-gated when `shared_gate` is present).

    router "softmax" (Qwen3-Next, MiniMax): weights = top-k of softmax(logits), optionally renormalised.
    router "sigmoid_group" (NemotronH): scores = sigmoid(logits); experts are chosen by top-k of
    `scores + router_bias` within the `topk_group` best of `n_group` expert groups (a group's merit: the sum
    of its two best biased scores); weights = the chosen unbiased scores, renormalised (+1e-20) if
    `norm_topk_prob`, times `scaling`. Experts are SwiGLU (`act="silu"`) or `relu(up(x))^2` (`"relu2"`).

    Every expert runs on every token and the combine weights zero the unrouted ones: exact, simple, and
    E times the routed FLOPs; a grouped (sorted) expert matmul replaces it in the kernels work. FP8 experts
    (`jhybrid.models.quant.Fp8Weight`) are dequantized to `x`'s dtype here, this layer's only (`expert_weights`).
    """
    num_tokens = x.shape[0]
    if router == "softmax":
        probs = jax.nn.softmax((x @ p["router"]).astype(jnp.float32), axis=-1)  # [T, E]
        top_p, top_i = jax.lax.top_k(probs, top_k)  # [T, k]
        if norm_topk_prob:
            top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    else:  # HF routes in fp32
        probs = scores = jax.nn.sigmoid(x.astype(jnp.float32) @ p["router"].astype(jnp.float32))  # [T, E]
        choice = scores + p["router_bias"].astype(jnp.float32)  # [T, E]
        num_experts = choice.shape[-1]
        grouped = choice.reshape(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
        group_merit = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
        _, top_groups = jax.lax.top_k(group_merit, topk_group)  # [T, topk_group]
        group_ok = jnp.zeros((num_tokens, n_group), bool).at[jnp.arange(num_tokens)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(group_ok, num_experts // n_group, axis=-1), choice, -jnp.inf)
        _, top_i = jax.lax.top_k(choice, top_k)
        top_p = jnp.take_along_axis(scores, top_i, axis=-1)
        if norm_topk_prob:
            top_p = top_p / (jnp.sum(top_p, axis=-1, keepdims=True) + 1e-20)
        top_p = top_p * scaling
    combine = jnp.zeros_like(probs).at[jnp.arange(num_tokens)[:, None], top_i].set(top_p)  # [T, E]
    combine = combine.astype(x.dtype)
    w_in, w_down = expert_weights(x, p["up_proj" if act == "relu2" else "gate_up_proj"], p["down_proj"])
    if act == "relu2":
        h = jnp.square(jax.nn.relu(jnp.einsum("td,edi->tei", x, w_in)))  # [T, E, Ie]
    else:
        gate, up = jnp.split(jnp.einsum("td,edi->tei", x, w_in), 2, axis=-1)  # [T, E, Ie] x2
        h = jax.nn.silu(gate) * up
    out = jnp.einsum("tei,eid,te->td", h, w_down, combine)  # [T, D]
    if "shared" in p:
        shared = dense_mlp(p["shared"], x, act, num_shards)
        out = out + (jax.nn.sigmoid(x @ p["shared_gate"]) * shared if "shared_gate" in p else shared)
    return out


def grouped_gated_rms_norm(x: Float[Array, "T I"], gate: Float[Array, "T I"], w: Float[Array, "I"], group_size: int,
                           eps: float) -> Array:
    """Mamba2 output norm (norm after the gate): `w * rmsnorm_per_group(x * silu(gate))`, the RMS taken over
    consecutive groups of `group_size` channels (NemotronH: one group per B/C group)."""
    num_tokens, dim = x.shape
    h = x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    h = h.reshape(num_tokens, dim // group_size, group_size)  # [T, G, I/G]
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return w * h.reshape(num_tokens, dim).astype(x.dtype)


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
    # the rows' history with the channels minor, written once: every token's tap then reads a contiguous row
    # of C values (gathering from [B, C, W-1] directly strides by W-1 floats per channel: on the H200 that
    # gather made the conv several times slower than its bytes)
    h0t = jax.lax.optimization_barrier(h0.transpose(0, 2, 1))  # [B, W-1, C]
    xf = x.astype(jnp.float32)
    t = jnp.arange(num_tokens)
    local = t - cu_seqlens[token_seq]  # index of the token inside this step's part of its sequence
    out = jnp.zeros_like(xf)
    for i in range(width):
        d = width - 1 - i  # tap i reads the input d tokens back
        src_local = local - d
        from_x = jnp.pad(xf, ((d, 0), (0, 0)))[:num_tokens] if d else xf  # x[t - d] (a static shift, not a gather)
        from_state = h0t[token_seq, jnp.clip(hist + src_local, 0, max(hist - 1, 0))] if hist else from_x
        tap = jnp.where((src_local >= 0)[:, None], from_x, from_state)
        out = out + tap * weight[:, i].astype(jnp.float32)
    # new state: the last W-1 entries of [h0, this step's tokens]
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [B]
    idx = lengths[:, None] + jnp.arange(hist)[None, :]  # [B, W-1] index into the concatenation
    from_x = xf[jnp.clip(cu_seqlens[:-1, None] + idx - hist, 0, num_tokens - 1)]  # [B, W-1, C]
    from_h0 = jnp.take_along_axis(h0t, jnp.clip(idx, 0, max(hist - 1, 0))[:, :, None], axis=1)  # [B, W-1, C]
    new = jnp.where((idx < hist)[:, :, None], from_h0, from_x).transpose(0, 2, 1)  # [B, C, W-1]
    return out.astype(x.dtype), conv_state.at[slot_ids].set(new.astype(conv_state.dtype))
