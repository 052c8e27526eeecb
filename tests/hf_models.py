"""Tiny HF models with every weight randomised, saved with `save_pretrained`: the references for
conversion and parity tests.

    from tests.hf_models import make_qwen3_next
    model = make_qwen3_next(tmp_path / "hf", moe=True)     # returns the HF model (eval mode)

Each builder: `make_X(path, dtype=torch.float32, seed=0, max_shard_size=None, **overrides)`; `overrides`
are HF config keys. Weights are drawn in float32 with a fixed torch seed (matrices normal(0, 0.1);
norm weights random around their neutral value; A_log = log(uniform(0.5, 4)); dt_bias uniform(-1, 1)),
then the model is cast to `dtype` and saved (`path=None`: not saved). Sizes: vocab 128, hidden 32, 4 layers (3 linear : 1 full),
4 query / 2 kv heads of dim 16, linear heads 2 key / 4 value of dims 8, 4 experts top-2.

The lightning / Mamba2 hybrids (`make_minimax`, `make_nemotron_h`, `make_bamba`, `make_granitemoehybrid`) are
documented at their builders below.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

HYBRID_LAYERS = ["linear_attention"] * 3 + ["full_attention"]

_COMMON = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
_LINEAR = dict(
    layer_types=HYBRID_LAYERS,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0, zero_centred_norms: bool = False) -> None:
    """Overwrites every parameter in place (float32 draws from a fixed seed).

    Norm weights: normal(0, 0.2) around 0 when the family's RMSNorm computes (1 + w)
    (`zero_centred_norms`), else around 1; the Gated DeltaNet output norm (`linear_attn.norm`) always
    uses plain w, so it is centred on 1.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        shape = p.shape
        if name.endswith("A_log"):
            value = torch.empty(shape).uniform_(0.5, 4.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            value = torch.empty(shape).uniform_(-1.0, 1.0, generator=gen)
        elif "norm" in name.rsplit(".", 2)[-2] and p.ndim == 1:
            center = 0.0 if zero_centred_norms and "linear_attn.norm" not in name else 1.0
            value = center + 0.2 * torch.randn(shape, generator=gen)
        else:
            value = 0.1 * torch.randn(shape, generator=gen)
        p.copy_(value.to(p.dtype))


def _save(model: torch.nn.Module, path: Any, dtype: torch.dtype, max_shard_size: Any) -> torch.nn.Module:
    model = model.to(dtype).eval()
    if path is None:  # build only
        return model
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(os.fspath(path), **kwargs)
    return model


def make_qwen3_next(path: Any, moe: bool = True, dtype: torch.dtype = torch.float32, seed: int = 0, max_shard_size: Any = None, **overrides):
    """Qwen3NextForCausalLM; `moe=False` gives dense MLPs everywhere (num_experts=0)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    kw = {**_COMMON, **_LINEAR, **(_MOE if moe else dict(num_experts=0)), **overrides}
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**kw))
    randomize_(model, seed, zero_centred_norms=True)
    return _save(model, path, dtype, max_shard_size)


def make_qwen3_5(
    path: Any, dtype: torch.dtype = torch.float32, seed: int = 0, max_shard_size: Any = None, multimodal: bool = False, **overrides
):
    """Qwen3_5ForCausalLM (model_type qwen3_5_text).

    `multimodal=True` writes the layout of the hub's multimodal Qwen3.5 checkpoints instead: config
    `model_type: qwen3_5` with a `text_config`, text weights under `model.language_model.`, plus a dummy
    `model.visual.*` tensor and an `mtp.*` tensor (both to be ignored by converters). Returns the text model.
    """
    from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5TextConfig

    text_cfg = Qwen3_5TextConfig(**{**_COMMON, **_LINEAR, **overrides})
    model = Qwen3_5ForCausalLM(text_cfg)
    randomize_(model, seed, zero_centred_norms=True)
    if not multimodal:
        return _save(model, path, dtype, max_shard_size)
    from safetensors.torch import save_file

    model = model.to(dtype).eval()
    os.makedirs(path, exist_ok=True)
    tensors = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v.contiguous().clone()
        for k, v in model.state_dict().items()
    }
    if text_cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2).to(dtype)
    tensors["mtp.fc.weight"] = torch.randn(32, 64).to(dtype)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    full = Qwen3_5Config(text_config=text_cfg.to_dict(), tie_word_embeddings=text_cfg.tie_word_embeddings).to_dict()
    full["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    full["text_config"]["dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(full, f, indent=2)
    return model


def make_qwen3(path: Any, dtype: torch.dtype = torch.float32, seed: int = 0, max_shard_size: Any = None, **overrides):
    """Qwen3ForCausalLM (dense, all full attention, q/k norms)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**{**_COMMON, **overrides}))
    randomize_(model, seed)
    return _save(model, path, dtype, max_shard_size)


