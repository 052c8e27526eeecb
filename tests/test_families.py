"""Lightning-attention and Mamba2 hybrid families against HF transformers (fp32, every weight random).

Per family (one module-scoped tiny model each): prefill logits against HF, 32 greedy tokens against HF
`generate`, chunked prefill against one-shot prefill (and each chunk against HF with explicit positions),
continuous batching with mixed prompt lengths against one-at-a-time runs, `jhybrid inspect`'s layer
kinds and state sizes, and the round trip HF `save_pretrained` -> `jhybrid convert` -> `load_model`.

HF quirks the tests step around (DESIGN.md §5):
  * HF `generate` infers an attention mask from `pad_token_id` when none is given, masking every prompt
    token equal to the pad id; the tests pass an all-ones `attention_mask` so HF attends to the whole prompt.
  * `min_new_tokens` makes HF suppress the EOS logit; the tests give HF an EOS id outside the vocabulary
    instead, so both sides take the plain argmax (jhybrid runs with `ignore_eos`).
  * NemotronH: HF clamps dt to [time_step_min, inf) in its chunked prefill but not in its one-token
    decode; the model's dt_bias keeps dt far above the clamp (tests/hf_models.py `make_nemotron_h`), and
    `test_nemotron_h_dt_clamp_is_inactive` checks that it stays so, so HF's prefill and decode agree.
  * Mamba2 dt clamp (NemotronH, Bamba, Granite): HF clamps dt to `time_step_limit` in its chunked path
    (prefill, and every forward without a cache) but not in its one-token cached update; jhybrid clamps in
    every step. The Bamba and main Granite models keep HF's default limit (0, inf), where the clamp is the
    identity, so HF's prefill and decode agree; `test_granitemoehybrid_dense_nope_active_dt_clamp` makes the
    clamp bite and compares against HF's cache-free forward only (HF's chunked path, clamped at every token).
  * MiniMax: `MiniMaxCache.get_seq_length()` reads layer 0, which holds no KV when layer 0 is lightning
    attention, so a cached HF forward without explicit `position_ids` restarts RoPE at 0. The main MiniMax
    model puts full attention first; the lightning-first layout is compared through `generate()` only
    (which passes positions itself).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import jhybrid
from converters.safetensors_io import SafetensorsCheckpoint
from jhybrid import LLM, SamplingParams
from jhybrid.cache import CacheConfig, init_state
from jhybrid.checkpoint import load_model
from jhybrid.checkpoint_summary import summarize
from jhybrid.cli import main as cli_main
from jhybrid.model_loader import LoadedModel
from jhybrid.models.params import flatten_params
from tests.conftest import FAMILY_ENGINE
from tests.hf_models import make_bamba, make_granitemoehybrid, make_minimax, make_nemotron_h
from tests.runner_helpers import SequenceRunner

# name -> (builder, prefill tolerance: relative error of the logits against HF)
FAMILIES = {
    "minimax": (lambda p: make_minimax(p, seed=1), 1e-5),
    "nemotron_h": (lambda p: make_nemotron_h(p, seed=1), 1e-4),
    "bamba": (lambda p: make_bamba(p, seed=2), 1e-4),
    "granitemoehybrid": (lambda p: make_granitemoehybrid(p, seed=3), 1e-4),
}
GREEDY = dict(temperature=0.0, ignore_eos=True)


# fast tier: NemotronH (Mamba2, MoE, relu^2 MLP, attention without RoPE); the others are `slow`
@pytest.fixture(scope="module", params=[name if name == "nemotron_h" else pytest.param(name, marks=pytest.mark.slow)
                                        for name in FAMILIES])
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build, tol = FAMILIES[request.param]
    hf_model = build(path)
    cfg, params = load_model(path)
    return request.param, path, hf_model, LoadedModel(cfg=cfg, params=params), tol


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def prompt(seed, n, vocab=128):
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def hf_logits(hf_model, ids):
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), position_ids=torch.arange(len(ids))[None], use_cache=False)
    return out.logits[0].float().numpy()


def hf_generate(hf_model, ids, n):
    """HF greedy continuation of exactly n tokens. The explicit all-ones mask avoids HF masking prompt
    tokens equal to pad; no EOS (rather than `min_new_tokens`, which suppresses the EOS logit and so changes
    the greedy choice when EOS is the argmax: jhybrid's `ignore_eos` keeps it)."""
    never = hf_model.config.vocab_size  # an id outside the vocabulary: HF never stops, suppresses nothing
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=n,
            do_sample=False, pad_token_id=0, eos_token_id=never,
        )
    return out[0, len(ids):].tolist()


