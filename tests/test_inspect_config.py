"""`jhybrid inspect --config-only` on every published config (tests/real_configs/), against independent counts.

- parameters (total, active per token) against HF transformers' model built on the `meta` device from the same
  config (the text model of the multimodal wrappers; MiniMax's published form in HF's names): sum of numel, and
  the routed experts' share `top_k / num_experts`;
- FP8 bytes against HF's module tree: `nn.Linear` weights (but the LM head, the routers `*.gate` and those
  narrower than a block) and routed expert tensors at 1 byte + an fp32 scale per 128x128 block, every other parameter in bf16;
- KV bytes per token and linear-state bytes per sequence against formulas written here from the published
  fields;
- the tensor-parallel table: sizes the engine accepts, per-GPU weights no less than an even split, the fit
  rule as stated, and the smallest sizes worked out by hand for two models.

Each test was seen to fail with its behaviour removed (noted per test).
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch

from jhybrid.cli import main
from jhybrid.config_summary import ACTIVATION_RESERVE, H200_BYTES, MEMORY_FRACTION, POOL_SEQS, POOL_TOKENS, summarize_config
from tests.published_models import REAL_CONFIGS, minimax_hf_config, published

ALL = sorted(p.name for p in REAL_CONFIGS.iterdir() if (p / "config.json").is_file())
# the slowest HF module trees to build, even on `meta` (MiniMax-M1 ~8 s: 80 layers of per-expert modules)
SLOW = ("MiniMax-M1", "Qwen3.5-122B-A10B")
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in ALL]


@functools.cache
def summary(name: str):
    return summarize_config(REAL_CONFIGS / name)


def hf_text_model(name: str) -> torch.nn.Module:
    """HF's (text) model of published config `name`, on the meta device (no memory, no init cost)."""
    import transformers as t

    pub = published(name)
    kind = pub["model_type"]
    with torch.device("meta"):
        if kind == "qwen3_next":
            return t.Qwen3NextForCausalLM(t.Qwen3NextConfig(**pub))
        if kind in ("qwen3_5", "qwen3_5_moe"):
            text = {**pub["text_config"], "tie_word_embeddings": pub.get("tie_word_embeddings", False)}
            if kind == "qwen3_5":
                return t.Qwen3_5ForCausalLM(t.Qwen3_5TextConfig(**text))
            return t.Qwen3_5MoeForCausalLM(t.Qwen3_5MoeTextConfig(**text))
        if kind == "nemotron_h":
            return t.NemotronHForCausalLM(t.NemotronHConfig(**pub))
        if kind == "minimax_m1":
            return t.MiniMaxForCausalLM(t.MiniMaxConfig(**minimax_hf_config(pub)))
    raise AssertionError(f"no HF model for {name} ({kind})")


