"""The `jhybrid` command line: convert, inspect, and its error handling (generate is tested with the engine)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from jhybrid.checkpoint import is_converted, load_model
from jhybrid.cli import main
from tests.hf_models import make_qwen3_5, make_qwen3_next, write_tiny_tokenizer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "hf"
    make_qwen3_next(path, moe=True)
    write_tiny_tokenizer(path)
    return path


def test_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("generate", "convert", "inspect"):
        assert command in out


def test_convert_and_inspect(hf_dir, tmp_path, capsys):
    out = tmp_path / "jh"
    assert main(["convert", str(hf_dir), str(out), "--dtype", "bfloat16", "--no-progress"]) == 0
    assert is_converted(out)
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    assert f"wrote {out}" in capsys.readouterr().out

    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("linear_attention") >= 3 and "full_attention" in text and "moe" in text
    assert "KV cache: 128 bytes per token" in text  # 1 full layer x 2 x 2 kv heads x 16 x 2 bytes (bf16)
    assert "bytes per sequence" in text and "bfloat16" in text and "float32 (6 tensors)" in text
    cfg, _ = load_model(out)
    assert f"{cfg.state_bytes_per_sequence():,} bytes per sequence" in text

    assert main(["inspect", str(hf_dir), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "hf" and summary["dtype"] == "float32"
    assert [layer["kind"] for layer in summary["layers"]] == ["linear_attention"] * 3 + ["full_attention"]
    assert summary["kv_bytes_per_token"] == 256  # float32 checkpoint: 4 bytes per element
    assert summary["num_params"] == sum(layer["num_params"] for layer in summary["layers"]) + sum(summary["other_params"].values())


def test_convert_refuses_to_overwrite(hf_dir, tmp_path, capsys):
    out = tmp_path / "jh"
    out.mkdir()
    (out / "x").write_text("keep")
    assert main(["convert", str(hf_dir), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "--overwrite" in err and "Traceback" not in err
    assert main(["convert", str(hf_dir), str(out), "--overwrite", "--no-progress"]) == 0
    assert is_converted(out)


def test_inspect_broken_checkpoint(tmp_path, capsys):
    path = tmp_path / "hf"
    make_qwen3_5(path)
    tensors = load_file(path / "model.safetensors")
    tensors.pop("model.layers.3.self_attn.k_norm.weight")
    tensors["model.layers.0.linear_attn.in_proj_z.weight"] = torch.zeros(16, 32)
    save_file(tensors, path / "model.safetensors")
    capsys.readouterr()  # drop save_pretrained's progress bar
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "Traceback" not in err
    assert "missing tensor 'model.layers.3.self_attn.k_norm.weight'" in err
    assert "'model.layers.0.linear_attn.in_proj_z.weight' has the wrong shape: expected (32, 32), found (16, 32)" in err


def test_inspect_unsupported_model_type(hf_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    config = json.load(open(bad / "config.json"))
    config["model_type"] = "gpt2"
    json.dump(config, open(bad / "config.json", "w"))
    assert main(["inspect", str(bad)]) == 2
    assert "unsupported model_type 'gpt2'" in capsys.readouterr().err


def test_inspect_not_a_checkpoint(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a checkpoint" in capsys.readouterr().err


def test_generate_missing_model_dir_is_a_clear_error(tmp_path, capsys):
    # without --model, generate runs the bundled model (tests/test_bundled_model.py); a wrong path must fail
    missing = tmp_path / "no-such-checkpoint"
    assert main(["generate", "--model", str(missing), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and str(missing) in err


def test_serve_passes_host_tier_options(monkeypatch):
    import jhybrid.server

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)  # set by conftest for the test run
    seen = {}
    monkeypatch.setattr(jhybrid.server, "serve", lambda model, **kw: seen.update(kw, model=model))
    assert main(["serve", "--model", "m", "--host-kv-memory-gb", "2.5", "--preemption-mode", "swap"]) == 0
    assert seen["model"] == "m" and seen["host_kv_memory_gb"] == 2.5 and seen["preemption_mode"] == "swap"
    assert seen["offload_policy"] == "cost" and seen["warmup"] is True  # the defaults: compile before serving,
    assert seen["compilation_cache_dir"].endswith(os.path.join("jhybrid", "jax"))  # with a cache on disk,
    assert seen["enable_prefix_caching"] is True and seen["prefix_snapshot_prompt_end"] is False  # prefix caching
    assert main(["serve", "m", "--no-enable-prefix-caching", "--prefix-snapshot-prompt-end"]) == 0
    assert seen["enable_prefix_caching"] is False and seen["prefix_snapshot_prompt_end"] is True
    assert main(["serve", "--model", "m", "--host-kv-memory-gb", "1", "--kv-offload", "copy", "--offload-policy",
                 "always", "--no-warmup", "--no-compilation-cache"]) == 0
    assert seen["kv_offload"] == "copy" and seen["offload_policy"] == "always" and seen["warmup"] is False
    assert seen["compilation_cache_dir"] is None
    assert main(["serve", "--model", "m", "--compilation-cache-dir", "/tmp/jh-cache"]) == 0
    assert seen["compilation_cache_dir"] == "/tmp/jh-cache"
    with pytest.raises(SystemExit):  # argparse rejects an unknown mode
        main(["serve", "--model", "m", "--preemption-mode", "sometimes"])
    with pytest.raises(SystemExit):
        main(["serve", "--model", "m", "--offload-policy", "sometimes"])


def test_serve_takes_the_model_as_positional_or_flag(monkeypatch, capsys):
    """`jhybrid serve DIR` as `vllm serve DIR` does, `--model DIR` as before; neither, or two different ones, is
    a usage error naming the problem."""
    import jhybrid.server

    seen = []
    monkeypatch.setattr(jhybrid.server, "serve", lambda model, **kw: seen.append(model))
    assert main(["serve", "some/dir"]) == 0 and main(["serve", "--model", "other/dir"]) == 0
    assert main(["serve", "same", "--model", "same"]) == 0
    assert seen == ["some/dir", "other/dir", "same"]
    assert main(["serve"]) == 2 and "no model given" in capsys.readouterr().err
    assert main(["serve", "a", "--model", "b"]) == 2 and "two models given" in capsys.readouterr().err
    assert seen == ["some/dir", "other/dir", "same"]
