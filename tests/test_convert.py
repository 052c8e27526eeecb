"""HF checkpoint -> jhybrid params: name maps, transforms, sharding, dtypes, validation, the converted format."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import ConversionError, convert, load_hf_params
from converters.safetensors_io import SafetensorsCheckpoint
from jhybrid.checkpoint import inspect_checkpoint, is_converted, load_model
from jhybrid.models.params import flatten_params, flatten_shapes, param_shapes
from tests.hf_models import make_llama, make_qwen3, make_qwen3_5, make_qwen3_next


# ----- fixtures: tiny HF checkpoints, built once per module -----
@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    built = {}

    def get(name):
        if name not in built:
            path = root / name
            builders = {
                "q3n_moe": lambda: make_qwen3_next(path, moe=True),
                "q3n_moe_sharded": lambda: make_qwen3_next(path, moe=True, max_shard_size="20KB"),
                "q3n_dense": lambda: make_qwen3_next(path, moe=False, seed=1),
                "q35": lambda: make_qwen3_5(path, seed=2),
                "q35_bf16": lambda: make_qwen3_5(path, seed=3, dtype=torch.bfloat16, max_shard_size="20KB"),
                "q35_mm": lambda: make_qwen3_5(path, seed=4, multimodal=True),
                "qwen3": lambda: make_qwen3(path, seed=5),
                "qwen3_tied": lambda: make_qwen3(path, seed=6, tie_word_embeddings=True),
                "llama": lambda: make_llama(path, seed=7, attention_bias=True, mlp_bias=True),
            }
            built[name] = (path, builders[name]())
        return built[name]

    return get


def _np(x) -> np.ndarray:
    return np.asarray(x.float().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32))


def _flat(params) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float32) for k, v in flatten_params(params).items()}


# ----- the inverse transform: jhybrid flat params -> HF in-memory state dict (written independently) -----
def _pack_qkvz(cfg, qkv, z):
    """jhybrid [D, q|k|v] and [D, z] -> HF in_proj_qkvz [HK*(2K+2rV), D], packed per key-head group."""
    hk, hv, k, v = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r, kd = hv // hk, hk * k
    q_, k_, v_ = qkv[:, :kd].T, qkv[:, kd : 2 * kd].T, qkv[:, 2 * kd :].T
    groups = []
    for g in range(hk):
        groups += [q_[g * k : (g + 1) * k], k_[g * k : (g + 1) * k], v_[g * r * v : (g + 1) * r * v], z.T[g * r * v : (g + 1) * r * v]]
    return np.concatenate(groups, axis=0)


def _pack_ba(cfg, b, a):
    hk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    return np.concatenate([x for g in range(hk) for x in (b.T[g * r : (g + 1) * r], a.T[g * r : (g + 1) * r])], axis=0)


def to_hf(cfg, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {"model.embed_tokens.weight": flat["embed"], "model.norm.weight": flat["final_norm"]}
    if "lm_head" in flat:
        out["lm_head.weight"] = flat["lm_head"].T
    for i in range(cfg.num_layers):
        p, j = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = flat[j + "input_norm"]
        out[p + "post_attention_layernorm.weight"] = flat[j + "post_norm"]
        for name, x in flat.items():
            if not name.startswith(j):
                continue
            rest = name[len(j) :]
            if rest.startswith("attn."):
                key = rest[5:]
                if key.endswith("_bias"):
                    out[f"{p}self_attn.{key[0]}_proj.bias"] = x
                else:
                    out[f"{p}self_attn.{key}.weight"] = x.T if key.endswith("proj") else x
            elif rest.startswith("gdn."):
                key, q = rest[4:], p + "linear_attn."
                if key in ("dt_bias", "A_log"):
                    out[q + key] = x
                elif key == "conv_weight":
                    out[q + "conv1d.weight"] = x[:, None, :]
                elif key == "norm":
                    out[q + "norm.weight"] = x
                elif cfg.model_type != "qwen3_next" or key == "out_proj":
                    out[f"{q}{key}.weight"] = x.T
            elif rest.startswith("mlp."):
                key, q = rest[4:], p + "mlp."
                if key == "router":
                    out[q + "gate.weight"] = x.T
                elif key == "shared_gate":
                    out[q + "shared_expert_gate.weight"] = x.T
                elif key.startswith("shared."):
                    out[f"{q}shared_expert.{key[7:]}.weight"] = x.T
                elif x.ndim == 3 and key == "down_proj":
                    out[q + "experts.down_proj"] = x.transpose(0, 2, 1)
                elif x.ndim == 3 and key == "gate_proj":
                    out[q + "experts.gate_up_proj"] = np.concatenate(
                        [x.transpose(0, 2, 1), flat[j + "mlp.up_proj"].transpose(0, 2, 1)], axis=1
                    )
                elif key.endswith("_bias"):
                    out[f"{q}{key[:-5]}_proj.bias"] = x
                elif x.ndim == 2:
                    out[f"{q}{key}.weight"] = x.T
        if cfg.model_type == "qwen3_next" and cfg.layer_kinds[i] == "linear_attention":
            g = j + "gdn."
            out[p + "linear_attn.in_proj_qkvz.weight"] = _pack_qkvz(cfg, flat[g + "in_proj_qkv"], flat[g + "in_proj_z"])
            out[p + "linear_attn.in_proj_ba.weight"] = _pack_ba(cfg, flat[g + "in_proj_b"], flat[g + "in_proj_a"])
    return out


def assert_matches_hf(cfg, params, model, exact=True):
    flat = _flat(params)
    expected_shapes = flatten_shapes(param_shapes(cfg))
    assert set(flat) == set(expected_shapes)
    assert {k: v.shape for k, v in flat.items()} == expected_shapes
    state = {k: _np(v) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    rebuilt = to_hf(cfg, flat)
    assert set(rebuilt) == set(state)
    for name, ref in state.items():
        got = rebuilt[name]
        assert got.shape == ref.shape, name
        if exact:
            np.testing.assert_array_equal(got, ref, err_msg=name)
        else:
            np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2, err_msg=name)


# ----- conversion equals the HF weights -----
@pytest.mark.parametrize("name", ["q3n_moe", "q3n_dense", "q35", "qwen3", "qwen3_tied", "llama"])
def test_converted_params_equal_hf_state_dict(hf, name):
    path, model = hf(name)
    cfg, params = load_hf_params(path)
    assert cfg.dtype == "float32"
    assert_matches_hf(cfg, params, model)


def test_qwen3_next_qkvz_unpacking_matches_hf_fix_ordering(hf):
    """Independent route: HF's own fix_query_key_value_ordering on x @ W_qkvz vs x @ jhybrid in_proj_*."""
    path, model = hf("q3n_moe")
    cfg, params = load_hf_params(path)
    x = torch.randn(2, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    gdn_hf = model.model.layers[0].linear_attn
    with torch.no_grad():
        q, k, v, z, b, a = gdn_hf.fix_query_key_value_ordering(gdn_hf.in_proj_qkvz(x), gdn_hf.in_proj_ba(x))
    gdn = params["layers"][0]["gdn"]
    xn = x.numpy()
    qkv = xn @ np.asarray(gdn["in_proj_qkv"])
    kd = cfg.linear_key_dim
    flat = lambda t: t.reshape(2, 5, -1).numpy()  # noqa: E731  [B, T, heads*dim]
    np.testing.assert_allclose(qkv[..., :kd], flat(q), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(qkv[..., kd : 2 * kd], flat(k), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(qkv[..., 2 * kd :], flat(v), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(xn @ np.asarray(gdn["in_proj_z"]), flat(z), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(xn @ np.asarray(gdn["in_proj_b"]), b.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(xn @ np.asarray(gdn["in_proj_a"]), a.numpy(), rtol=1e-5, atol=1e-6)


def test_sharded_equals_single_file(hf):
    path, _ = hf("q3n_moe")
    sharded, _ = hf("q3n_moe_sharded")
    assert os.path.exists(sharded / "model.safetensors.index.json")
    a, b = _flat(load_hf_params(path)[1]), _flat(load_hf_params(sharded)[1])
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_fused_expert_layout_accepted(hf, tmp_path):
    """HF's in-memory (fused) MoE layout: experts.gate_up_proj [E, 2*Ie, D], experts.down_proj [E, D, Ie]."""
    path, model = hf("q3n_moe")
    out = tmp_path / "fused"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, out / "model.safetensors")
    shutil.copy(path / "config.json", out / "config.json")
    assert "model.layers.0.mlp.experts.gate_up_proj" in SafetensorsCheckpoint(out).names()
    cfg, params = load_hf_params(out)
    assert_matches_hf(cfg, params, model)


def test_bf16_round_trips_exactly(hf):
    path, model = hf("q35_bf16")
    cfg, params = load_hf_params(path)  # default dtype: the checkpoint's
    assert cfg.dtype == "bfloat16"
    leaves = flatten_params(params)
    assert leaves["layers.3.attn.q_proj"].dtype == np.dtype("bfloat16")
    assert leaves["layers.0.gdn.A_log"].dtype == np.float32  # kept float32 (converters.dtypes)
    assert_matches_hf(cfg, params, model, exact=True)


def test_bf16_reader_matches_torch(hf):
    path, _ = hf("q35_bf16")
    ref = {}
    for shard in os.listdir(path):
        if shard.endswith(".safetensors"):
            ref |= load_file(path / shard)
    with SafetensorsCheckpoint(path) as ckpt:
        assert set(ckpt.names()) == set(ref)
        for name, t in ref.items():
            got = ckpt.read(name)
            assert str(got.dtype) == "bfloat16"
            np.testing.assert_array_equal(got.astype(np.float32), t.float().numpy(), err_msg=name)


def test_dtype_cast(hf):
    path, model = hf("qwen3")
    cfg, params = load_hf_params(path, dtype="bf16")
    assert cfg.dtype == "bfloat16"
    q = flatten_params(params)["layers.0.attn.q_proj"]
    assert q.dtype == np.dtype("bfloat16")
    ref = model.model.layers[0].self_attn.q_proj.weight.detach().T.to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(q, dtype=np.float32), ref)
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_hf_params(path, dtype="int8")


def test_multimodal_qwen3_5_layout(hf):
    path, model = hf("q35_mm")
    cfg, params = load_hf_params(path)
    assert cfg.model_type == "qwen3_5" and cfg.num_linear_layers == 3
    assert_matches_hf(cfg, params, model)


def test_tied_lm_head_on_disk_is_ignored(hf, tmp_path):
    path, model = hf("qwen3_tied")
    out = tmp_path / "tied"
    shutil.copytree(path, out)
    tensors = load_file(out / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, out / "model.safetensors")
    cfg, params = load_hf_params(out)
    assert "lm_head" not in params
    assert_matches_hf(cfg, params, model)


# ----- the converted format -----
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convert_then_load_equals_hf(hf, tmp_path, dtype):
    path, _ = hf("q3n_moe")
    out = convert(path, tmp_path / "jh", dtype=dtype, progress=False)
    assert is_converted(out) and not is_converted(path)
    marker = json.load(open(os.path.join(out, "jhybrid.json")))
    assert marker["format"] == "jhybrid" and marker["version"] == 1 and marker["dtype"] == dtype
    assert os.path.isfile(os.path.join(out, "generation_config.json"))
    cfg_c, p_c = load_model(out)
    cfg_h, p_h = load_model(path, dtype=dtype)
    assert cfg_c == cfg_h
    a, b = flatten_params(p_c), flatten_params(p_h)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(np.asarray(a[k], np.float32), np.asarray(b[k], np.float32), err_msg=k)
    info = inspect_checkpoint(out)
    assert info.format == "jhybrid" and info.dtypes["layers.0.gdn.A_log"] == "float32"


def test_convert_refuses_nonempty_out_dir(hf, tmp_path):
    path, _ = hf("qwen3")
    out = tmp_path / "jh"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite"):
        convert(path, out, progress=False)
    assert (out / "keep.txt").read_text() == "old"
    convert(path, out, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and is_converted(out)
    assert sorted(os.listdir(tmp_path)) == ["jh"]  # no temporary directories left behind


# ----- validation errors -----
def _broken_copy(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_missing_tensor(hf, tmp_path):
    path, _ = hf("qwen3")
    bad = _broken_copy(path, tmp_path / "bad", lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ConversionError, match=r"missing tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        load_hf_params(bad)


def test_unexpected_tensor(hf, tmp_path):
    path, _ = hf("qwen3")
    bad = _broken_copy(path, tmp_path / "bad", lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(3)}))
    with pytest.raises(ConversionError, match=r"unexpected tensor 'model\.layers\.0\.extra\.weight'"):
        load_hf_params(bad)


def test_misshaped_tensor(hf, tmp_path):
    path, _ = hf("q3n_moe")
    bad = _broken_copy(
        path, tmp_path / "bad", lambda t: t.update({"model.layers.1.linear_attn.in_proj_ba.weight": torch.zeros(6, 32)})
    )
    with pytest.raises(ConversionError) as err:
        load_hf_params(bad)
    msg = str(err.value)
    assert "model.layers.1.linear_attn.in_proj_ba.weight" in msg and "expected (8, 32)" in msg and "found (6, 32)" in msg
    out = tmp_path / "out"
    with pytest.raises(ConversionError):
        convert(bad, out, progress=False)
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["bad"]


def test_unknown_model_type(hf, tmp_path):
    path, _ = hf("qwen3")
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.load(open(bad / "config.json"))
    config["model_type"] = "mamba"
    json.dump(config, open(bad / "config.json", "w"))
    with pytest.raises(ConversionError, match="unsupported model_type 'mamba'"):
        load_hf_params(bad)
    with pytest.raises(ConversionError, match="mamba"):
        convert(bad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_broken_converted_checkpoint(hf, tmp_path):
    from converters.orbax_io import save_flat

    path, _ = hf("qwen3")
    out = convert(path, tmp_path / "jh", dtype="float32", progress=False)
    flat = {k: np.asarray(v) for k, v in flatten_params(load_model(out)[1]).items()}
    flat.pop("layers.1.attn.k_norm")
    flat["layers.0.attn.q_proj"] = flat["layers.0.attn.q_proj"][:, :8]
    shutil.rmtree(os.path.join(out, "params"))
    save_flat(os.path.join(out, "params"), flat)
    with pytest.raises(ConversionError) as err:
        load_model(out)
    assert "missing parameter 'layers.1.attn.k_norm'" in str(err.value)
    assert "'layers.0.attn.q_proj' has the wrong shape: expected (32, 64), found (32, 8)" in str(err.value)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        load_model(tmp_path / "nope")
