"""Block-wise FP8 checkpoints (issue 22): e4m3 weights with `weight_scale_inv` per block, dequantized as they are read.

The checkpoint is made here from a random tiny Qwen3-Next MoE (fp32) as transformers' `Fp8Quantize` makes one:
per block of `weight_block_size` the scale is 448 / max|w|, the weight is stored as float8_e4m3fn of
`w * scale` and the block's `weight_scale_inv = 1 / scale` as float32 (`[ceil(out/b0), ceil(in/b1)]`; a
partial last block is quantized over its own elements). Linear weights are quantized; the embeddings, LM head,
routers and shared-expert gates stay fp32 (`modules_to_not_convert`), like conv and norms. The block is
[8, 16] (not square, so swapped block axes show; the tiny model's widths are far below 128; whole and partial
blocks both occur: the shared expert's down_proj has 24 input columns).

Checked: the loaded weights equal the dequantized ones exactly (against the same model stored dequantized,
unquantized, and loaded by the ordinary path); the logits equal HF's running the dequantized weights (1e-5)
and are within FP8 rounding of the original model's; refused, naming what is wrong: other quantization
methods and fields jhybrid cannot honour, missing / mis-shaped / orphan scales, FP8 weights of a module listed
in `modules_to_not_convert`, and FP8 tensors without a quantization_config.
"""

from __future__ import annotations

import json
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import ConversionError
from converters.fp8 import _dequantize_device, dequantize
from jhybrid.checkpoint import inspect_checkpoint, load_model
from jhybrid.config import ModelConfig
from jhybrid.models.params import flatten_params
from tests.hf_models import make_qwen3_next
from tests.runner_helpers import SequenceRunner

BLOCK = (8, 16)
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
SKIP = ["lm_head", "model.embed_tokens", "mlp.gate", "shared_expert_gate"]
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
         "modules_to_not_convert": SKIP}