def test_prefill_logits_match_hf(family):
    name, _, hf_model, model, tol = family
    ids = prompt(0, 61)
    runner = SequenceRunner(model.cfg, model.params, max_len=128)
    table, slot = runner.start()
    err = rel_err(runner.step(ids, 0, table, slot, all_logits=True), hf_logits(hf_model, ids))
    print(f"{name}: prefill logits relative error vs HF {err:.2e}")
    assert err <= tol, f"{name}: prefill logits relative error {err:.2e} > {tol}"


def test_greedy_32_tokens_equal_hf_generate(family):
    name, _, hf_model, model, _ = family
    prompts = [prompt(1, 7), prompt(2, 53)]
    outs = LLM(model, **FAMILY_ENGINE).generate(prompts, SamplingParams(max_tokens=32, **GREEDY))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_generate(hf_model, ids, 32), f"{name}: greedy tokens differ from HF ({len(ids)}-token prompt)"


def test_chunked_prefill_equals_one_shot_and_hf(family):
    name, _, hf_model, model, tol = family
    runner = SequenceRunner(model.cfg, model.params, max_len=96)
    ids = prompt(3, 50)
    want = hf_logits(hf_model, ids)  # HF over the whole prompt: row t depends only on tokens <= t

    def run(pieces):
        table, slot = runner.start()
        logits, start = [], 0
        for n in pieces:
            logits.append(np.asarray(runner.step(ids[start : start + n], start, table, slot, all_logits=True)))
            start += n
        tokens, last = [], logits[-1][-1]
        for _ in range(8):
            tokens.append(int(np.argmax(last)))
            last = np.asarray(runner.step([tokens[-1]], start, table, slot))
            start += 1
        runner.finish(table, slot)
        return np.concatenate(logits), tokens

    one_logits, one_tokens = run([len(ids)])
    # three chunks; 1-token first and last chunks (conv history shorter than the kernel)
    for chunks in [(17, 16, 17), (1, 48, 1)]:
        chunk_logits, chunk_tokens = run(list(chunks))
        err = rel_err(chunk_logits, one_logits)
        assert err <= tol, f"{name} {chunks}: chunked prefill differs from one-shot, relative error {err:.2e}"
        assert chunk_tokens == one_tokens, f"{name} {chunks}: decode after chunked prefill differs from one-shot"
        err = rel_err(chunk_logits, want)
        assert err <= tol, f"{name} {chunks}: chunked prefill differs from HF, relative error {err:.2e}"


def test_continuous_batching_equals_one_at_a_time(family):
    """Mixed prompt lengths, 3 running sequences, a 32-token budget and 10 KV blocks (`FAMILY_ENGINE`:
    prefills are chunked and interleaved with decodes, slots are reused, long sequences preempt each other):
    each sequence's tokens equal its run alone (same engine, one request at a time)."""
    name, _, _, model, _ = family
    prompts = [prompt(20 + i, n) for i, n in enumerate([3, 41, 17, 66, 1])]
    params = SamplingParams(max_tokens=12, **GREEDY)
    llm = LLM(model, **FAMILY_ENGINE)
    batched = llm.generate(prompts, params)
    for i, (p, out) in enumerate(zip(prompts, batched)):
        (alone,) = llm.generate([p], params)
        assert out.token_ids == alone.token_ids, f"{name}: prompt {i} ({len(p)} tokens): batched != alone"
    eng = llm.engine
    assert eng.slots.num_used == 0 and eng.blocks.num_used == 0, f"{name}: slots or blocks leaked"


