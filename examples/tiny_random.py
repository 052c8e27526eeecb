"""Builds a tiny random-weight Qwen3.5-style hybrid checkpoint in HF format, then generates from it.

    python examples/tiny_random.py [--out out/tiny-qwen3_5] [--prompt "Once upon a time"]

The checkpoint is written with NumPy alone (no torch): config.json, model.safetensors with HF's tensor
names, a byte-level BPE tokenizer trained here on a few sentences, and generation_config.json. The
weights are random, so the continuation is noise; the point is the whole path: HF files -> converter ->
state pytree -> prefill + decode -> detokenised text. For text that reads, see examples/quickstart.py (the
bundled trained model).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from safetensors.numpy import save_file

CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "eos_token_id": 0,
    "bos_token_id": 1,
    "dtype": "float32",
}
CORPUS = [
    "Once upon a time there was a small model that wanted to learn to speak.",
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Hybrid models mix full attention layers with linear attention layers.",
    "The quick brown fox jumps over the lazy dog.",
]


def hf_tensors(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random tensors under the names and shapes HF's Qwen3_5ForCausalLM saves."""
    d, v, inter = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    h, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, width = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    conv_dim = 2 * hk * dk + hv * dv

    def w(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, d, scale=0.5), "model.norm.weight": w(d, scale=0.1), "lm_head.weight": w(v, d)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": w(d, scale=0.1), p + "post_attention_layernorm.weight": w(d, scale=0.1)}
        t |= {p + "mlp.gate_proj.weight": w(inter, d), p + "mlp.up_proj.weight": w(inter, d), p + "mlp.down_proj.weight": w(d, inter)}
        if kind == "full_attention":
            a = p + "self_attn."
            t |= {a + "q_proj.weight": w(2 * h * hd, d), a + "k_proj.weight": w(kvh * hd, d), a + "v_proj.weight": w(kvh * hd, d)}
            t |= {a + "o_proj.weight": w(d, h * hd), a + "q_norm.weight": w(hd, scale=0.1), a + "k_norm.weight": w(hd, scale=0.1)}
        else:
            g = p + "linear_attn."
            t |= {g + "in_proj_qkv.weight": w(conv_dim, d), g + "in_proj_z.weight": w(hv * dv, d)}
            t |= {g + "in_proj_b.weight": w(hv, d), g + "in_proj_a.weight": w(hv, d), g + "out_proj.weight": w(d, hv * dv)}
            t |= {g + "conv1d.weight": w(conv_dim, 1, width, scale=0.3), g + "norm.weight": 1.0 + w(dv, scale=0.1)}
            t |= {g + "A_log": np.log(rng.uniform(0.5, 4.0, hv)).astype(np.float32), g + "dt_bias": w(hv, scale=0.5)}
    return t


def write_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|bos|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "bos_token": "<|bos|>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def write_tiny_checkpoint(path: str, seed: int = 0) -> str:
    """Writes the tiny random HF checkpoint into `path` and returns it."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": CONFIG["eos_token_id"], "bos_token_id": CONFIG["bos_token_id"]}, f)
    save_file(hf_tensors(CONFIG, np.random.default_rng(seed)), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(path, CONFIG["vocab_size"])
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/tiny-qwen3_5", help="where to write the checkpoint")
    parser.add_argument("--prompt", action="append", help="prompt (repeatable)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    prompts = args.prompt or ["Once upon a time", "The capital of France is"]

    import jhybrid

    path = write_tiny_checkpoint(args.out)
    print(f"wrote a tiny random Qwen3.5-style checkpoint (3 Gated DeltaNet : 1 full attention) to {path}")
    t0 = time.perf_counter()
    outputs = jhybrid.generate(path, prompts, max_tokens=args.max_tokens, ignore_eos=True)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(prompts, outputs):
        print(f"\nprompt: {prompt!r}\n  -> {out.text!r}\n  token ids: {out.token_ids}")
    print(f"\n{sum(len(o.token_ids) for o in outputs)} tokens in {elapsed:.1f} s (compilation included); random weights, so the text is noise")


if __name__ == "__main__":
    main()
