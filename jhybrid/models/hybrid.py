"""The hybrid decoder: embeddings, a stack of full-attention and Gated DeltaNet layers, the LM head.

`forward(cfg, params, state, batch, decode=..., all_logits=...)` is a pure function of its arguments:
it returns logits and the new state pytree. Which layer is which comes from `cfg.layer_kinds`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float

from jhybrid.cache.state import HybridState
from jhybrid.config import ModelConfig
from jhybrid.models.attention import attention_layer
from jhybrid.models.batch import Batch
from jhybrid.models.gated_deltanet import gated_deltanet_layer
from jhybrid.models.layers import dense_mlp, moe, rms_norm, rope_inv_freq
from jhybrid.models.params import is_packed


def forward(
    cfg: ModelConfig,
    params: dict,
    state: HybridState,
    batch: Batch,
    *,
    decode: bool = False,
    all_logits: bool = False,
    kernel_impl: str = "auto",
    interpret: bool = False,
) -> tuple[Float[Array, "B V"] | Float[Array, "T V"], HybridState]:
    """Runs one step over a ragged batch.

    Args:
      cfg: the model config (static).
      params: the parameter pytree (`jhybrid.models.params`).
      state: KV pages and state slots; the rows' slots and blocks are read and updated.
      batch: packed tokens and their metadata (`jhybrid.models.batch.Batch`).
      decode: every row has exactly one token (selects the decode forms of the kernels).
      all_logits: return logits for every packed token `[T, V]` instead of each row's last `[B, V]`.
      kernel_impl: the kernels' `impl` ("auto": Pallas on GPU where supported, the references on CPU;
        "reference"; "pallas"), with `interpret` to run Pallas in interpret mode (CPU tests).

    Returns:
      fp32 logits and the updated state.
    """
    if not is_packed(params):
        raise ValueError("forward runs on packed parameters: call jhybrid.models.params.pack_params(params) once")
    kernels = dict(impl=kernel_impl, interpret=interpret)
    x = params["embed"][batch.token_ids]  # [T, D]
    inv_freq = rope_inv_freq(cfg) if cfg.num_full_layers else None
    k_pages, v_pages = list(state.k_pages), list(state.v_pages)
    conv, ssm = list(state.conv), list(state.ssm)
    i_full = i_lin = 0
    for kind, mlp_kind, p in zip(cfg.layer_kinds, cfg.mlp_kinds, params["layers"]):
        h = rms_norm(x, p["input_norm"], cfg.rms_norm_eps, cfg.norm_zero_centred)
        if kind == "full_attention":
            h, k_pages[i_full], v_pages[i_full] = attention_layer(
                cfg, p["attn"], h, k_pages[i_full], v_pages[i_full], batch, inv_freq, decode, kernels
            )
            i_full += 1
        else:
            h, conv[i_lin], ssm[i_lin] = gated_deltanet_layer(
                cfg, p["gdn"], h, conv[i_lin], ssm[i_lin], batch, decode, kernels
            )
            i_lin += 1
        x = x + h
        h = rms_norm(x, p["post_norm"], cfg.rms_norm_eps, cfg.norm_zero_centred)
        if mlp_kind == "moe":
            h = moe(p["mlp"], h, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        else:
            h = dense_mlp(p["mlp"], h)
        x = x + h
    if not all_logits:
        x = x[batch.logits_index]  # [B, D]
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps, cfg.norm_zero_centred)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    logits = (x @ head).astype(jnp.float32)
    new_state = dataclasses.replace(state, k_pages=tuple(k_pages), v_pages=tuple(v_pages), conv=tuple(conv), ssm=tuple(ssm))
    return logits, new_state
