"""Tensor parallelism (jhybrid.parallel) on forced host devices.

The forced device count must be set before JAX starts, so the multi-device checks run in subprocesses
(`tests/tp_worker.py`, one for every family and TP size, one pair for the two-process run); this test
process keeps its single CPU device. In-process tests cover the layout helpers, the validation and a
CUDA lowering of the per-shard Pallas kernels under an abstract two-H200 mesh.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, PartitionSpec

from jhybrid.models.params import init_params, pack_params
from jhybrid.parallel import (
    deinterleave,
    interleave,
    make_mesh,
    param_specs,
    split_packed,
    state_specs,
    validate_tensor_parallel,
)
from tests.tp_worker import FAMILIES, family_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Each family's tokens run at TP 4 over a model with two of every head, group and expert kind per shard
# (`family_config(widen=2)`): the 4-way split and more than one head of a kind in a shard, which TP 2 of the
# unwidened models was there for; TP 2 itself runs in the checkpoint and layout checks. Checked: with the kv heads
# of each shard stored in reverse order (a layout bug invisible with one kv head per shard), qwen3 and llama
# tokens at TP 4 equal TP 1 unwidened and differ at TP 2 and at TP 4 widened.
TP_SIZES = (4,)


def _env(num_devices: int) -> dict:
    # fast, unoptimised CPU compiles: the checks compare runs of one process, not speed
    flags = f"--xla_force_host_platform_device_count={num_devices} --xla_backend_optimization_level=0 " \
            "--xla_llvm_disable_expensive_passes=true"
    return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, XLA_FLAGS=flags)


def _parse(stdout: str, stderr: str) -> dict:
    lines = [line for line in stdout.strip().splitlines() if line.startswith("{")]
    assert lines, f"worker printed no result; stderr tail:\n{stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def worker():
    """Two concurrent subprocesses with 4 host devices each (CI has two cores) run every family at TP 1 and 4
    and the other checks, split so that each takes about half the time; their results are merged."""
    second = ("nemotron_h", "bamba", "granitemoehybrid")  # with the checkpoint and FP8 checks: about half the time
    first = [f for f in FAMILIES if f not in second]
    jobs = [["--checks", "tokens,swap,unpermuted,pallas,replicated", "--families", ",".join(first)],
            ["--checks", "tokens,bad_n,checkpoints,fp8", "--families", ",".join(second)]]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.tp_worker", "--tp", "1,4", *job], cwd=ROOT,
                              env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for job in jobs]
    result: dict = {"tokens": {}, "fractions": {}, "timings": {}}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, stderr[-3000:]
        part = _parse(stdout, stderr)
        assert part["devices"] == 4
        for key in ("tokens", "fractions", "timings"):
            result[key].update(part.pop(key))
        result.update(part)
    assert set(result["tokens"]) == set(FAMILIES)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_single_device(worker, family):
    tokens = worker["tokens"][family]
    for tp in TP_SIZES:
        assert tokens[str(tp)] == tokens["1"], f"{family}: TP={tp} tokens {tokens[str(tp)]} != TP=1 {tokens['1']}"
    assert all(len(t) == 5 for t in tokens["1"])


@pytest.mark.slow
def test_parameters_and_state_are_sharded(worker):
    for family in FAMILIES:
        for tp in TP_SIZES:
            fractions = worker["fractions"][f"{family}/{tp}"]
            assert any(k.endswith(("qkv_proj", "in_proj")) for k in fractions), fractions
            for name, share in fractions.items():
                if name == "state.conv" and family == "minimax":
                    continue  # lightning attention's conv state is a [S, 1, 1] placeholder, replicated
                assert share == pytest.approx(1 / tp), f"{family} TP={tp}: {name} holds {share} per device"


@pytest.mark.slow
def test_bad_tensor_parallel_size_names_the_counts(worker):
    msg = worker["bad_n"]
    assert msg is not None, "tensor_parallel_size=3 was accepted"
    assert "tensor_parallel_size=3" in msg and "num_attention_heads=8" in msg and "num_key_value_heads=4" in msg
    assert "linear_num_key_heads=4" in msg


@pytest.mark.slow
def test_layout_without_shard_major_permutation_is_caught(worker):
    """The negative control: the right PartitionSpecs on the unpermuted packed layout give wrong logits
    (XLA keeps the math of whatever layout it is given), so the permutation is what the equality tests
    check."""
    assert worker["unpermuted"]["right"] < 1e-5
    assert worker["unpermuted"]["wrong"] > 1e-2


@pytest.mark.slow
def test_parameters_built_into_their_shards_equal_shard_params(worker):
    """`shard_params_from` (no whole model on one device) places the same values with the same shardings
    as sharding the whole packed pytree, asking for each leaf once."""
    built = worker["from_leaves"]
    assert built["mismatched"] == [], built
    assert built["made"] == built["leaves"] > 10, built


@pytest.mark.slow
def test_checkpoints_load_through_host_memory_under_tensor_parallelism(worker):
    """`LLM(path, tensor_parallel_size=2)` reads HF and converted checkpoints into host memory (JAX's CPU
    device), then shards them: the same greedy tokens as TP 1. (Here every device is a CPU; on GPUs this
    is what keeps the whole model off the first GPU.)"""
    for name in ("hf", "converted"):
        r = worker["checkpoints"][name]
        assert r["equal"], f"{name}: TP 2 tokens {r['tokens']} differ from TP 1"
        assert r["loaded_on"] == ["cpu"], r
        assert all(len(t) == 6 for t in r["tokens"])


@pytest.mark.slow
def test_more_devices_than_kv_heads_copies_each_head(worker):
    """TP 4 over a model with 2 kv heads (as vLLM does: every device holds one copy of one kv head): the
    TP-1 greedy tokens, each device holding a quarter of the (copied) KV pages."""
    r = worker["replicated"]
    assert r["tp"] == 4 and r["equal"], r
    assert r["num_kv_heads"] == 4 and r["kv_page_share"] == pytest.approx(0.25), r


@pytest.mark.parametrize("family", [pytest.param("qwen3_next", marks=pytest.mark.slow), "llama"])
def test_copied_kv_heads_leave_attention_unchanged(family):
    """`replicate_kv_heads` on one device: the same prefill and decode logits (fp32), with and without the
    attention output gate."""
    import dataclasses

    from jhybrid.parallel import kv_replication, replicate_kv_heads
    from tests.tp_worker import forward_logits

    cfg = dataclasses.replace(family_config(family), attention_bias=True)
    params = pack_params(init_params(cfg, seed=3, scale=0.3))
    assert kv_replication(cfg, 2 * cfg.num_kv_heads) == 2 and kv_replication(cfg, cfg.num_kv_heads) == 1
    copied_cfg, copied = replicate_kv_heads(cfg, params, 2)
    assert copied_cfg.num_kv_heads == 2 * cfg.num_kv_heads
    want = forward_logits(cfg, params, 1)
    got = forward_logits(copied_cfg, copied, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_pallas_kernels_per_shard_equal_one_device(worker):
    """The Pallas path (interpret mode) per shard at TP 4: the prefill and decode logits of the reference path on one
    device."""
    pallas = worker["pallas"]
    assert pallas["tp"] == 4
    assert pallas["vs_one_device"] < 1e-5, pallas


@pytest.mark.slow
def test_fp8_under_tensor_parallelism_equals_one_device(worker):
    """`quantization="fp8"` at TP 2 (a model whose projections and experts all split on whole 128-blocks, so both
    sizes hold the same 8 FP8 weights): through `LLM`, the greedy tokens of TP 1 (decoded through `forward`); through
    `forward` on the TP engine's own parameters, the prefill and decode logits of TP 1 within 1e-4 (W8A8 steps: a
    value that lands on an e4m3 rounding boundary may round the other way after a different summation order); each
    device holding half of every FP8 weight's values and scales. Checked to fail with the FP8 blocks of packed
    projections not permuted shard-major (`sharding._fp8_shard_major`) and with the row-parallel per-shard products
    not summed (`quant._per_shard`): logits off by ~1, other tokens."""
    r = worker["fp8"]
    assert r["tp"] == 2 and r["equal"], f"TP 2 FP8 tokens {r['tokens']} differ from TP 1"
    assert r["num_fp8"] == [8, 8], r
    assert r["logits"] < 1e-4, r
    assert r["shares"] == {k: [0.5, 0.5] for k in ("experts", "attn.qkv_proj", "attn.o_proj", "lightning.in_proj")}, r


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_swap_and_recompute_preemption_under_tensor_parallelism(worker):
    """A TP run whose KV pool is too small preempts (by swapping the sharded pages and state slot to the host
    and back, through pageable or pinned host memory, or by recomputing) and still produces the unpressured
    one-device tokens."""
    r = worker["swap"]
    assert r["swap_preemptions"]["num_swap_preemptions"] >= 1 and r["swap_preemptions"]["num_swap_in"] >= 1
    assert r["recompute_preemptions"]["num_recompute_preemptions"] >= 1
    assert r["swap"] == r["want"], f"TP {r} swap run diverged"
    pinned = r["swap-pinned_preemptions"]
    assert pinned["num_swap_preemptions"] >= 1 and pinned["num_swap_in"] >= 1
    assert r["swap-pinned"] == r["want"], "TP swap through pinned host memory diverged"
    assert r["recompute"] == r["want"]


@pytest.mark.slow
def test_prefix_caching_under_tensor_parallelism(worker):
    """Prefix caching at TP 4 (KV blocks shared by content, state snapshots copied between sharded slots): prompts
    sharing a prefix give the greedy tokens of TP 1 without the cache, and the cache served some of them."""
    r = worker["cached"]
    assert r["equal"], f"TP 4 with the cache gave {r['tokens']}"
    assert r["hits"] > 0, r


@pytest.mark.slow
def test_two_processes_over_loopback_equal_single_device(worker):
    """Two processes with two host devices each form one 4-device mesh (gloo collectives over loopback)."""
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.tp_worker", "--families", "qwen3_5", "--tp", "4", "--checks", "tokens",
             "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i)],
            cwd=ROOT, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append((p.returncode, *p.communicate(timeout=600)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = [(p.returncode, out, err) for p, (_, out, err) in zip(procs, outputs)]
    for rc, _, err in outputs:
        assert rc == 0, err[-3000:]
    results = [_parse(out, err) for _, out, err in outputs]
    for r in results:
        assert r["processes"] == 2 and r["devices"] == 4
        assert r["tokens"]["qwen3_5"]["4"] == worker["tokens"]["qwen3_5"]["1"]


# ----------------------------------------------------------------------------- in-process
def test_interleave_round_trip_and_split():
    sizes = (8, 4, 4)
    w = jnp.arange(3 * 16, dtype=jnp.float32).reshape(3, 16)
    for n in (1, 2, 4):
        major = interleave(w, sizes, n)
        np.testing.assert_array_equal(deinterleave(major, sizes, n), w)
        parts = split_packed(major, sizes, n)
        np.testing.assert_array_equal(jnp.concatenate(parts, axis=-1), w)
    # shard 0 of 2 holds the first half of every segment
    major = interleave(w, sizes, 2)
    np.testing.assert_array_equal(major[:, :8], jnp.concatenate([w[:, 0:4], w[:, 8:10], w[:, 12:14]], axis=-1))
    with pytest.raises(ValueError, match="segments"):
        split_packed(w, (6, 5, 5), 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_specs_cover_every_parameter(family):
    cfg = family_config(family)
    params = pack_params(init_params(cfg))
    specs = param_specs(cfg, params, 2)
    flat_p = jax.tree.leaves(params)
    flat_s = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    assert len(flat_p) == len(flat_s)
    sharded = 0
    for x, spec in zip(flat_p, flat_s):
        assert len(spec) <= x.ndim
        for dim, axis in zip(x.shape, spec):
            if axis is not None:
                assert dim % 2 == 0
                sharded += 1
    assert sharded >= 4
    assert len(jax.tree.leaves(state_specs(cfg), is_leaf=lambda x: isinstance(x, PartitionSpec))) == (
        2 * cfg.num_full_layers + 2 * cfg.num_linear_layers
    )


@pytest.mark.parametrize(
    "family,n,names",
    [
        ("qwen3_next", 3, ("num_attention_heads=8", "num_key_value_heads=4", "linear_num_key_heads=4")),
        ("qwen3_next", 8, ("num_key_value_heads=4", "linear_num_key_heads=4")),
        ("nemotron_h", 8, ("mamba_n_groups=4",)),
        ("minimax", 16, ("num_attention_heads=8",)),
        ("llama", 64, ("intermediate_size=32",)),
    ],
)
def test_validation_names_the_counts(family, n, names):
    with pytest.raises(ValueError) as info:
        validate_tensor_parallel(family_config(family), n)
    for name in names:
        assert name in str(info.value)
    assert f"tensor_parallel_size={n}" in str(info.value)


def test_valid_sizes_pass_and_bad_values_fail():
    for family in FAMILIES:
        for n in (1, 2, 4):
            validate_tensor_parallel(family_config(family), n)
    llama = family_config("llama")  # 4 kv heads over 8 devices: copied, not refused
    validate_tensor_parallel(llama, 2 * llama.num_kv_heads)
    with pytest.raises(ValueError, match="positive integer"):
        validate_tensor_parallel(family_config("llama"), 0)
    with pytest.raises(ValueError, match="needs that many devices"):
        make_mesh(len(jax.devices()) + 1)


H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def test_per_shard_pallas_kernels_lower_for_two_h200s():
    """The shard_map-wrapped Pallas paged attention (decode, ragged prefill) and gated delta rule (chunk,
    fused recurrent) lower for CUDA under an abstract 2-GPU mesh (Triton lowering errors raise here), each
    as a manual (per-shard) region over half the heads."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, paged_attention
    from tests.test_kernels_pallas import CHUNK_KERNELS, assert_triton_kernels

    mesh = AbstractMesh((2,), ("tp",), abstract_device=H200)

    def sds(shape, dtype, spec=P()):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    def lower(fn, *shapes, local: str, kernels: list[str]):
        with jax.sharding.use_abstract_mesh(mesh):
            text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        assert_triton_kernels(text, kernels)
        manual = [line for line in text.splitlines() if "manual_computation" in line]
        assert manual and 'manual_axes={"tp"}' in manual[0], "no per-shard region"
        assert local in manual[0], f"per-shard operand {local} not in {manual[0][:400]}"

    t, b, h, kvh, d, p, bs, m, s = 64, 4, 8, 2, 64, 32, 16, 8, 5
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    heads, pages_spec = P(None, "tp", None), P(None, None, "tp", None)
    pages = sds((p, bs, kvh, d), bf, pages_spec)
    lower(lambda q, kp, vp, bt, ts, pos: paged_attention(q, kp, vp, bt, ts, pos, impl="pallas", decode=True, mesh=mesh),
          sds((b, h, d), bf, heads), pages, pages, sds((b, m), i32), sds((b,), i32), sds((b,), i32),
          local="tensor<4x4x64xbf16>", kernels=[r"paged_decode_p[bp]\d+_ns\d+_gp\d+_w\d+_s\d+"])
    lower(lambda q, kp, vp, bt, ts, pos, cu: paged_attention(q, kp, vp, bt, ts, pos, impl="pallas", cu_seqlens=cu,
                                                             mesh=mesh),
          sds((t, h, d), bf, heads), pages, pages, sds((b, m), i32), sds((t,), i32), sds((t,), i32),
          sds((b + 1,), i32), local="tensor<32x16x1x64xbf16>", kernels=[r"paged_prefill_bq\d+_gp\d+_np\d+_w\d+_s\d+(_ns\d+)?"])
    hk, hv, k, v = 4, 8, 64, 64
    state = sds((s, hv, k, v), f32, P(None, "tp", None, None))
    qk, vv, gg = sds((t, hk, k), bf, heads), sds((t, hv, v), bf, heads), sds((t, hv), f32, P(None, "tp"))
    lower(lambda q, kk, v_, g, be, cu, st, sl: chunk_gated_delta_rule(q, kk, v_, g, be, cu, st, sl, impl="pallas",
                                                                       mesh=mesh),
          qk, qk, vv, gg, gg, sds((b + 1,), i32), state, sds((b,), i32), local="tensor<5x4x64x64xf32>",
          kernels=CHUNK_KERNELS["default"])
    qd, vd, gd = sds((b, hk, k), bf, heads), sds((b, hv, v), bf, heads), sds((b, hv), f32, P(None, "tp"))
    lower(lambda q, kk, v_, g, be, st, sl: fused_recurrent_gated_delta_rule(q, kk, v_, g, be, st, sl, impl="pallas",
                                                                             mesh=mesh),
          qd, qd, vd, gd, gd, state, sds((b,), i32), local="tensor<4x2x64xbf16>",
          kernels=[r"gdn_fused_recurrent_bv\d+_w\d+"])


