"""FP8 routed experts (issue 22): with `quantization="fp8"` the MoE experts are held block-wise in FP8 (128 x 128
blocks per expert, jhybrid/models/quant.py) and dequantized inside the step one layer at a time; an FP8 MoE checkpoint
is packed and quantized layer by layer as it is read.

Models: the tiny MoE family configs of tests/tp_worker.py with a hidden size of 128 (fp32), so that the expert
tensors whose input dim is a multiple of 128 are quantized: qwen3_next's SwiGLU experts (`gate_up_proj`, `down_proj`,
both FP8) and nemotron_h's relu^2 experts (`up_proj` FP8 with its 16 outputs padded to a block, `down_proj` with 16
inputs left in float32). The references are the same parameters with the experts' FP8 values dequantized (everything
else as it is: the dense projections' FP8 matmuls are tests/test_fp8_compute.py's subject), and the model with every
FP8 weight dequantized, at a prefill long enough that the dense projections dequantize too (W8A16).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jhybrid.model_loader import LoadedModel, load, quantize
from jhybrid.models import quant
from jhybrid.models.params import init_params
from jhybrid.models.quant import Fp8Weight, num_fp8_weights, unquantized
from pallas_kernels.fp8_matmul import BLOCK, DEQUANT_MIN_ROWS
from tests.hf_models import HYBRID_LAYERS, make_qwen3_next
from tests.runner_helpers import SequenceRunner
from tests.test_fp8_checkpoint import write_fp8_copy
from tests.test_fp8_compute import SIZES
from tests.tp_worker import family_config

FP8 = jnp.dtype(jnp.float8_e4m3fn)


def fp8_family(name: str, **overrides) -> LoadedModel:
    """`family_config(name)` with hidden size 128, random fp32 weights, quantized (`quantization="fp8"`)."""
    cfg = dataclasses.replace(family_config(name), hidden_size=128, **overrides)
    return quantize(LoadedModel(cfg=cfg, params=init_params(cfg, seed=3, scale=0.1)), "fp8")


def values(w: Fp8Weight) -> np.ndarray:
    """`w`'s values `[..., K, N]` in float32: its e4m3 values times their blocks' scales (numpy)."""
    scale = np.repeat(np.repeat(np.asarray(w.scale), BLOCK, -2), BLOCK, -1)  # [..., Npad, K]
    return np.swapaxes((np.asarray(w.w).astype(np.float32) * scale)[..., : w.n, :], -1, -2)


def dequantized(params: dict, experts_only: bool) -> dict:
    """`params` with the FP8 experts (and, unless `experts_only`, every FP8 weight) as their float32 values."""

    def leaf(w):
        if isinstance(w, Fp8Weight) and (w.w.ndim == 3 or not experts_only):
            return jnp.asarray(values(w))
        return w

    return jax.tree.map(leaf, params, is_leaf=lambda w: isinstance(w, Fp8Weight))


def experts(params: dict) -> list[tuple[str, object]]:
    """`(flat name, leaf)` of every routed-expert tensor."""
    mlps = enumerate(layer.get("mlp", {}) for layer in params["layers"])
    return [(f"layers.{i}.mlp.{name}", mlp[name]) for i, mlp in mlps if "router" in mlp
            for name in ("gate_up_proj", "up_proj", "down_proj") if name in mlp]


def logits(cfg, params, steps: list[list[int]]) -> np.ndarray:
    """Every token's logits of `steps` fed one after another to one sequence (a chunk, then single tokens)."""
    runner = SequenceRunner(cfg, params, max_len=128)
    table, slot = runner.start()
    out, pos = [], 0
    for ids in steps:
        out.append(np.asarray(runner.step(ids, pos, table, slot, all_logits=True), np.float64))
        pos += len(ids)
    return np.concatenate(out)


