"""Layers shared by the model families: norms, rotary embedding, MLPs, mixture of experts, causal conv."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jax.sharding import PartitionSpec as P

from jhybrid.models.quant import Fp8Weight, expert_weights, linear
from jhybrid.parallel.layout import num_shards as mesh_shards
from jhybrid.parallel.layout import split_packed
from pallas_kernels import moe_route
from pallas_kernels.grouped_matmul import default_block_m, expert_tiles, grouped_matmul, pallas_supported

# how `moe` computes its routed experts: "auto" (grouped by expert on a GPU where the kernel tiles the shapes, else
# every expert on every token), "grouped" or "dense"; `kernels["impl"] == "reference"` always runs "dense"
MOE_IMPL = "auto"


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


def rope_inv_freq(cfg) -> np.ndarray:
    """Inverse frequencies `[rotary_dim / 2]` (default, linear and llama3 scaling), in fp32 on the host: a constant
    of the programs that use it, folded where they do (computed under jit, it was a kernel of each step's own)."""
    dim = cfg.rotary_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    inv = inv.astype(np.float32)
    if cfg.rope_type == "linear":
        inv = inv / np.float32(cfg.rope_factor)
    elif cfg.rope_type == "llama3":
        low_wavelen = cfg.rope_original_max_position / cfg.rope_low_freq_factor
        high_wavelen = cfg.rope_original_max_position / cfg.rope_high_freq_factor
        wavelen = np.float32(2 * np.pi) / inv
        smooth = (np.float32(cfg.rope_original_max_position) / wavelen - np.float32(cfg.rope_low_freq_factor)) / (
            np.float32(cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        )
        mid = (1 - smooth) * inv / np.float32(cfg.rope_factor) + smooth * inv
        inv = np.where(wavelen > low_wavelen, inv / np.float32(cfg.rope_factor),
                       np.where(wavelen < high_wavelen, inv, mid))
    return np.asarray(inv, np.float32)


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
        num_shards: int = 1, kernels: dict | None = None, num_real: Array | None = None) -> Array:
    """Top-k routed experts plus an optional shared expert (sigmoid-gated when `shared_gate` is present).

    router "softmax" (Qwen3-Next, MiniMax): weights = top-k of softmax(logits), optionally renormalised.
    router "sigmoid_group" (NemotronH): scores = sigmoid(logits); experts are chosen by top-k of
    `scores + router_bias` within the `topk_group` best of `n_group` expert groups (a group's merit: the sum
    of its two best biased scores); weights = the chosen unbiased scores, renormalised (+1e-20) if
    `norm_topk_prob`, times `scaling`. Experts are SwiGLU (`act="silu"`) or `relu(up(x))^2` (`"relu2"`).

    The routed experts run grouped by expert (`routed_experts_grouped`: only the routed (token, expert) pairs, the
    Pallas grouped matmul) or, as the reference, densely (`routed_experts_dense`: every expert on every token, the
    unrouted ones weighted zero: exact, simple, E / top-k times the routed FLOPs): `MOE_IMPL` and `kernels` pick.
    On the grouped path the tokens from `num_real` on (a bucket's padding) are routed to no expert, so that their
    experts' weights are not read (at batch 1 in a 4-row bucket they would be read for three padding rows); their
    routed output is zero.
    """
    num_tokens = x.shape[0]
    w_in, w_down = p["up_proj" if act == "relu2" else "gate_up_proj"], p["down_proj"]
    kernels = kernels or {}
    grouped = _run_grouped(x, w_in, w_down, act, kernels)
    if (grouped and router == "softmax" and num_tokens * top_k <= PER_PAIR_TILES_MAX
            and mesh_shards(kernels.get("mesh")) == 1):  # a decode step's per-pair tiles, routed in one go
        out = _per_pair_moe(x, x @ p["router"], top_k, norm_topk_prob, w_in, w_down, act, kernels, num_real)
    else:
        out = _routed_moe(p, x, top_k, norm_topk_prob, w_in, w_down, act, grouped, kernels, num_real, router=router,
                          n_group=n_group, topk_group=topk_group, scaling=scaling)
    if "shared" in p:
        shared = dense_mlp(p["shared"], x, act, num_shards)
        out = out + (jax.nn.sigmoid(x @ p["shared_gate"]) * shared if "shared_gate" in p else shared)
    return out


def _per_pair_moe(x, logits, top_k: int, norm_topk_prob: bool, w_in, w_down, act: str, kernels: dict,
                  num_real) -> Array:
    """`moe`'s routed experts in a decode step of per-pair tiles (`PER_PAIR_TILES_MAX`) on one device: the softmax
    router's decision laid out as the tiles by `pallas_kernels.moe_route.pair_route` (one kernel with
    `moe_route.FUSED_ROUTE`, or under `kernels["impl"] == "pallas"` where it takes the shapes; else XLA's ops)."""
    impl = kernels.get("impl", "auto")
    route_impl = "pallas" if impl == "pallas" and moe_route.pallas_supported(*logits.shape, top_k) else "auto"
    tile_expert, row_w = moe_route.pair_route(logits, num_real, top_k=top_k, norm_topk_prob=norm_topk_prob,
                                              impl=route_impl, interpret=kernels.get("interpret", False))
    return _pair_tile_experts(x, tile_expert, row_w, _stack(w_in), _stack(w_down), act, impl,
                              kernels.get("interpret", False))


def _routed_moe(p, x, top_k, norm_topk_prob, w_in, w_down, act, grouped, kernels, num_real, *, router, n_group,
                topk_group, scaling) -> Array:
    """`moe`'s routed experts: the router's top-k, then the grouped or the dense path."""
    num_tokens = x.shape[0]
    if router == "softmax":
        probs = jax.nn.softmax((x @ p["router"]).astype(jnp.float32), axis=-1)  # [T, E]
        top_p, top_i = jax.lax.top_k(probs, top_k)  # [T, k]
        if norm_topk_prob:
            top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    else:  # HF routes in fp32
        scores = jax.nn.sigmoid(x.astype(jnp.float32) @ p["router"].astype(jnp.float32))  # [T, E]
        choice = scores + p["router_bias"].astype(jnp.float32)  # [T, E]
        num_experts = choice.shape[-1]
        by_group = choice.reshape(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
        group_merit = jnp.sum(jax.lax.top_k(by_group, 2)[0], axis=-1)  # [T, G]
        _, top_groups = jax.lax.top_k(group_merit, topk_group)  # [T, topk_group]
        group_ok = jnp.zeros((num_tokens, n_group), bool).at[jnp.arange(num_tokens)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(group_ok, num_experts // n_group, axis=-1), choice, -jnp.inf)
        _, top_i = jax.lax.top_k(choice, top_k)
        top_p = jnp.take_along_axis(scores, top_i, axis=-1)
        if norm_topk_prob:
            top_p = top_p / (jnp.sum(top_p, axis=-1, keepdims=True) + 1e-20)
        top_p = top_p * scaling
    if not grouped:
        return routed_experts_dense(x, top_i, top_p, w_in, w_down, act)
    if num_real is not None:  # padding tokens: an out-of-range expert, which `expert_tiles` drops
        top_i = jnp.where((jnp.arange(num_tokens) < num_real)[:, None], top_i, -1)
    return routed_experts_grouped(x, top_i, top_p, w_in, w_down, act, impl=kernels.get("impl", "auto"),
                                  interpret=kernels.get("interpret", False), mesh=kernels.get("mesh"))


def _run_grouped(x, w_in, w_down, act: str, kernels: dict) -> bool:
    """`moe`'s choice of the grouped path (`MOE_IMPL`): "auto" takes it where the Pallas kernel would run (a GPU, or
    `kernels["impl"] == "pallas"`) and tiles both matmuls' shapes."""
    impl = kernels.get("impl", "auto")
    if MOE_IMPL == "dense" or impl == "reference":
        return False
    if MOE_IMPL == "grouped":
        return True
    if impl != "pallas" and jax.default_backend() != "gpu":
        return False
    fp8 = isinstance(w_in, Fp8Weight)
    n_in = w_in.shape[-1] // (1 if act == "relu2" else 2)
    return pallas_supported(x.shape[-1], n_in, fp8) and pallas_supported(n_in, w_down.shape[-1], fp8)


def routed_experts_dense(x: Float[Array, "T D"], top_i: Int[Array, "T k"], top_p: Float[Array, "T k"], w_in, w_down,
                         act: str) -> Float[Array, "T D"]:
    """Every expert on every token, combined with the routing weights (zero for the unrouted): the reference.
    FP8 experts (`Fp8Weight`) are dequantized to `x`'s dtype here, this layer's only (`expert_weights`)."""
    num_tokens = x.shape[0]
    combine = jnp.zeros((num_tokens, w_down.shape[0]), jnp.float32)
    combine = combine.at[jnp.arange(num_tokens)[:, None], top_i].set(top_p).astype(x.dtype)  # [T, E]
    w_in, w_down = expert_weights(x, w_in, w_down)
    if act == "relu2":
        h = jnp.square(jax.nn.relu(jnp.einsum("td,edi->tei", x, w_in)))  # [T, E, Ie]
    else:
        gate, up = jnp.split(jnp.einsum("td,edi->tei", x, w_in), 2, axis=-1)  # [T, E, Ie] x2
        h = jax.nn.silu(gate) * up
    return jnp.einsum("tei,eid,te->td", h, w_down, combine)  # [T, D]


def routed_experts_grouped(x: Float[Array, "T D"], top_i: Int[Array, "T k"], top_p: Float[Array, "T k"], w_in, w_down,
                           act: str, *, impl: str = "auto", interpret: bool = False, mesh=None) -> Float[Array, "T D"]:
    """Only the routed (token, expert) pairs: sorted by expert into tiles (`expert_tiles`), each tile through its
    expert's up (and gate) projection with the activation fused (`grouped_matmul`), then its down projection scaled
    by the pairs' routing weights; each token sums its k rows. Plain or FP8 (`Fp8Weight`, W8A16 in the kernel)
    experts. Under tensor parallelism (`mesh`) each device runs its own experts' pairs and the partial outputs are
    summed over the mesh (experts split along the expert axis), or every device runs all of them (replicated)."""
    fp8 = [isinstance(w, Fp8Weight) for w in (w_in, w_down)]
    tensors = [a for w in (w_in, w_down) for a in ((w.w, w.scale) if isinstance(w, Fp8Weight) else (w,))]
    n_in, n_out = (w.n if isinstance(w, Fp8Weight) else w.shape[-1] for w in (w_in, w_down))
    shards = mesh_shards(mesh)
    split = shards > 1 and w_down.shape[0] % shards == 0  # jhybrid.parallel.sharding's rule for routed experts

    def local(x, top_i, top_p, *tensors):  # this device's experts (all of them unless split)
        it = iter(tensors)
        (w_in_l, s_in), (w_down_l, s_down) = ((next(it), next(it) if q else None) for q in fp8)
        if split:
            top_i = top_i - jax.lax.axis_index(mesh.axis_names[0]) * w_in_l.shape[0]  # others' experts: dropped
        out = _grouped_pairs(x, top_i, top_p, (w_in_l, s_in, n_in), (w_down_l, s_down, n_out), act, impl, interpret)
        return jax.lax.psum(out, mesh.axis_names[0]) if split else out

    if shards == 1:
        return local(x, top_i, top_p, *tensors)
    specs = tuple(P(mesh.axis_names[0]) if split else P() for _ in tensors)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), *specs), out_specs=P(), check_vma=False)(
        x, top_i, top_p, *tensors)


# Up to this many (token, expert) pairs (a decode step of few rows: 8 = a 4-row bucket at top-2) `_grouped_pairs`
# gives each pair a tile of its own, the pair in the tile's first row: a layout fixed at trace time, so the layer
# runs no ranking, counting or scatter kernels for it (`expert_tiles`: about 8 of the MiniMax-shaped layer's 14
# kernels at batch 1). The price: pairs that share an expert read its weights once each, rare among few pairs.
# Not yet timed on the GPU (the kernel counts come from the H200 compile, benchmarks/RESULTS.md "Session 32");
# JHYBRID_MOE_PAIR_TILES_MAX=0 restores the sorted layout for every step.
PER_PAIR_TILES_MAX = int(os.environ.get("JHYBRID_MOE_PAIR_TILES_MAX", "8"))


def _grouped_pairs(x, top_i, top_p, w_in, w_down, act, impl, interpret):
    """`routed_experts_grouped` on one device: `top_i` numbered from its first expert (pairs outside its experts are
    dropped); `w_in`, `w_down`: `(weight stack, FP8 scales or None, output columns n)`."""
    num_tokens, k = top_i.shape
    num_experts = w_in[0].shape[0]
    if num_tokens * k <= PER_PAIR_TILES_MAX:  # one 16-row tile a pair; a dropped pair's tile has expert -1
        pair_expert = top_i.reshape(-1)
        valid = (pair_expert >= 0) & (pair_expert < num_experts)
        tile_expert = jnp.where(valid, pair_expert, -1).astype(jnp.int32)  # [P]
        row_w = _first_rows(top_p.reshape(-1), 16)  # [P * 16]
        return _pair_tile_experts(x, tile_expert, row_w, w_in, w_down, act, impl, interpret)
    block_m = default_block_m(num_tokens * k, num_experts)
    pair_row, row_pair, tile_expert = expert_tiles(top_i.reshape(-1), num_experts, block_m)
    x_rows = jnp.take(x, row_pair // k, axis=0, mode="fill", fill_value=0)  # [M, D]; padding rows: zeros
    row_w = jnp.take(top_p.reshape(-1), row_pair, mode="fill", fill_value=0)  # [M]
    y = _expert_mlps(x_rows, tile_expert, row_w, block_m, w_in, w_down, act, impl, interpret)  # [M, D]
    y = jnp.take(y, pair_row, axis=0, mode="fill", fill_value=0).reshape(num_tokens, k, -1)  # [T, k, D]
    return jnp.sum(y.astype(jnp.float32), axis=1).astype(x.dtype)


def _pair_tile_experts(x, tile_expert, row_w, w_in, w_down, act: str, impl: str, interpret: bool) -> Array:
    """The routed experts in the per-pair layout (`PER_PAIR_TILES_MAX`): tile p holds pair p = (token p // k, its
    (p % k)-th expert) in its first row and zeros below; `tile_expert [P]` (-1: a dropped pair, whose tile the kernel
    skips and leaves unspecified, masked here), `row_w [P * block_m]`. Each token sums its k pairs: `[T, D]`."""
    num_tokens, num_pairs = x.shape[0], tile_expert.shape[0]
    k, block_m = num_pairs // num_tokens, row_w.shape[0] // num_pairs
    x_rows = _first_rows(jnp.repeat(x, k, axis=0), block_m)  # [P * 16, D]
    y = _expert_mlps(x_rows, tile_expert, row_w, block_m, w_in, w_down, act, impl, interpret)  # [P * 16, D]
    pair = jnp.where((tile_expert >= 0)[:, None], y.reshape(num_pairs, block_m, -1)[:, 0], 0)  # [P, D]
    return jnp.sum(pair.reshape(num_tokens, k, -1).astype(jnp.float32), axis=1).astype(x.dtype)


def _expert_mlps(x_rows, tile_expert, row_w, block_m: int, w_in, w_down, act: str, impl: str, interpret: bool):
    """Each row tile through its expert's MLP (two grouped matmuls, the activation and the rows' combine weights
    fused): `[M, D]`. `w_in`, `w_down`: `(weight stack, FP8 scales or None, output columns n)`."""
    run = dict(block_m=block_m, impl="pallas" if impl == "pallas" else "auto", interpret=interpret)
    h = grouped_matmul(x_rows, w_in[0], tile_expert, scale=w_in[1], n=w_in[2],
                       epilogue="relu2" if act == "relu2" else "silu_gate", **run)  # [M, Ie]
    return grouped_matmul(h, w_down[0], tile_expert, scale=w_down[1], n=w_down[2], row_scale=row_w, **run)


def _stack(w) -> tuple:
    """A routed expert stack as `_expert_mlps` takes it: (weights, FP8 scales or None, output columns n)."""
    return (w.w, w.scale, w.n) if isinstance(w, Fp8Weight) else (w, None, w.shape[-1])


def _first_rows(a: Array, block_m: int) -> Array:
    """`a [P, ...]` as P tiles of `block_m` rows, each `a[p]` in its first row and zeros below: `[P * block_m, ...]`."""
    return jnp.pad(a[:, None], ((0, 0), (0, block_m - 1)) + ((0, 0),) * (a.ndim - 1)).reshape(-1, *a.shape[1:])


def grouped_gated_rms_norm(x: Float[Array, "T I"], gate: Float[Array, "T I"], w: Float[Array, "I"], group_size: int,
                           eps: float) -> Array:
    """Mamba2 output norm (norm after the gate): `w * rmsnorm_per_group(x * silu(gate))`, the RMS taken over
    consecutive groups of `group_size` channels (NemotronH: one group per B/C group)."""
    return grouped_rms_norm(x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32)), w, group_size, eps, x.dtype)