def test_inspect_reports_layer_kinds_and_state_sizes(family):
    name, path, _, model, _ = family
    cfg = model.cfg
    summary = summarize(path)
    assert [layer.kind for layer in summary.layers] == list(cfg.layer_kinds)
    assert summary.state_bytes_per_sequence == sum(layer.state_bytes for layer in summary.layers)
    assert summary.state_bytes_per_sequence == cfg.state_bytes_per_sequence()
    state = init_state(cfg, CacheConfig(num_blocks=2, block_size=16, num_slots=2))
    per_slot = sum(x.nbytes for x in (*state.conv, *state.ssm)) // 2
    assert per_slot == cfg.state_bytes_per_sequence(), f"{name}: planner state size disagrees with the state pytree"
    # no zero-size state array: XLA makes one a constant that every donating step program copies into its output
    # (`ModelConfig.linear_state_shapes`; checked to fail with lightning's conv state back at [0, 0])
    assert all(x.size for x in (*state.conv, *state.ssm)), f"{name}: a zero-size state array"
    text = summary.format()
    for kind in set(cfg.layer_kinds):
        assert kind in text
    assert f"{cfg.state_bytes_per_sequence():,} bytes per sequence" in text


def test_convert_round_trip_logits_equal_hf(family, tmp_path, capsys):
    """HF `save_pretrained` -> `jhybrid convert` (fp32) -> `load_model` of the converted directory: the same
    config and bit-identical parameters as loading the HF directory, and prefill logits equal to HF's."""
    name, path, hf_model, model, tol = family
    out = tmp_path / "jh"
    assert cli_main(["convert", str(path), str(out), "--dtype", "float32", "--no-progress"]) == 0
    capsys.readouterr()
    cfg, params = load_model(out)
    assert cfg == model.cfg, f"{name}: converted config differs"
    got, want = flatten_params(params), flatten_params(load_model(path)[1])
    assert got.keys() == want.keys()
    for k in got:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=f"{name}: {k}")
    ids = prompt(4, 61)
    runner = SequenceRunner(cfg, params, max_len=128)  # the prefill test's shapes: its compiled step is reused
    table, slot = runner.start()
    err = rel_err(runner.step(ids, 0, table, slot, all_logits=True), hf_logits(hf_model, ids))
    print(f"{name}: converted checkpoint prefill logits relative error vs HF {err:.2e}")
    assert err <= tol, f"{name}: converted checkpoint logits relative error {err:.2e} > {tol}"
    assert [layer.kind for layer in summarize(out).layers] == list(cfg.layer_kinds)


# ------------------------------------------------------------------------------- family specifics


@pytest.mark.slow
def test_minimax_lightning_first_layout_equals_hf_generate(tmp_path):
    """Layer 0 lightning (HF's default MiniMax layout starts with full attention; the slope of layer 0 is
    the fastest decay). HF's cache reports length 0 here (module docstring), so compare through generate."""
    hf_model = make_minimax(tmp_path, seed=7, layer_types=["linear_attention", "full_attention", "linear_attention"],
                            num_hidden_layers=3)
    cfg, params = load_model(tmp_path)
    assert cfg.layer_kinds == ("lightning_attention", "full_attention", "lightning_attention")
    model = LoadedModel(cfg=cfg, params=params)
    ids = prompt(5, 45)
    (out,) = jhybrid.generate(model, [ids], max_tokens=32, ignore_eos=True)
    assert out.token_ids == hf_generate(hf_model, ids, 32)
    runner = SequenceRunner(cfg, params, max_len=64)
    table, slot = runner.start()
    assert rel_err(runner.step(ids, 0, table, slot, all_logits=True), hf_logits(hf_model, ids)) <= 1e-5