def greedy(cfg, params, prompt: list[int], n: int) -> list[int]:
    runner = SequenceRunner(cfg, params, max_len=128)  # as in `logits`: the same compiled programs
    table, slot = runner.start()
    tokens = [int(np.argmax(runner.step(prompt, 0, table, slot)))]
    for j in range(n - 1):
        tokens.append(int(np.argmax(runner.step(tokens[-1:], len(prompt) + j, table, slot))))
    return tokens


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# both slow (15-22 s each on 2 cores): the fast tier keeps FP8 experts through the model in
# test_fp8_moe_checkpoint_keeps_its_expert_values
@pytest.mark.slow
@pytest.mark.parametrize("family, intermediate", [("qwen3_next", 128), ("nemotron_h", 16)])
def test_fp8_experts_match_their_dequantized_values(family, intermediate):
    """The expert tensors whose input dim is a multiple of 128 are `Fp8Weight`s (e4m3 values `[E, Npad, K]`, float32
    scales per expert and block), the others stay float32 and are reported; the logits of a prefill and decode
    steps equal the model with the experts' dequantized values (1e-5), greedy tokens are equal, and a prefill of
    DEQUANT_MIN_ROWS+ tokens matches the model with every FP8 weight dequantized (2e-5, tests/test_fp8_compute.py's
    bound). Checked to fail with the scale multiply dropped from `quant.dequantize` (logits off by ~1) and with the
    experts left out of `quant.candidates` (no FP8 experts)."""
    model = fp8_family(family, moe_intermediate_size=intermediate)
    cfg, params = model.cfg, model.params
    found = experts(params)
    assert found and num_fp8_weights(params, experts=True) == sum(w.shape[-2] % BLOCK == 0 for _, w in found)
    left = unquantized(params)
    for name, w in found:
        e, k, n = w.shape
        if k % BLOCK:
            assert isinstance(w, jax.Array) and w.dtype == jnp.float32 and "not a multiple of 128" in left[name], name
            continue
        assert isinstance(w, Fp8Weight) and w.n == n and name not in left, name
        assert w.w.dtype == FP8 and w.w.shape == (e, -(-n // BLOCK) * BLOCK, k), (name, w.w.shape)
        assert w.scale.dtype == jnp.float32 and w.scale.shape == (e, -(-n // BLOCK), k // BLOCK), (name, w.scale.shape)

    rng = np.random.default_rng(1)
    steps = [rng.integers(0, cfg.vocab_size, 20).tolist()] + [[int(t)] for t in rng.integers(0, cfg.vocab_size, 3)]
    want_params = dequantized(params, experts_only=True)
    got, want = logits(cfg, params, steps), logits(cfg, want_params, steps)
    assert rel(got, want) <= 1e-5, f"{family}: FP8 experts vs their dequantized values: {rel(got, want):.2e}"
    assert greedy(cfg, params, steps[0], 8) == greedy(cfg, want_params, steps[0], 8)

    long = [rng.integers(0, cfg.vocab_size, DEQUANT_MIN_ROWS + 15).tolist()]
    got, want = logits(cfg, params, long), logits(cfg, dequantized(params, experts_only=False), long)
    assert rel(got, want) <= 2e-5, f"{family}: W8A16 prefill vs every FP8 weight dequantized: {rel(got, want):.2e}"


def test_one_layer_of_experts_dequantized_at_a_time():
    """A step over six MoE layers with FP8 experts needs less temporary memory than half the experts' dequantized
    size (about two layers' worth here): each layer's experts are dequantized when the layer runs, not all up front.
    Checked to fail without the optimization barrier in `quant.expert_weights` (XLA on the CPU then dequantizes every
    layer's experts at the start: 23 MB of temporaries for 19 MB of experts, against 6 MB with it)."""
    from jhybrid.cache.state import CacheConfig, init_state
    from jhybrid.models.batch import RowSpec, make_batch
    from jhybrid.models.hybrid import forward

    n = 6
    model = fp8_family("qwen3_next", moe_intermediate_size=256, num_experts=8, num_layers=n,
                       layer_kinds=("linear_attention",) * (n - 1) + ("full_attention",), mlp_kinds=("moe",) * n)
    params = model.params
    state = init_state(model.cfg, CacheConfig(num_blocks=5, block_size=16, num_slots=2, kv_dtype="float32"))
    batch = jax.tree.map(jnp.asarray, make_batch([RowSpec(list(range(10)), 0, [1, 2, 3, 4], 1)], block_size=16,
                                                 max_blocks_per_seq=4, num_tokens=16, num_rows=1))
    step = jax.jit(functools.partial(forward, model.cfg, kernel_impl="reference"))
    temp = step.lower(params, state, batch).compile().memory_analysis().temp_size_in_bytes
    dequantized_bytes = sum(4 * int(np.prod(w.shape)) for _, w in experts(params) if isinstance(w, Fp8Weight))
    assert num_fp8_weights(params, experts=True) == 2 * n
    assert temp < dequantized_bytes / 2, f"step temporaries {temp:,} bytes; experts dequantized {dequantized_bytes:,}"


# ------------------------------------------------------------------------------------------- an FP8 MoE checkpoint
@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    """(root with `fp8/` and `deq/` checkpoints of an 8-layer Qwen3-Next MoE with 128-multiple widths, 128 x 128
    blocks; {name: (e4m3 weight, weight_scale_inv)})."""
    root = tmp_path_factory.mktemp("fp8moe")
    make_qwen3_next(root / "orig", moe=True, seed=13, **SIZES, moe_intermediate_size=128,
                    shared_expert_intermediate_size=128, num_hidden_layers=8, layer_types=HYBRID_LAYERS * 2)
    return root, write_fp8_copy(root / "orig", root / "fp8", root / "deq", (BLOCK, BLOCK))


def test_fp8_moe_checkpoint_keeps_its_expert_values(moe_ckpt):
    """An FP8 MoE checkpoint loaded with quantization="fp8": every expert is an `Fp8Weight` whose e4m3 bytes are the
    checkpoint's (per expert: the packed gate_up as its gate rows, then its up rows) and whose scales are its
    weight_scale_inv; a W8A16 prefill matches the checkpoint stored dequantized (2e-5). Checked to fail with the
    experts left out of `quant.candidates` (they then load as float32) and with the scale multiply dropped from
    `quant.dequantize`."""
    root, stored = moe_ckpt
    model = load(root / "fp8", "float32", quantization="fp8")
    cfg, params = model.cfg, model.params
    assert num_fp8_weights(params, experts=True) == 2 * cfg.num_layers and not unquantized(params)

    def check(w: Fp8Weight, e: int, *names):
        want_q = np.concatenate([stored[n][0].view(torch.uint8).numpy() for n in names])
        want_s = np.concatenate([stored[n][1].numpy() for n in names])
        assert np.array_equal(np.asarray(w.w[e]).view(np.uint8), want_q), names
        np.testing.assert_allclose(np.asarray(w.scale[e]), want_s, rtol=1e-6)

    for i, layer in enumerate(params["layers"]):
        for e in range(cfg.num_experts):
            pre = f"model.layers.{i}.mlp.experts.{e}."
            check(layer["mlp"]["gate_up_proj"], e, pre + "gate_proj.weight", pre + "up_proj.weight")
            check(layer["mlp"]["down_proj"], e, pre + "down_proj.weight")

    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, DEQUANT_MIN_ROWS + 15).tolist()
    want_model = load(root / "deq", "float32", quantization="none")
    got, want = logits(cfg, params, [ids]), logits(cfg, want_model.params, [ids])
    assert rel(got, want) <= 2e-5, f"FP8 MoE checkpoint vs dequantized: {rel(got, want):.2e}"


def test_fp8_checkpoint_is_quantized_layer_by_layer(moe_ckpt, monkeypatch):
    """`load(..., quantization="fp8")` packs and quantizes each layer as soon as its tensors are read: whenever a layer
    is quantized, the arrays the load made hold less than the FP8 model plus 2.5 of its layers in the load dtype
    (the layer as read and its packed copy), well under the model in the load dtype, and every layer is quantized
    during the read. Checked to fail with `load` passing no `layer_fn` (the model read whole, then quantized: each
    call sees the whole float32 model) and with `unflatten_shapes` a recursive closure (a reference cycle keeps each
    layer as read alive until the garbage collector runs)."""
    root, _ = moe_ckpt
    live = lambda: sum(a.nbytes for a in jax.live_arrays())  # noqa: E731
    seen, real = [], quant.quantize_layer

    def spy(layer, *args):
        seen.append(live() - base)
        return real(layer, *args)

    monkeypatch.setattr(quant, "quantize_layer", spy)
    base = live()
    model = load(root / "fp8", "float32", quantization="fp8")
    as_read = lambda tree: sum(4 * int(np.prod(w.shape)) for w in  # noqa: E731
                               jax.tree.leaves(tree, is_leaf=lambda w: isinstance(w, Fp8Weight)))
    layer = max(as_read(layer) for layer in model.params["layers"])
    bound = sum(a.nbytes for a in jax.tree.leaves(model.params)) + 2.5 * layer
    assert len(seen) == model.cfg.num_layers
    assert bound < 0.7 * as_read(model.params)
    assert max(seen) < bound, f"live bytes while quantizing {seen}; bound {bound:,.0f}; one layer {layer:,}"
