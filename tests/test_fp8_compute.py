"""FP8 weights at run time (issue 22): an FP8 checkpoint and `quantization="fp8"` run the dense projections as
block-wise FP8 matmuls (jhybrid/models/quant.py); checked against HF transformers running the same FP8
numerics.

The model is a tiny dense Qwen3-Next (fp32) with every projection's dims multiples of 128, so all of them are
quantized and the packed projections' 128 x 128 blocks are the checkpoint's own (one key head: the packed
q, k, v, z of the Gated DeltaNet are whole blocks; kv heads x head dim = 128). Its FP8 checkpoint is made as
transformers' `Fp8Quantize` makes one (tests/test_fp8_checkpoint.py), with 128 x 128 blocks.

The reference for W8A8 steps (up to `DEQUANT_MIN_ROWS` tokens: decode) is HF's model of the dequantized weights
with every quantized `nn.Linear`'s input rounded to e4m3 per token and 128-group first (forward pre-hooks), as
transformers' `FP8Linear` quantizes activations; for larger steps (prefill chunks: W8A16), the same model
without the hooks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jhybrid.engine.engine_config import EngineConfig
from jhybrid.model_loader import load
from jhybrid.models.quant import Fp8Weight, num_fp8_weights
from pallas_kernels.fp8_matmul import DEQUANT_MIN_ROWS
from tests.hf_models import make_qwen3_next
from tests.runner_helpers import SequenceRunner
from tests.test_fp8_checkpoint import write_fp8_copy

BLOCK = (128, 128)
SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128)
HOOKED = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj", "gate_proj", "up_proj",
          "down_proj")


@pytest.fixture(scope="module")
def fp8_ckpt(tmp_path_factory):
    """(FP8 checkpoint dir, HF model of its dequantized weights, {name: (e4m3 tensor, scale_inv)})."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("fp8c")
    make_qwen3_next(root / "orig", moe=False, seed=11, **SIZES)
    stored = write_fp8_copy(root / "orig", root / "fp8", root / "deq", BLOCK)
    hf = AutoModelForCausalLM.from_pretrained(str(root / "deq"), dtype=torch.float32).eval()
    return root / "fp8", hf, stored


def _act_quant(module, args):
    """transformers' FP8 activation quantization, in float32: per token and 128-group, scale amax / 448."""
    x = args[0]
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // 128, 128)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    q = (groups / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
    return (q.reshape(x.shape),)


def _hf_logits(model, ids, quantized_activations: bool):
    hooks = []
    if quantized_activations:
        hooks = [m.register_forward_pre_hook(_act_quant) for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in HOOKED]
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.logits[0].double().numpy()


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fp8_checkpoint_keeps_its_fp8_values(fp8_ckpt):
    """With quantization="fp8" every dense projection is an `Fp8Weight` whose bytes are the checkpoint's e4m3
    bytes and whose scales are its weight_scale_inv (the packed MLP gate/up as the concatenation of both): the
    dequantize-pack-requantize path at load loses nothing on block-aligned layouts. Checked to fail with
    `quantize_weight`'s scales set to amax / 240 instead of amax / 448. "auto" on CPU keeps the dequantized model."""
    fp8_dir, _, stored = fp8_ckpt
    model = load(fp8_dir, "float32", quantization="fp8")
    assert model.fp8_checkpoint
    assert num_fp8_weights(model.params) == 4 * 4  # per layer: the mixer's in and out, the MLP's gate_up and down
    layers = model.params["layers"]

    def check(w: Fp8Weight, *names):
        want_q = np.concatenate([stored[n][0].view(torch.uint8).numpy() for n in names])
        want_s = np.concatenate([stored[n][1].numpy() for n in names])
        assert np.array_equal(np.asarray(w.w).view(np.uint8)[: want_q.shape[0]], want_q), names
        np.testing.assert_allclose(np.asarray(w.scale)[: want_s.shape[0]], want_s, rtol=1e-6)

    for i, layer in enumerate(layers):
        pre = f"model.layers.{i}."
        if "attn" in layer:
            check(layer["attn"]["o_proj"], pre + "self_attn.o_proj.weight")
        else:
            check(layer["gdn"]["out_proj"], pre + "linear_attn.out_proj.weight")
        check(layer["mlp"]["down_proj"], pre + "mlp.down_proj.weight")
        check(layer["mlp"]["gate_up_proj"], pre + "mlp.gate_proj.weight", pre + "mlp.up_proj.weight")
    assert num_fp8_weights(load(fp8_dir, "float32").params) == 0  # auto, CPU: dequantized