@pytest.mark.parametrize("family", ["nemotron_h"], indirect=True)
def test_nemotron_h_dt_clamp_is_inactive(family):
    """The premise of comparing HF's clamped prefill with its unclamped decode: the clamp never acts."""
    _, _, hf_model, model, _ = family
    ids = prompt(2, 53)
    mambas = [layer.mixer for layer in hf_model.model.layers if layer.block_type == "linear_attention"]
    projected = []  # in_proj outputs [1, T, Im + Cm + Hm]: dt is the last Hm columns
    hooks = [m.in_proj.register_forward_hook(lambda mod, inp, out: projected.append(out)) for m in mambas]
    try:
        hf_logits(hf_model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(projected) == len(mambas) == 2
    for mixer, out in zip(mambas, projected):
        dt = torch.nn.functional.softplus(out[..., -mixer.num_heads :] + mixer.dt_bias).detach()
        assert float(dt.min()) > 10 * hf_model.config.time_step_min, f"dt {float(dt.min()):.2e} near the clamp"
    assert model.cfg.mamba_dt_min == hf_model.config.time_step_min


@pytest.mark.slow
def test_nemotron_h_without_attention_layers(tmp_path):
    """No full-attention layer at all: the KV tuples are empty and the engine runs on state slots alone.
    HF's `generate` cannot run this model (its cache's `get_seq_length` raises without an attention layer),
    so the reference is HF's forward without a cache, greedy token by token."""
    hf_model = make_nemotron_h(tmp_path, seed=3, layers_block_type=["linear_attention", "mlp", "linear_attention"])
    cfg, params = load_model(tmp_path)
    assert cfg.num_full_layers == 0 and cfg.kv_bytes_per_token() == 0
    prompts = [prompt(8, 40), prompt(9, 9)]
    outs = jhybrid.generate(LoadedModel(cfg=cfg, params=params), prompts, max_tokens=12, ignore_eos=True)
    for ids, out in zip(prompts, outs):
        cur = list(ids)
        with torch.no_grad():
            for _ in range(12):
                cur.append(int(hf_model(torch.tensor([cur]), use_cache=False).logits[0, -1].argmax()))
        assert out.token_ids == cur[len(ids):]


def test_config_errors_name_the_problem():
    from jhybrid.config import ModelConfig

    with pytest.raises(ValueError, match="minimax.*nemotron_h.*bamba"):
        ModelConfig.from_hf({"model_type": "jamba"})
    base = dict(model_type="minimax", vocab_size=8, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=8, layer_types=["full_attention", "linear_attention"])
    assert ModelConfig.from_hf(base).layer_kinds == ("full_attention", "lightning_attention")
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf(base | {"sliding_window": 4})
    with pytest.raises(ValueError, match="unknown layer_types"):
        ModelConfig.from_hf(base | {"layer_types": ["full_attention", "mamba"]})
    nemo = dict(model_type="nemotron_h", vocab_size=8, hidden_size=8, num_attention_heads=2, head_dim=4,
                hybrid_override_pattern="M-*E", mamba_num_heads=4, mamba_head_dim=2, n_groups=3, ssm_state_size=4,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=4, n_group=2, topk_group=1)
    with pytest.raises(ValueError, match="multiple of groups"):
        ModelConfig.from_hf(nemo)
    cfg = ModelConfig.from_hf(nemo | {"n_groups": 2})
    assert cfg.layer_kinds == ("mamba2", "none", "full_attention", "none")
    assert cfg.mlp_kinds == ("none", "dense", "none", "moe")
    with pytest.raises(ValueError, match="moe_latent_size"):
        ModelConfig.from_hf(nemo | {"n_groups": 2, "moe_latent_size": 4})
    with pytest.raises(ValueError, match="cannot hold top-3"):
        ModelConfig.from_hf(nemo | {"n_groups": 2, "num_experts_per_tok": 3})


# ------------------------------------------------------------------------------- Granite specifics


@pytest.mark.slow
@pytest.mark.parametrize("family", ["granitemoehybrid"], indirect=True)
def test_granitemoehybrid_inspect_counts_from_hf(family):
    """`jhybrid inspect` against numbers taken from the HF model itself: per-layer parameter counts, the
    Mamba2 state shapes and bytes from the HF config, the KV bytes of the one attention layer."""
    _, path, hf_model, _, _ = family
    c = hf_model.config
    summary = summarize(path)
    conv = c.mamba_expand * c.hidden_size + 2 * c.mamba_n_groups * c.mamba_d_state  # x, B and C channels
    ssm = (c.mamba_n_heads, c.mamba_d_state, c.mamba_d_head)
    mamba_bytes = 4 * (conv * (c.mamba_d_conv - 1) + ssm[0] * ssm[1] * ssm[2])
    for layer, hf_layer, hf_type in zip(summary.layers, hf_model.model.layers, c.layer_types):
        assert layer.num_params == sum(p.numel() for p in hf_layer.parameters()), f"layer {layer.index}"
        assert layer.mlp == "moe"
        if hf_type == "linear_attention":
            assert layer.kind == "mamba2"
            assert layer.state == f"conv {conv}x{c.mamba_d_conv - 1} + ssm {'x'.join(map(str, ssm))}"
            assert layer.state_bytes == mamba_bytes
        else:
            assert (layer.kind, layer.state, layer.state_bytes) == ("full_attention", "", 0)
    assert summary.num_params == sum(p.numel() for p in hf_model.parameters())
    num_mamba = c.layer_types.count("linear_attention")
    assert summary.state_bytes_per_sequence == num_mamba * mamba_bytes
    head_dim = hf_model.model.layers[c.layer_types.index("full_attention")].self_attn.head_dim
    assert summary.kv_bytes_per_token == (c.num_hidden_layers - num_mamba) * 2 * c.num_key_value_heads * head_dim * 4
    text = summary.format()
    assert f"{num_mamba * mamba_bytes:,} bytes per sequence ({num_mamba} linear layers: {num_mamba} mamba2" in text
    assert "scalings: embeddings x12, attention scale 0.015, residual x0.22, logits /6" in text


@pytest.mark.slow
@pytest.mark.parametrize("family", ["granitemoehybrid"], indirect=True)
def test_granitemoehybrid_in_memory_names_equal_hub_names(family, tmp_path):
    """HF's in-memory MoE names (`router.weight`, `experts.gate_up_proj`, `experts.down_proj`; the hub
    checkpoint that `save_pretrained` writes has `router.layer.weight`, `input_linear`, `output_linear`)
    convert to the same parameters."""
    _, path, hf_model, _, _ = family
    assert "model.layers.0.block_sparse_moe.input_linear.weight" in SafetensorsCheckpoint(path).names()
    save_file({k: v.contiguous() for k, v in hf_model.state_dict().items()}, tmp_path / "model.safetensors")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in SafetensorsCheckpoint(tmp_path).names()
    got, want = flatten_params(load_model(tmp_path)[1]), flatten_params(load_model(path)[1])
    assert got.keys() == want.keys()
    for k in got:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)


