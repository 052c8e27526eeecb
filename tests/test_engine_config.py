"""`EngineConfig`: one set of engine options for `LLM`, `LLMEngine`, the server and the CLI, validated once.

The CLI's engine flags are generated from the fields; these tests check that every field is a flag of both
`jhybrid generate` and `jhybrid serve`, that each flag parses into its field, and that `jhybrid serve` hands
every option to the server, so an option added to EngineConfig cannot be missing in one of them.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import pytest

import jhybrid
from jhybrid.cli import GENERATE_DEFAULTS, SERVE_DEFAULTS, _parser, main
from jhybrid.engine.engine_config import (OFFLINE_SCHEDULER_STEPS, OPTION_NAMES, EngineConfig, engine_config,
                                         offline_defaults)
from jhybrid.models.params import init_params
from jhybrid.model_loader import LoadedModel
from tests.tp_worker import family_config

# a value other than the default for every field (and a valid EngineConfig together)
OTHER = dict(dtype="float32", quantization="fp8", max_num_seqs=3, max_model_len=96, block_size=8, num_kv_blocks=40,
             gpu_memory_utilization=0.5,
             max_num_batched_tokens=128, max_prefill_tokens_with_decodes=32, seed=7, host_kv_memory_gb=0.25,
             preemption_mode="swap", swap_transfer="pinned", swap_bandwidth_gbps=12.5, prefill_tokens_per_s=1000.0,
             kv_offload="copy", offload_policy="always", offload_overlap=False, offload_threads=2,
             offload_admission=True, tensor_parallel_size=1, warmup=True, enable_prefix_caching=True,
             prefix_snapshot_slots=5, prefix_snapshot_interval=4, prefix_snapshot_prompt_end=True,
             num_scheduler_steps=4)
OTHERS = [OTHER]
SUBCOMMANDS = {"generate": ([], GENERATE_DEFAULTS), "serve": (["--model", "m"], SERVE_DEFAULTS)}


def _flag(name: str, value) -> list[str]:
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, str(value)]


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def test_other_values_differ_from_every_default():
    assert set(OTHER) == set(OPTION_NAMES)
    for field in dataclasses.fields(EngineConfig):
        assert OTHER[field.name] != field.default or field.name == "tensor_parallel_size", field.name
        assert field.metadata["help"] and field.metadata["group"], field.name
    EngineConfig(**OTHER)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_field_is_a_flag(command):
    base, defaults = SUBCOMMANDS[command]
    args = _parser().parse_args([command, *base])
    expected = {f.name: defaults.get(f.name, f.default) for f in dataclasses.fields(EngineConfig)}
    assert {name: getattr(args, name) for name in OPTION_NAMES} == expected
    for other in OTHERS:
        argv = [command, *base] + [part for name, value in other.items() for part in _flag(name, value)]
        args = _parser().parse_args(argv)
        assert EngineConfig(**{name: getattr(args, name) for name in OPTION_NAMES}) == EngineConfig(**other)
    text = _subparser(command).format_help()
    for field in dataclasses.fields(EngineConfig):
        assert "--" + field.name.replace("_", "-") in text
        assert " ".join(field.metadata["help"].split()[:4]) in " ".join(text.split()), field.name


def test_engine_groups_hold_only_fields():
    """The flags of the engine's argument groups are EngineConfig's (and serve's compilation cache)."""
    for command in SUBCOMMANDS:
        parser = _subparser(command)
        groups = {f.metadata["group"] for f in dataclasses.fields(EngineConfig)}
        dests = {a.dest for g in parser._action_groups if g.title in groups for a in g._group_actions}
        assert dests - set(OPTION_NAMES) <= {"compilation_cache_dir", "no_compilation_cache", "coordinator",
                                             "num_processes", "process_id"}, command


def test_serve_passes_every_option(monkeypatch):
    import jhybrid.server

    seen = {}
    monkeypatch.setattr(jhybrid.server, "serve", lambda model, **kw: seen.update(kw, model=model))
    for other in OTHERS:
        assert main(["serve", "--model", "m"] + [part for name, value in other.items() for part in _flag(name, value)]) == 0
        assert engine_config(**{name: seen.pop(name) for name in OPTION_NAMES}) == EngineConfig(**other)
        assert not set(seen) & set(OPTION_NAMES)


@pytest.mark.parametrize("options, message", [
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(block_size=-1), "block_size"), (dict(max_num_seqs=True), "max_num_seqs"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size"), (dict(max_model_len=0), "max_model_len"),
    (dict(num_kv_blocks=2.5), "num_kv_blocks"), (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_prefill_tokens_with_decodes=0), "max_prefill_tokens_with_decodes"),
    (dict(offload_threads=0), "offload_threads"), (dict(memory_fraction=0.0), "memory_fraction"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"), (dict(host_kv_memory_gb=-1.0), "host_kv_memory_gb"),
    (dict(swap_bandwidth_gbps=0.0), "swap_bandwidth_gbps"), (dict(prefill_tokens_per_s=-5.0), "prefill_tokens_per_s"),
    (dict(preemption_mode="sometimes"), "preemption_mode='sometimes'"), (dict(swap_transfer="dma"), "swap_transfer='dma'"),
    (dict(kv_offload="gpu"), "kv_offload='gpu'"), (dict(offload_policy="never"), "offload_policy='never'"),
    (dict(preemption_mode="swap"), "host_kv_memory_gb"), (dict(kv_offload="cpu"), "host_kv_memory_gb"),
    (dict(kv_offload="copy", host_kv_memory_gb=1.0, tensor_parallel_size=2), "tensor_parallel_size"),
    # checked to fail with num_scheduler_steps left out of __post_init__'s checks
    (dict(num_scheduler_steps=0), "num_scheduler_steps"), (dict(num_scheduler_steps=True), "num_scheduler_steps"),
    (dict(num_scheduler_steps=2.0), "num_scheduler_steps"),
])
def test_bad_values_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)
    with pytest.raises(ValueError, match=message):  # a copy is validated too
        engine_config(EngineConfig(), **options)