def test_per_shard_fp8_matmul_lowers_for_two_h200s(monkeypatch):
    """`linear` on an FP8 weight split over an abstract 2-H200 mesh (as `shard_params` leaves it) lowers for CUDA as
    a per-shard region calling the Pallas FP8 kernel (as "auto" picks it on an H200) on half the blocks: column-parallel
    on half the output rows, row-parallel on half of K and then an all-reduce. Checked to fail with `linear` calling
    `fp8_matmul` on the whole weight (the Pallas call then refuses the sharded operands)."""
    import pallas_kernels.fp8_matmul as fp8_matmul_module
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jhybrid.models.quant import Fp8Weight, linear
    from tests.test_kernels_pallas import assert_triton_kernels

    monkeypatch.setattr(fp8_matmul_module, "gpu_has_fp8", lambda: True)
    mesh = AbstractMesh((2,), ("tp",), abstract_device=H200)
    m, k, n = 8, 512, 1024

    def sds(shape, dtype, spec=P()):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    for axis, x_spec, local in ((0, P(), "tensor<512x512xf8E4M3FN>"), (1, P(None, "tp"), "tensor<1024x256xf8E4M3FN>")):
        w_spec = P("tp", None) if axis == 0 else P(None, "tp")
        w = Fp8Weight(sds((n, k), jnp.float8_e4m3fn, w_spec), sds((n // 128, k // 128), jnp.float32, w_spec), n,
                      mesh=mesh, split_axis=axis)
        with jax.sharding.use_abstract_mesh(mesh):
            traced = jax.jit(linear).trace(sds((m, k), jnp.bfloat16, x_spec), w)
            text = traced.lower(lowering_platforms=("cuda",)).as_text()
        assert_triton_kernels(text, [r"fp8_matmul_bm\w+"])
        manual = [line for line in text.splitlines() if "manual_computation" in line]
        assert manual and 'manual_axes={"tp"}' in manual[0] and local in manual[0], (axis, manual[:1])
        assert ("all_reduce" in text) == (axis == 1), axis


def test_fp8_weights_split_only_on_whole_blocks():
    """`quantize_params(params, fp8_layout(cfg, N))` makes FP8 only what splits N ways on whole 128-blocks, and says
    why it left the rest: at TP 2 a Qwen3-Next with 128-multiple widths keeps its Gated DeltaNet in_proj (the b and
    a segments, 2 columns each) in the load dtype; at TP 4 its attention qkv too (its segments split into whole
    blocks, but its 2 kv heads are copied, not split) and not the attention o_proj; TP 1 quantizes them all. An FP8
    weight that cannot split is refused naming the problem (`to_shard_major`), as is copying the kv heads of an FP8
    qkv projection; the FP8 specs are the weight's with its axes swapped. Checked to fail with `fp8_splittable`
    answering True for every leaf, and with its kv-copy clause removed."""
    import dataclasses

    from jhybrid.models.quant import Fp8Weight, quantize_params, unquantized
    from jhybrid.parallel import replicate_kv_heads, to_shard_major
    from jhybrid.parallel.sharding import fp8_layout

    cfg = dataclasses.replace(family_config("qwen3_next"), hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=256,
                              linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=128,
                              linear_value_head_dim=128, moe_intermediate_size=128, shared_expert_intermediate_size=256)
    params = pack_params(init_params(cfg, seed=0))
    assert unquantized(quantize_params(params, fp8_layout(cfg, 1))) == {}
    two = quantize_params(params, fp8_layout(cfg, 2))
    assert unquantized(two, 2) == {"layers.0.gdn.in_proj": "its 2-way tensor-parallel split is not on whole 128-blocks"}
    full = two["layers"][1]
    for w in (full["attn"]["qkv_proj"], full["attn"]["o_proj"], full["mlp"]["gate_up_proj"], full["mlp"]["down_proj"],
              full["mlp"]["shared"]["gate_up_proj"], full["mlp"]["shared"]["down_proj"]):
        assert isinstance(w, Fp8Weight), w
    four = unquantized(quantize_params(params, fp8_layout(cfg, 4)), 4)
    assert "layers.1.attn.qkv_proj" in four and "layers.1.attn.o_proj" not in four, four

    one = quantize_params(params, fp8_layout(cfg, 1))
    with pytest.raises(ValueError, match=r"cannot be split over tensor_parallel_size=2: output segments .* 128-blocks"):
        to_shard_major(cfg, one, 2)
    with pytest.raises(ValueError, match="layers.1.attn.qkv_proj is an FP8 weight"):
        replicate_kv_heads(cfg, one, 2)
    specs = param_specs(cfg, two, 2)["layers"][1]
    assert specs["attn"]["qkv_proj"].w == PartitionSpec("tp", None)
    assert specs["attn"]["o_proj"].w == PartitionSpec(None, "tp")
    assert specs["mlp"]["down_proj"].scale == PartitionSpec("tp", None, None)