def quantize_blockwise(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [..., R, C]` -> (float8_e4m3fn weight, float32 weight_scale_inv [..., ceil(R/b0), ceil(C/b1)])."""
    b0, b1 = block
    *lead, rows, cols = w.shape
    nr, nc = -(-rows // b0), -(-cols // b1)
    padded = torch.zeros(*lead, nr * b0, nc * b1)
    padded[..., :rows, :cols] = w.float()
    blocks = padded.reshape(*lead, nr, b0, nc, b1)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nr, nc]
    scale = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))
    q = (blocks * scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(*lead, nr * b0, nc * b1)[..., :rows, :cols].contiguous(), (1.0 / scale).float()


def dequantize_reference(q: torch.Tensor, scale_inv: torch.Tensor, block=BLOCK) -> torch.Tensor:
    rows, cols = q.shape[-2:]
    full = scale_inv.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
    return q.float() * full


def _quantized(name: str, t: torch.Tensor) -> bool:
    module = name.removesuffix(".weight")
    skipped = any(module.endswith(s) or module.startswith(s) for s in SKIP)
    return name.endswith(".weight") and t.ndim == 2 and not skipped


def _write(path, tensors: dict, config: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=1))


def write_fp8_copy(src, fp8_dir, deq_dir, block=BLOCK) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Writes the HF checkpoint in `src` as an FP8 checkpoint to `fp8_dir` (each `_quantized` weight as transformers'
    `Fp8Quantize` stores it, in blocks of `block`) and with those weights dequantized to `deq_dir`; returns
    `{name: (e4m3 weight, weight_scale_inv)}` of the quantized weights."""
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    fp8, deq, stored = {}, {}, {}
    for name, t in tensors.items():
        if _quantized(name, t):
            q, s = quantize_blockwise(t, block)
            fp8[name], fp8[name.removesuffix(".weight") + ".weight_scale_inv"] = q, s
            deq[name] = dequantize_reference(q, s, block)
            stored[name] = (q, s)
        else:
            fp8[name] = deq[name] = t
    _write(fp8_dir, fp8, {**config, "quantization_config": {**QUANT, "weight_block_size": list(block)}})
    _write(deq_dir, deq, config)
    return stored


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(original HF model, HF model of the dequantized weights, FP8 dir, dequantized dir, quantized names)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fp8")
    original = make_qwen3_next(root / "orig", moe=True, seed=7)
    names = list(write_fp8_copy(root / "orig", root / "fp8", root / "deq"))
    hf_deq = AutoModelForCausalLM.from_pretrained(str(root / "deq"), dtype=torch.float32).eval()
    return original, hf_deq, root / "fp8", root / "deq", names


def test_fp8_weights_load_dequantized_exactly(ckpts, capsys):
    """Every parameter loaded from the FP8 checkpoint equals (bitwise, fp32 and bf16) the one loaded from the
    dequantized copy; the quantized ones differ from the original fp32 weights (FP8 rounding happened);
    `inspect` validates it from headers, reporting the e4m3 storage and the FP8 tensors. Fails (was seen to) with the scale
    tensors not consumed (refused as unexpected tensors) and with the scales applied per transposed block."""
    _, _, fp8_dir, deq_dir, names = ckpts
    assert len(names) >= 20
    for dtype in ("float32", "bfloat16"):
        got = flatten_params(load_model(fp8_dir, dtype=dtype)[1])
        want = flatten_params(load_model(deq_dir, dtype=dtype)[1])
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and np.array_equal(np.asarray(got[k]), np.asarray(want[k])), (dtype, k)
    orig = flatten_params(load_model(fp8_dir.parent / "orig", dtype="float32")[1])
    got = flatten_params(load_model(fp8_dir, dtype="float32")[1])
    assert not np.array_equal(np.asarray(got["layers.3.attn.o_proj"]), np.asarray(orig["layers.3.attn.o_proj"]))
    assert np.array_equal(np.asarray(got["lm_head"]), np.asarray(orig["lm_head"]))  # not converted
    info = inspect_checkpoint(fp8_dir)
    assert info.dtypes["layers.3.attn.o_proj"] == "float8_e4m3fn" and info.dtypes["embed"] == "float32"
    assert info.quantization == {"weight_block_size": BLOCK, "num_fp8_tensors": len(names)}
    from jhybrid.cli import main

    assert main(["inspect", str(fp8_dir)]) == 0
    assert f"FP8 weights: {len(names)} tensors in float8_e4m3fn with a scale per 8x16 block" in capsys.readouterr().out


def test_convert_fp8_checkpoint(ckpts, tmp_path):
    """`jhybrid convert` of an FP8 checkpoint writes the dequantized parameters, and its config.json without the
    quantization_config (the converted params are not FP8). Fails (was seen to) with config.json copied as is."""
    from converters import convert

    out = convert(ckpts[2], tmp_path / "jh", dtype="float32", progress=False)
    assert "quantization_config" not in json.loads((tmp_path / "jh" / "config.json").read_text())
    got = flatten_params(load_model(out)[1])
    want = flatten_params(load_model(ckpts[3], dtype="float32")[1])
    assert all(np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in want)


def test_fp8_logits_match_dequantized_hf(ckpts):
    """Prefill logits of the FP8 checkpoint equal HF's with the dequantized weights (relative error <= 1e-5), so
    they differ from the original model's by FP8 rounding only: by what HF's dequantized model differs (to
    1e-5). That difference is large for a random 4-layer model, ~0.4 relative (random norms and weights
    amplify every perturbation; the rounding itself is bounded per weight in
    `test_quantized_weights_are_within_fp8_rounding`). Shapes as test_model_parity.py's (one compiled
    program). Fails (was seen to) with the scales applied per transposed block."""
    original, hf_deq, fp8_dir, _, _ = ckpts
    cfg, params = load_model(fp8_dir, dtype="float32")
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, size=77).tolist()
    runner = SequenceRunner(cfg, params, max_len=128)
    table, slot = runner.start()
    got = np.asarray(runner.step(ids, 0, table, slot, all_logits=True), np.float64)

    def hf(model):
        with torch.no_grad():
            out = model(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None], use_cache=False)
        return out.logits[0].double().numpy()

    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    want_deq, want_orig = hf(hf_deq), hf(original)
    err = rel(got, want_deq)
    print(f"FP8 vs HF dequantized {err:.2e}; vs original {rel(got, want_orig):.2e} (HF's {rel(want_deq, want_orig):.2e})")
    assert err <= 1e-5, f"FP8 checkpoint vs HF dequantized: relative error {err:.2e}"
    assert abs(rel(got, want_orig) - rel(want_deq, want_orig)) <= 1e-5


def test_quantized_weights_are_within_fp8_rounding(ckpts):
    """Each dequantized weight is the original rounded to e4m3 within its block's scale: |w - w8| <= 2^-4 |w|
    (3 mantissa bits, round to nearest) or, for the block's smallest values, half the subnormal step 2^-10
    times the block's scale (the test's own quantizer; the bound checks it makes what the format defines)."""
    original, hf_deq, *_ = ckpts
    deq = dict(hf_deq.named_parameters())
    checked = 0
    for name, w in original.named_parameters():
        if w.ndim != 2 or not name.endswith(".weight") or torch.equal(w, deq[name]):
            continue
        _, scale_inv = quantize_blockwise(w)
        step = scale_inv.repeat_interleave(BLOCK[0], 0)[: w.shape[0]].repeat_interleave(BLOCK[1], 1)[:, : w.shape[1]]
        err = (w - deq[name]).abs()
        assert bool((err <= 2**-4 * w.abs() + 2**-10 * step + 1e-12).all()), name
        checked += 1
    assert checked >= 20


def test_fused_fp8_experts(ckpts, tmp_path):
    """Experts stored fused (`mlp.experts.gate_up_proj [E, 2Ie, D]`, `down_proj [E, D, Ie]`) in FP8, with
    `gate_up_proj_scale_inv [E, ceil(2Ie/b0), ceil(D/b1)]` as transformers names a fused parameter's scale, load
    as the same checkpoint stored dequantized. Fails (was seen to) with the scale looked up as
    `*.weight_scale_inv` only (the fused weights' scales are then missing)."""
    tensors = load_file(str(ckpts[2].parent / "orig" / "model.safetensors"))
    config = json.loads((ckpts[2].parent / "orig" / "config.json").read_text())
    fp8, deq = {}, {}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        e = [k for k in tensors if k.startswith(p)]
        gate_up = torch.stack([torch.cat([tensors[f"{p}{j}.gate_proj.weight"], tensors[f"{p}{j}.up_proj.weight"]])
                               for j in range(config["num_experts"])])
        down = torch.stack([tensors[f"{p}{j}.down_proj.weight"] for j in range(config["num_experts"])])
        for k in e:
            del tensors[k]
        for name, w in ((p + "gate_up_proj", gate_up), (p + "down_proj", down)):
            q, s = quantize_blockwise(w)
            fp8[name], fp8[name + "_scale_inv"], deq[name] = q, s, dequantize_reference(q, s)
    _write(tmp_path / "fp8", {**tensors, **fp8}, {**config, "quantization_config": QUANT})
    _write(tmp_path / "deq", {**tensors, **deq}, config)
    got = flatten_params(load_model(tmp_path / "fp8", dtype="float32")[1])
    want = flatten_params(load_model(tmp_path / "deq", dtype="float32")[1])
    assert all(np.array_equal(np.asarray(got[k]), np.asarray(want[k])) for k in want)
    assert not np.array_equal(np.asarray(got["layers.0.mlp.up_proj"]), np.asarray(
        flatten_params(load_model(ckpts[2].parent / "orig", dtype="float32")[1])["layers.0.mlp.up_proj"]))


def test_dequantize_partial_blocks():
    """`converters.fp8.dequantize` (host: convert) and its device twin (load) against an element-by-element
    loop, for whole and partial blocks in both dims and a leading expert dim. Fails (was seen to) with the
    partial-block path indexing scales by `i // b1` for rows."""
    rng = np.random.default_rng(0)
    for shape, block in (((2, 16, 32), (8, 16)), ((3, 21, 37), (8, 16)), ((20, 7), (16, 4))):
        w = rng.normal(0, 4, shape).astype(ml_dtypes.float8_e4m3fn)
        s = rng.uniform(0.1, 2, (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))).astype(np.float32)
        want = np.empty(shape, np.float32)
        for idx in np.ndindex(*shape):
            *lead, i, j = idx
            want[idx] = np.float32(w[idx]) * s[(*lead, i // block[0], j // block[1])]
        assert np.array_equal(dequantize(w, s, block), want), (shape, block)
        on_device = _dequantize_device(jnp.asarray(w), jnp.asarray(s), block)  # what load_model runs
        assert np.array_equal(np.asarray(on_device), want), (shape, block)


# ------------------------------------------------------------------------------------------- refusals
def _config_raises(quant: dict, *names) -> None:
    hf = {**json.loads(json.dumps(_config())), "quantization_config": quant}
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(hf)
    for name in names:
        assert name in str(e.value), f"{name!r} not named in: {e.value}"


def _config() -> dict:
    return {"model_type": "qwen3_next", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 64,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8}


def test_unsupported_quantization_configs_are_named():
    """Another method, or an FP8 field jhybrid cannot honour, raises naming it; the FP8 config reads. Fails
    (was seen to) with the quantization_config check removed (the config then reads, quantization ignored)."""
    assert ModelConfig.from_hf({**_config(), "quantization_config": QUANT}) == ModelConfig.from_hf(_config())
    _config_raises({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'")
    _config_raises({**QUANT, "activation_scheme": "static"}, "activation_scheme='static'")
    _config_raises({**QUANT, "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'")
    _config_raises({**QUANT, "fmt": "e5m2"}, "fmt='e5m2'")
    _config_raises({**QUANT, "weight_block_size": None}, "weight_block_size=None")
    _config_raises({**QUANT, "modules_to_convert": ["model.embed_tokens"]}, "modules_to_convert")
    _config_raises({**QUANT, "kv_cache_scheme": "fp8"}, "kv_cache_scheme")


def _variant(ckpts, tmp_path, edit_tensors=None, edit_quant=None):
    src = ckpts[2]
    shutil.copytree(src, tmp_path / "v")
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_quant:
        config = edit_quant(config)
    _write(tmp_path / "v", tensors, config)
    return tmp_path / "v"


@pytest.mark.parametrize("case, named", [
    ("missing scale", ["model.layers.3.self_attn.o_proj.weight_scale_inv", "missing"]),
    ("misshaped scale", ["model.layers.3.self_attn.o_proj.weight_scale_inv", "(4, 2)"]),
    ("orphan scale", ["model.embed_tokens.weight_scale_inv", "no FP8 weight"]),
    ("listed as not converted", ["model.layers.3.self_attn.o_proj.weight", "modules_to_not_convert"]),
    ("no quantization_config", ["float8", "quantization_config"]),
])
def test_inconsistent_fp8_checkpoints_are_named(ckpts, tmp_path, case, named):
    """Each inconsistency is refused (at open, from headers) naming the tensor. Fails (was seen to) with
    `converters.fp8.pair_scales`'s checks removed (the missing scale then loads unscaled weights)."""
    scale = "model.layers.3.self_attn.o_proj.weight_scale_inv"
    edits = {
        "missing scale": dict(edit_tensors=lambda t: t.pop(scale)),
        "misshaped scale": dict(edit_tensors=lambda t: t.update({scale: torch.ones(4, 2)})),
        "orphan scale": dict(edit_tensors=lambda t: t.update({"model.embed_tokens.weight_scale_inv": torch.ones(16, 2)})),
        "listed as not converted": dict(edit_quant=lambda c: {**c, "quantization_config": {
            **QUANT, "modules_to_not_convert": SKIP + ["self_attn.o_proj"]}}),
        "no quantization_config": dict(edit_quant=lambda c: {k: v for k, v in c.items() if k != "quantization_config"}),
    }
    path = _variant(ckpts, tmp_path, **edits[case])
    with pytest.raises(ConversionError) as e:
        load_model(path, dtype="float32")
    for name in named:
        assert name in str(e.value), f"{case}: {name!r} not named in: {e.value}"
