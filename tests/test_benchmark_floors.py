"""The bytes and FLOPs that `benchmarks/floors.py` (issue 20's table) measures the engine against."""

import math


def test_floor_byte_counts_split_every_parameter_once():
    """`benchmarks.floors.byte_counts` (issue 20's bytes floors): the embedding table, the weights every token
    reads and the routed experts add up to all the parameter bytes, the experts are exactly MiniMax's
    E x 3 x hidden x intermediate per MoE layer, and the model FLOPs count top-k of E experts per token. Checked to
    fail with the expert test dropped (the experts counted as dense)."""
    from benchmarks.floors import byte_counts, hf_config
    from jhybrid.config import ModelConfig
    from jhybrid.models.params import flatten_shapes, param_shapes

    for name in ("qwen3_next", "nemotron_h", "minimax"):
        hf = hf_config(name, tiny=False)
        cfg = ModelConfig.from_hf(hf)
        shapes = flatten_shapes(param_shapes(cfg))
        counts = byte_counts(cfg, shapes)
        total = 2 * sum(math.prod(s) for s in shapes.values())
        assert counts["dense"] + counts["experts"] + 2 * math.prod(shapes["embed"]) == total, name
        if name == "minimax":
            per_layer = hf["num_local_experts"] * 3 * hf["hidden_size"] * hf["intermediate_size"] * 2
            assert counts["experts"] == hf["num_hidden_layers"] * per_layer
            dense_matmul = sum(math.prod(s) for n, s in shapes.items()
                               if len(s) >= 2 and n not in ("embed", "lm_head") and not n.endswith(("gate_proj", "up_proj", "down_proj")))
            routed = counts["experts"] / 2 * hf["num_experts_per_tok"] / hf["num_local_experts"]
            assert counts["matmul_params_per_token"] == dense_matmul + routed
        else:
            assert counts["experts"] == 0