def test_config_is_frozen_and_unknown_options_are_named():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().max_num_seqs = 4  # type: ignore[misc]
    with pytest.raises(TypeError, match="max_num_seq\\b.*max_num_seqs"):
        engine_config(max_num_seq=4)


def test_llm_takes_a_config_and_keyword_options():
    cfg = family_config("qwen3_5")
    model = LoadedModel(cfg=cfg, params=init_params(cfg, seed=0, scale=0.3))
    config = EngineConfig(dtype=None, max_num_seqs=2, num_kv_blocks=16)
    llm = jhybrid.LLM(model, config, max_model_len=64)
    # LLM resolves the offline defaults (num_scheduler_steps: None -> 1 here on the CPU, 8 on a GPU)
    assert llm.engine.config == offline_defaults(dataclasses.replace(config, max_model_len=64), jax.default_backend())
    assert llm.engine.max_model_len == 64 and llm.engine.scheduler.max_num_seqs == 2
    assert jhybrid.LLM(model, dtype=None, max_num_seqs=2, max_model_len=64, num_kv_blocks=16).engine.config == \
        llm.engine.config


def test_offline_defaults_resolve_num_scheduler_steps_by_backend():
    """`num_scheduler_steps` None (the default) is multi-step decode for the offline API on a GPU and single steps
    elsewhere; a value given is kept on both. Checked to fail with `offline_defaults` returning 1 always, and with
    it replacing a given value."""
    default = EngineConfig(max_num_seqs=3)
    assert default.num_scheduler_steps is None
    assert OFFLINE_SCHEDULER_STEPS == 8
    gpu = offline_defaults(default, "gpu")
    assert gpu.num_scheduler_steps == OFFLINE_SCHEDULER_STEPS
    assert gpu == dataclasses.replace(default, num_scheduler_steps=8)  # nothing else changed
    assert offline_defaults(default, "cpu").num_scheduler_steps == 1
    given = EngineConfig(num_scheduler_steps=3)
    for backend in ("gpu", "cpu"):
        assert offline_defaults(given, backend).num_scheduler_steps == 3, backend