def grouped_rms_norm(h: Float[Array, "T I"], w: Float[Array, "I"], group_size: int, eps: float, dtype) -> Array:
    """`grouped_gated_rms_norm` after its gate: `w * rmsnorm_per_group(h)` of the gated fp32 `h`, normed in `dtype`."""
    num_tokens, dim = h.shape
    h = h.reshape(num_tokens, dim // group_size, group_size)  # [T, G, I/G]
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return w * h.reshape(num_tokens, dim).astype(dtype)


def short_conv(x: Float[Array, "T C"], conv_state: Array, weight: Array, batch, decode: bool,
               kernels: dict | None = None) -> tuple[Float[Array, "T C"], Array]:
    """The linear layers' causal convolution: `causal_conv1d`, or in a decode step whose kernels say so (impl
    "pallas", or "auto" on a GPU with `pallas_kernels.conv_update.PALLAS_DECODE`) and whose shapes the kernel takes,
    the one-kernel decode form (`pallas_kernels.conv_update`; a decode step's token b is row b's)."""
    from pallas_kernels import conv_update

    kernels = kernels or {}
    if (decode and conv_update.pallas_supported(x, weight)
            and conv_update.resolve(kernels.get("impl", "auto"), x, weight, kernels.get("mesh")) == "pallas"):
        return conv_update.conv_update(x, conv_state, weight, batch.slot_ids, **kernels)
    return causal_conv1d(x, conv_state, weight, batch.cu_seqlens, batch.slot_ids, batch.token_seq)


def conv_prefill_kernel(proj: Array, conv_state: Array, weight: Array, batch, decode: bool, kernels: dict | None,
                        **form) -> tuple[tuple[Array, ...], Array] | None:
    """A prefill (or mixed) step's short conv as one kernel reading the packed projection `proj` in place
    (`pallas_kernels.conv_update.conv_prefill`; `form`: offset, bias, activation, out_dtype, splits), where it
    applies: not a decode step, shapes the kernel takes, impl "pallas", or "auto" on a GPU with
    `conv_update.PALLAS_PREFILL`, one device. None otherwise: the caller runs `short_conv` on its slice."""
    from pallas_kernels import conv_update

    kernels = kernels or {}
    splits = form.get("splits")
    if decode or not conv_update.prefill.supported(proj, weight, splits) or conv_update.resolve_prefill(
            kernels.get("impl", "auto"), proj, weight, splits, kernels.get("mesh")) != "pallas":
        return None
    return conv_update.conv_prefill_pallas(proj, conv_state, weight, batch.cu_seqlens, batch.slot_ids,
                                           batch.token_seq, **form, interpret=kernels.get("interpret", False))


def causal_conv1d(
    x: Float[Array, "T C"],
    conv_state: Float[Array, "S C W1"],
    weight: Float[Array, "C W"],
    cu_seqlens: Int[Array, "B+1"],
    slot_ids: Int[Array, "B"],
    token_seq: Int[Array, "T"],
) -> tuple[Float[Array, "T C"], Float[Array, "S C W1"]]:
    """Depthwise causal conv over packed sequences, continuing from each row's conv-state slot
    (`pallas_kernels.conv_update.conv_prefill_reference`, one output).

    `conv_state[s]` holds the last `W - 1` inputs of the sequence in slot s (oldest first); slot 0 (the
    null slot) reads as zeros. Returns the conv output (before activation, in x's dtype) and the state with
    each row's slot holding its last `W - 1` inputs.
    """
    from pallas_kernels.conv_update import conv_prefill_reference

    (out,), conv_state = conv_prefill_reference(x, conv_state, weight, cu_seqlens, slot_ids, token_seq)
    return out, conv_state