def make_llama(path: Any, dtype: torch.dtype = torch.float32, seed: int = 0, max_shard_size: Any = None, **overrides):
    """LlamaForCausalLM (dense, all full attention)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**{**_COMMON, **overrides}))
    randomize_(model, seed)
    return _save(model, path, dtype, max_shard_size)


def write_tiny_tokenizer(path: Any, vocab_size: int = 128) -> None:
    """Trains a byte-level BPE (`tokenizers`) of at most `vocab_size` ids on a few sentences and writes
    tokenizer.json + tokenizer_config.json (eos `<|endoftext|>` = id 0, bos `<|bos|>` = id 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|bos|>"])
    corpus = ["hello world", "the capital of france is paris", "tiny models tell tiny stories"] * 20
    tok.train_from_iterator(corpus, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "bos_token": "<|bos|>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)


MINIMAX_LAYERS = ["full_attention", "linear_attention", "linear_attention", "full_attention"]


def make_minimax(path: Any, dtype: torch.dtype = torch.float32, seed: int = 0, max_shard_size: Any = None, **overrides):
    """MiniMaxForCausalLM: lightning ("linear_attention") and softmax attention layers, every MLP a 4-expert
    top-2 MoE, non-trivial residual alpha/beta factors, HF lightning block size 16 (so prompts span several
    HF blocks). Layer 0 is full attention by default: HF's MiniMaxCache is wrong when layer 0 is linear
    (DESIGN.md §5). Experts are saved one per expert under `block_sparse_moe.` (HF's conversion mapping)."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    kw = {
        **_COMMON,
        "intermediate_size": 16,
        "layer_types": MINIMAX_LAYERS,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "block_size": 16,
        "full_attn_alpha_factor": 1.25,
        "full_attn_beta_factor": 0.75,
        "linear_attn_alpha_factor": 0.9,
        "linear_attn_beta_factor": 1.1,
        "mlp_alpha_factor": 1.2,
        "mlp_beta_factor": 0.8,
        **overrides,
    }
    model = MiniMaxForCausalLM(MiniMaxConfig(**kw))
    randomize_(model, seed)
    return _save(model, path, dtype, max_shard_size)


NEMOTRON_BLOCKS = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention"]


def make_nemotron_h(path: Any, dtype: torch.dtype = torch.float32, seed: int = 0, max_shard_size: Any = None, **overrides):
    """NemotronHForCausalLM, blocks "ME*-M": Mamba2 (4 heads of dim 8 in 2 groups, state 8, conv 4, HF chunk
    16), a 4-expert top-2 MoE in 2 routing groups (1 chosen) with a shared expert, attention without RoPE,
    a relu^2 MLP. The router's `e_score_correction_bias` (a buffer) is randomised too. dt_bias in (-1, 1)
    keeps softplus(dt + dt_bias) far above HF's prefill-only clamp at time_step_min = 1e-3, so HF's
    prefill and decode paths compute one function. Saved with HF's hub names (`backbone.`, per-expert)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    kw = {
        **_COMMON,
        "layers_block_type": NEMOTRON_BLOCKS,
        "intermediate_size": 48,
        "ssm_state_size": 8,
        "mamba_num_heads": 4,
        "mamba_head_dim": 8,
        "n_groups": 2,
        "conv_kernel": 4,
        "chunk_size": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "moe_shared_expert_intermediate_size": 24,
        "n_group": 2,
        "topk_group": 1,
        "routed_scaling_factor": 1.5,
        "layer_norm_epsilon": 1e-5,
        **overrides,
    }
    kw.pop("num_hidden_layers", None)
    kw.pop("rms_norm_eps", None)
    model = NemotronHForCausalLM(NemotronHConfig(**kw))
    randomize_(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    return _save(model, path, dtype, max_shard_size)


def make_bamba(path: Any, dtype: torch.dtype = torch.float32, seed: int = 0, max_shard_size: Any = None, **overrides):
    """BambaForCausalLM: 4 layers, attention at layer 1 (RoPE on half of each head), Mamba2 elsewhere (4 heads
    of dim 16 in 2 groups, state 8, conv 4, HF chunk 16; conv and projection biases on), SwiGLU MLPs."""
    from transformers import BambaConfig, BambaForCausalLM

    kw = {
        **_COMMON,
        "attn_layer_indices": [1],
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_n_groups": 2,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 16,
        "mamba_conv_bias": True,
        "mamba_proj_bias": True,
        "attention_bias": True,
        **overrides,
    }
    model = BambaForCausalLM(BambaConfig(**kw))
    randomize_(model, seed)
    return _save(model, path, dtype, max_shard_size)


GRANITE_LAYERS = ["mamba", "attention", "mamba", "mamba"]


def make_granitemoehybrid(path: Any, dtype: torch.dtype = torch.float32, seed: int = 0, max_shard_size: Any = None,
                          **overrides):
    """GraniteMoeHybridForCausalLM: 4 layers, attention at layer 1 (RoPE), Mamba2 elsewhere (4 heads of dim
    16 in 2 groups, state 8, conv 4, HF chunk 16; conv and projection biases on), each MLP a 4-expert
    top-2 MoE (experts of 16) plus a shared MLP of 24 (`num_local_experts=0`: the shared MLP alone).
    Granite's scalings are far from neutral: embedding_multiplier 12, attention_multiplier 0.015,
    residual_multiplier 0.22, logits_scaling 6. `layer_types` use the legacy hub names ("mamba",
    "attention"); the default time_step_limit (0, inf) keeps HF's prefill-only dt clamp inactive."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    kw = {
        **_COMMON,
        "intermediate_size": 16,
        "shared_intermediate_size": 24,
        "layer_types": GRANITE_LAYERS,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "position_embedding_type": "rope",
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.015,
        "residual_multiplier": 0.22,
        "logits_scaling": 6.0,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_n_groups": 2,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 16,
        "mamba_conv_bias": True,
        "mamba_proj_bias": True,
        "attention_bias": True,
        **overrides,
    }
    model = GraniteMoeHybridForCausalLM(GraniteMoeHybridConfig(**kw))
    randomize_(model, seed)
    with torch.no_grad():  # q/k 4x larger: scores x 16, so the attention pattern (scale, RoPE) is far from uniform
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
    return _save(model, path, dtype, max_shard_size)