def hf_counts(model: torch.nn.Module, top_k: int, num_experts: int) -> tuple[int, int, int]:
    """(total, active per token, FP8 bytes) from HF's module tree: its parameters and the buffers it stores
    but the derived ones (NemotronH's router bias `e_score_correction_bias` is a buffer in HF, a weight in the
    checkpoint; MiniMax's lightning decay tables are computed, not weights)."""
    total = active = fp8 = 0
    linear = {id(m.weight) for name, m in model.named_modules()  # routers (`*.gate`) stay bf16, as the LM head
              if isinstance(m, torch.nn.Linear) and name != "lm_head" and not name.endswith(".gate")
              and min(m.weight.shape) >= 128}
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    derived = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")  # MiniMax's, computed from the layer index
    buffers = {k: v for k, v in model.state_dict().items() if k not in names and not k.endswith(derived)}
    for name, p in [*model.named_parameters(), *buffers.items()]:
        n = p.numel()
        total += n
        routed = ".experts." in name and p.ndim == 3  # fused [E, out, in] expert tensors
        active += n * top_k // num_experts if routed else n
        if id(p) in linear or routed:
            rows, cols = p.shape[-2:]
            fp8 += n + 4 * math.prod(p.shape[:-2]) * -(-rows // 128) * -(-cols // 128)
        else:
            fp8 += (4 if name.endswith(("A_log", "dt_bias", "e_score_correction_bias")) else 2) * n
    return total, active, fp8


@pytest.mark.parametrize("name", NAMES)
def test_parameters_match_hf(name):
    """Total and active parameters and FP8 bytes equal HF's counts. Fails (was seen to) with the active count
    taking every expert, and with the routers counted as FP8."""
    s = summary(name)
    cfg = s.cfg
    total, active, fp8 = hf_counts(hf_text_model(name), cfg.num_experts_per_tok or 1, cfg.num_experts or 1)
    assert s.num_params == total, f"{name}: jhybrid {s.num_params:,} vs HF {total:,}"
    assert s.num_active_params == active, f"{name}: active jhybrid {s.num_active_params:,} vs HF {active:,}"
    assert s.weight_bytes_fp8 == fp8, f"{name}: FP8 bytes jhybrid {s.weight_bytes_fp8:,} vs HF {fp8:,}"
    assert s.weight_bytes_fp8 < 0.6 * s.weight_bytes_bf16 and s.weight_bytes_bf16 >= 2 * s.num_params


def _expected_memory(pub: dict) -> tuple[int, dict[str, int]]:
    """(KV bytes per token in bf16, {layer kind: fp32 state bytes per sequence}) from the published fields."""
    c = pub.get("text_config", pub)
    kind = pub["model_type"]
    if kind.startswith("qwen3"):
        types = c.get("layer_types") or ["full_attention" if (i + 1) % c["full_attention_interval"] == 0 else "linear"
                                         for i in range(c["num_hidden_layers"])]
        full, linear = types.count("full_attention"), len(types) - types.count("full_attention")
        hk, hv, dk, dv = (c[f"linear_{k}"] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
        conv = (2 * hk * dk + hv * dv) * (c["linear_conv_kernel_dim"] - 1)
        return full * 2 * c["num_key_value_heads"] * c["head_dim"] * 2, {"linear_attention": linear * 4 * (conv + hv * dk * dv)}
    if kind == "nemotron_h":
        pattern = c["hybrid_override_pattern"]
        head_dim = c.get("head_dim") or c["attention_head_dim"]
        h, p, g, n = c["mamba_num_heads"], c["mamba_head_dim"], c["n_groups"], c["ssm_state_size"]
        conv = (h * p + 2 * g * n) * (c["conv_kernel"] - 1)
        kv = pattern.count("*") * 2 * c["num_key_value_heads"] * head_dim * 2
        return kv, {"mamba2": pattern.count("M") * 4 * (conv + h * p * n)}
    assert kind == "minimax_m1"
    full, hd = sum(c["attn_type_list"]), c["head_dim"]
    lightning = len(c["attn_type_list"]) - full
    kv = full * 2 * c["num_key_value_heads"] * hd * 2
    # + the one-float conv placeholder a lightning layer holds (`ModelConfig.linear_state_shapes`)
    return kv, {"lightning_attention": lightning * 4 * (1 + c["num_attention_heads"] * hd * hd)}


@pytest.mark.parametrize("name", ALL)
def test_kv_and_state_bytes(name):
    """KV bytes per token and state bytes per sequence (per layer kind, conv + recurrent) equal the formulas
    above. Fails (was seen to) with the Mamba2 conv state left out."""
    s = summary(name)
    kv, state = _expected_memory(published(name))
    assert s.kv_bytes_per_token == kv
    assert {k: v["conv_bytes"] + v["recurrent_bytes"] for k, v in s.state_by_kind.items()} == state
    assert s.state_bytes_per_sequence == sum(state.values())


@pytest.mark.parametrize("name", ALL)
def test_tensor_parallel_plan(name):
    """Each row: a size the engine accepts, per-GPU weights at least an even split of the whole, KV per token
    an even split (or one kv head per GPU), and `fits` as stated: the pool the engine would plan from what the
    weights leave holds 64 sequences of 8,192 tokens plus 65 state slots. Fails (was seen to) with the
    embeddings counted as replicated when the vocabulary splits (per-GPU weights too large), and with the kv
    heads not copied where the GPUs outnumber them."""
    from jhybrid.parallel.sharding import validate_tensor_parallel

    s = summary(name)
    assert s.tp[0].size == 1 and s.tp[0].weight_bytes_bf16 == s.weight_bytes_bf16
    for r in s.tp:
        validate_tensor_parallel(s.cfg, r.size)
        # replicated: norms, routers, shared-expert gates (Qwen3.5-397B's 60 routers of 4096 x 512: 0.25 GB)
        assert s.weight_bytes_bf16 / r.size <= r.weight_bytes_bf16 < s.weight_bytes_bf16 / r.size + 0.3e9
        one_head = s.kv_bytes_per_token // s.cfg.num_kv_heads  # fewer kv heads than GPUs: each holds one copy
        assert r.kv_bytes_per_token == max(s.kv_bytes_per_token // r.size, one_head)
        assert r.pool_bytes == POOL_SEQS * POOL_TOKENS * r.kv_bytes_per_token + (POOL_SEQS + 1) * r.state_bytes_per_sequence
        for w, fits in ((r.weight_bytes_bf16, r.fits_bf16), (r.weight_bytes_fp8, r.fits_fp8)):
            assert fits == ((H200_BYTES - w) * MEMORY_FRACTION * (1 - ACTIVATION_RESERVE) >= r.pool_bytes)


def test_smallest_tensor_parallel_sizes():
    """Worked by hand (GB = 1e9 bytes; the pool: 64 x 8,192 tokens of KV per GPU plus 65 state slots per GPU).

    - Qwen3-Next-80B-A3B: 79.67 B parameters, 159.3 GB in bf16: TP 1 cannot hold them; TP 2 holds 79.7 GB per GPU
      and leaves (141 - 79.7) x 0.81 = 49.7 GB for a 9.0 GB pool (6.4 GB of KV: 12 full layers x 2 x 1 kv head
      x 256 x 2 bytes; 65 x 39.5 MB of state). FP8, 80.4 GB, fits one GPU: 49.1 GB for an 18.0 GB pool.
    - Qwen3.5-397B-A17B: 792.7 GB in bf16, 99.3 GB per GPU at TP 8; FP8 398.6 GB, 99.8 GB per GPU at TP 4.
    - Nemotron-H-56B: the margin decides. Its 112.6 GB of bf16 weights (58.5 GB in FP8) fit one H200 by
      themselves, but 54 Mamba2 layers make 919 MB of state per sequence: the pool is 81.2 GB (60 GB of state
      slots), more than (141 - 112.6) x 0.81 = 23 GB or (141 - 58.5) x 0.81 = 66.8 GB: TP 2 for both.
    - Qwen3.5-122B-A10B in FP8: 123.7 GB fit by themselves, leaving 14 GB for a 23.0 GB pool: TP 2.
    Fails (was seen to) with fits judged on the weights alone (Nemotron-H-56B and Qwen3.5-122B FP8 then TP 1)."""
    expected = {"Qwen3-Next-80B-A3B": (2, 1), "Qwen3.5-397B-A17B": (8, 4), "Nemotron-H-56B-Base-8K": (2, 2),
                "Qwen3.5-122B-A10B": (2, 2)}
    for name, (bf16, fp8) in expected.items():
        s = summary(name)
        assert (s.smallest_tp(fp8=False), s.smallest_tp(fp8=True)) == (bf16, fp8), name
    assert summary("Qwen3-Next-80B-A3B").num_params == 79_674_391_296


def test_cli_config_only(tmp_path, capsys):
    """`jhybrid inspect --config-only` takes a directory or the config.json file, prints the summary (and
    JSON with --json), reads an FP8 release's quantization_config, and reports an unsupported one as a usage
    error naming the field."""
    d = REAL_CONFIGS / "Qwen3.5-35B-A3B"
    assert main(["inspect", "--config-only", str(d)]) == 0
    text = capsys.readouterr().out
    for part in ("active per token", "FP8", "KV cache", "linear_attention: 30 layers", "vision_config",
                 "smallest tensor-parallel size", "fits"):
        assert part in text, part
    assert main(["inspect", "--config-only", "--json", str(d / "config.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    s = summarize_config(d)
    assert out["num_params"] == s.num_params and out["smallest_tensor_parallel_size"]["fp8"] == s.smallest_tp(True)
    assert "mtp_num_hidden_layers" in out["ignored_fields"] and out["kv_bytes_per_token"] == s.kv_bytes_per_token
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    (tmp_path / "fp8.json").write_text(json.dumps({**published("Qwen3-Next-80B-A3B"), "quantization_config": fp8}))
    assert main(["inspect", "--config-only", str(tmp_path / "fp8.json")]) == 0
    assert '"quant_method": "fp8"' in capsys.readouterr().out  # an FP8 release's config reads, and says so
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**published("Qwen3.5-35B-A3B"), "quantization_config": {"quant_method": "awq"}}))
    assert main(["inspect", "--config-only", str(tmp_path)]) == 2
    assert "quant_method='awq'" in capsys.readouterr().err