def test_fp8_logits_match_hf_with_fp8_numerics(fp8_ckpt):
    """Logits of the FP8 model against HF's of the same FP8 weights: a 40-token prompt and three decode
    tokens (W8A8 steps: every step has fewer than DEQUANT_MIN_ROWS tokens) against HF with activations
    quantized per token (relative error <= 1e-4: a product near a rounding boundary may round the other way
    in either); a 100-token prefill (one W8A16 step) against HF without (2e-5). The activation rounding moves
    the logits ~1e-2 (asserted), so each comparison fails with the other scheme."""
    fp8_dir, hf, _ = fp8_ckpt
    model = load(fp8_dir, "float32", quantization="fp8")
    rng = np.random.default_rng(5)
    ids = rng.integers(0, model.cfg.vocab_size, size=43).tolist()
    runner = SequenceRunner(model.cfg, model.params, max_len=256)
    table, slot = runner.start()
    got = [np.asarray(runner.step(ids[:40], 0, table, slot, all_logits=True), np.float64)]
    got += [np.asarray(runner.step([t], 40 + j, table, slot, all_logits=True), np.float64) for j, t in enumerate(ids[40:])]
    got = np.concatenate(got)
    want, plain = _hf_logits(hf, ids, True), _hf_logits(hf, ids, False)
    assert _rel(plain, want) > 1e-3, "activation rounding should move the logits"
    print(f"W8A8 steps vs HF with FP8 activations {_rel(got, want):.1e}, without {_rel(got, plain):.1e}")
    assert _rel(got, want) <= 1e-4, f"W8A8 steps vs HF with FP8 activations: {_rel(got, want):.2e}"
    runner.finish(table, slot)

    long_ids = rng.integers(0, model.cfg.vocab_size, size=100).tolist()
    assert len(long_ids) >= DEQUANT_MIN_ROWS
    table, slot = runner.start()
    got = np.asarray(runner.step(long_ids, 0, table, slot, all_logits=True), np.float64)
    want = _hf_logits(hf, long_ids, False)
    print(f"W8A16 prefill vs HF without FP8 activations {_rel(got, want):.1e}")
    assert _rel(got, want) <= 2e-5, f"W8A16 prefill vs HF dequantized: {_rel(got, want):.2e}"
    assert _rel(_hf_logits(hf, long_ids, True), want) > 1e-3


@pytest.mark.slow
def test_quantization_option(fp8_ckpt, tmp_path):
    """`quantization="fp8"` quantizes a float checkpoint at load and `LLM.generate` runs it; a bad value is refused
    naming the option, fp8 with tensor parallelism is accepted (tests/test_tensor_parallel.py runs it); the CLI has
    the flag."""
    import jhybrid
    from jhybrid.cli import _parser

    make_qwen3_next(tmp_path / "bf", moe=False, seed=2, **SIZES)
    llm = jhybrid.LLM(str(tmp_path / "bf"), dtype="float32", quantization="fp8", max_num_seqs=2, max_model_len=64)
    assert num_fp8_weights(llm.model.params) == 16
    out = llm.generate([[1, 2, 3]], jhybrid.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")
    assert EngineConfig(quantization="fp8", tensor_parallel_size=2).tensor_parallel_size == 2
    assert _parser().parse_args(["serve", "DIR", "--quantization", "fp8"]).quantization == "fp8"