@pytest.mark.slow
def test_granitemoehybrid_dense_nope_active_dt_clamp(tmp_path):
    """Granite's other layout: no experts (the shared MLP is the whole MLP), no RoPE
    (`position_embedding_type="nope"`, as the Granite-4.0-H checkpoints ship), tied embeddings, attention
    first, and a `time_step_limit` that clamps dt from both sides. HF clamps only in its chunked path
    (module docstring), so the reference is HF's cache-free forward, greedy token by token: every HF token
    goes through the clamped path, as every jhybrid step does."""
    limit = (0.3, 1.0)
    hf_model = make_granitemoehybrid(
        tmp_path, seed=5, num_hidden_layers=3, layer_types=["attention", "mamba", "mamba"], num_local_experts=0,
        position_embedding_type="nope", tie_word_embeddings=True, time_step_limit=limit,
    )
    cfg, params = load_model(tmp_path)
    assert cfg.mlp_kinds == ("dense",) * 3 and cfg.rotary_dim == 0 and cfg.tie_word_embeddings
    assert (cfg.mamba_dt_min, cfg.mamba_dt_max) == limit
    assert cfg.intermediate_size == hf_model.config.shared_intermediate_size
    ids = prompt(6, 40)
    mambas = [layer.mamba for layer in hf_model.model.layers if layer.mamba is not None]
    projected = []  # in_proj outputs [1, T, Im + Cm + Hm]: dt is the last Hm columns
    hooks = [m.in_proj.register_forward_hook(lambda mod, inp, out: projected.append(out)) for m in mambas]
    try:
        want = hf_logits(hf_model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    dts = [torch.nn.functional.softplus(out[..., -m.num_heads :] + m.dt_bias).detach()
           for m, out in zip(mambas, projected)]
    assert all(float(dt.min()) < limit[0] and float(dt.max()) > limit[1] for dt in dts), "the clamp never acts"
    runner = SequenceRunner(cfg, params, max_len=64)
    table, slot = runner.start()
    logits = np.asarray(runner.step(ids, 0, table, slot, all_logits=True))
    err = rel_err(logits, want)
    print(f"granitemoehybrid (dense, nope, dt clamped): prefill logits relative error vs HF {err:.2e}")
    assert err <= 1e-4, f"prefill logits relative error {err:.2e}"
    ours, last = [], logits[-1]
    for _ in range(8):  # jhybrid's one-token decode steps (clamped)
        ours.append(int(np.argmax(last)))
        last = np.asarray(runner.step([ours[-1]], len(ids) + len(ours) - 1, table, slot))
    cur = list(ids)
    with torch.no_grad():
        for _ in range(8):
            cur.append(int(hf_model(torch.tensor([cur]), use_cache=False).logits[0, -1].argmax()))
    assert ours == cur[len(ids):], "greedy decode differs from HF's cache-free (clamped) forward"


def test_granitemoehybrid_config_errors_name_the_problem():
    from jhybrid.config import ModelConfig

    base = dict(model_type="granitemoehybrid", vocab_size=8, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=4, shared_intermediate_size=6, num_local_experts=4, mamba_n_heads=4, mamba_n_groups=2,
                mamba_d_state=4, layer_types=["mamba", "attention"], position_embedding_type="rope",
                embedding_multiplier=12, attention_multiplier=0.015, residual_multiplier=0.22, logits_scaling=6)
    cfg = ModelConfig.from_hf(base)
    assert cfg.layer_kinds == ("mamba2", "full_attention") and cfg.mlp_kinds == ("moe", "moe")
    assert (cfg.embedding_multiplier, cfg.attention_scale, cfg.logits_scaling) == (12, 0.015, 6)
    assert (cfg.full_attn_beta, cfg.linear_attn_beta, cfg.mlp_beta, cfg.mlp_alpha) == (0.22, 0.22, 0.22, 1.0)
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.shared_expert_gate) == (4, 6, False)
    assert cfg.mamba_head_dim == 4 and cfg.rotary_dim == 4  # mamba_d_head "auto": 2 * 8 / 4; RoPE: whole head
    assert ModelConfig.from_hf(base | {"layer_types": ["linear_attention", "full_attention"]}) == cfg
    assert ModelConfig.from_hf({k: v for k, v in base.items() if k != "layer_types"}).layer_kinds == ("mamba2",) * 2
    with pytest.raises(ValueError, match="position_embedding_type='alibi'"):
        ModelConfig.from_hf(base | {"position_embedding_type": "alibi"})
    with pytest.raises(ValueError, match="unknown layer_types"):
        ModelConfig.from_hf(base | {"layer_types": ["mamba", "mlp"]})
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        ModelConfig.from_hf(base | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="leave no MLP"):
        ModelConfig.from_hf(base | {"num_local_experts": 0, "shared_intermediate_size": 0})
    with pytest.raises(ValueError, match="mamba_d_head"):
        ModelConfig.from_hf(base | {"mamba_d_head": 3})
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        ModelConfig.from_hf(base | {"hidden_act": "gelu"})
