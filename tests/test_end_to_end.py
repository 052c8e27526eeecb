"""End to end: the example's NumPy-written HF checkpoint, the CLI's generate, conversion, and the README."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

import jhybrid
from jhybrid.cli import main
from tests.example_ckpt import write_example_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_example_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=7)


@pytest.mark.slow
def test_example_checkpoint_loads_in_hf_and_generates_the_same(tiny_dir):
    """The example writes HF's layout by hand; HF itself must load it and agree with jhybrid."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    text = "The capital of France is"
    ids = tok(text)["input_ids"]
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids):]
    (out,) = jhybrid.generate(tiny_dir, [text], max_tokens=16, ignore_eos=True)
    assert out.prompt_token_ids == ids, "jhybrid's tokenizer must encode like HF's"
    assert out.token_ids == want.tolist()
    assert out.text == tok.decode(want, skip_special_tokens=True)


@pytest.mark.slow
def test_cli_generate_and_converted_checkpoint(tiny_dir, tmp_path, capsys):
    assert main(["generate", "--model", tiny_dir, "--prompt", "Once upon a time", "--max-tokens", "8"]) == 0
    printed_hf = capsys.readouterr().out
    llm = jhybrid.LLM(tiny_dir, dtype=None, max_num_seqs=1, max_model_len=64)  # the CLI's engine for this prompt
    (want,) = llm.generate(["Once upon a time"], jhybrid.SamplingParams(max_tokens=8, temperature=0.0))
    assert want.text and printed_hf == want.text + "\n", "generate must print what the offline API generates"
    out_dir = str(tmp_path / "converted")
    assert main(["convert", tiny_dir, out_dir, "--dtype", "float32", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", out_dir, "--prompt", "Once upon a time", "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out == printed_hf, "the converted checkpoint must generate the same text"
    a = jhybrid.generate(tiny_dir, [[5, 6, 7]], max_tokens=8, ignore_eos=True)[0].token_ids
    b = jhybrid.generate(out_dir, [[5, 6, 7]], max_tokens=8, ignore_eos=True)[0].token_ids
    assert a == b


def test_cli_generate_errors(tiny_dir, capsys):
    assert main(["generate", "--model", str(tiny_dir) + "-missing", "--prompt", "hi"]) == 2
    assert "error:" in capsys.readouterr().err
    assert main(["generate", "--model", tiny_dir, "--prompt-ids", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


@pytest.mark.slow
def test_bf16_logits_err_like_hf_bf16(tiny_dir):
    """bf16 weights and KV: jhybrid's bf16-vs-fp32 logit error is of the size HF's own bf16 run shows."""
    from transformers import AutoModelForCausalLM

    from jhybrid.checkpoint import load_model
    from tests.runner_helpers import SequenceRunner

    ids = list(range(3, 40))
    ours, theirs = {}, {}
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        cfg, params = load_model(tiny_dir, dtype=dtype)
        runner = SequenceRunner(cfg, params, max_len=64)
        table, slot = runner.start()
        ours[dtype] = np.asarray(runner.step(ids, 0, table, slot, all_logits=True), np.float64)
        hf_model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch_dtype).eval()
        with torch.no_grad():
            theirs[dtype] = hf_model(torch.tensor([ids])).logits[0].double().numpy()

    def rel(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    ours_err, hf_err = rel(ours["bfloat16"], ours["float32"]), rel(theirs["bfloat16"], theirs["float32"])
    assert rel(ours["float32"], theirs["float32"]) < 1e-5
    assert np.isfinite(ours["bfloat16"]).all()
    assert ours_err <= 2.0 * hf_err + 1e-3, f"bf16 error {ours_err:.3e} vs HF's own bf16 error {hf_err:.3e}"


def test_readme_starts_with_two_commands_and_ci_runs_the_test_one():
    readme = open(os.path.join(ROOT, "README.md")).read()
    first_block = re.search(r"```(?:bash|sh)?\n(.*?)```", readme, re.S).group(1)
    commands = [line for line in first_block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(commands) == 2, f"the README's first block must hold exactly two commands, got {commands}"
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert commands[1].strip() in ci, ".ci/run must run the README's test command verbatim"
    assert "examples/quickstart.py" in commands[0], "the first command runs the quickstart on the bundled model"
    assert os.path.isfile(os.path.join(ROOT, "examples", "quickstart.py"))
