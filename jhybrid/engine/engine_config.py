"""`EngineConfig`: every engine option in one frozen dataclass, validated once, on construction.

`jhybrid.LLM(model, **options)`, `LLMEngine(model, config)`, `jhybrid.server.build_engine` / `serve` and the
command line all take it: the CLI's engine flags (`--max-num-seqs` for `max_num_seqs`, ...) are generated
from these fields, their types and their `help` metadata, so an option is added here and nowhere else.
Checks that need the model (`max_model_len` against its context, `tensor_parallel_size` against its head
counts) and the device (`swap_transfer="pinned"` needs pinned host memory) run when the engine is built.

    config = EngineConfig(max_num_seqs=64, max_model_len=4096)
    llm = jhybrid.LLM("path/to/checkpoint", config)                  # or jhybrid.LLM(path, max_num_seqs=64, ...)
    engine_config(config, warmup=True)                               # a copy with fields replaced, validated

A field may have older names (`ALIASES`: `memory_fraction` is `gpu_memory_utilization`, vLLM's name for it):
`EngineConfig(...)`, `engine_config(...)` and the CLI (`--memory-fraction`) take them too, and `config.memory_fraction`
reads the field.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

from jhybrid.engine.scheduler import KV_OFFLOAD_MODES, OFFLOAD_POLICIES, PREEMPTION_MODES
from jhybrid.engine.swap import TRANSFERS

QUANTIZATIONS = ("auto", "fp8", "none")
OFFLINE_SCHEDULER_STEPS = 8  # `num_scheduler_steps` of the offline API on a GPU when not given (`offline_defaults`)


def _option(default: Any, help: str, *, metavar: str | None = None, choices: tuple | None = None,
            none: str | None = None, group: str = "engine", aliases: tuple[str, ...] = ()) -> Any:
    """A field with what the CLI needs: `help`, `metavar`, `choices`, `group` (its section in `--help`), `none`
    (what a None default means) and `aliases` (older names, also accepted as flags and keywords)."""
    return dataclasses.field(default=default, metadata=dict(help=help, metavar=metavar, choices=choices, none=none,
                                                            group=group, aliases=aliases))


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The engine's options (each field's `help` metadata says what it does; `jhybrid serve --help` prints
    them). Raises ValueError naming the option when a value, or a combination, is invalid."""

    dtype: str | None = _option(
        "bfloat16", "parameter and KV dtype, float32 | bfloat16 | float16, when the model is loaded from a directory",
        metavar="D", none="the checkpoint's")
    quantization: str = _option(
        "auto", "weights of the dense projections and routed experts: fp8 holds them as block-wise FP8 (128 x 128 "
        "blocks of e4m3 with a scale each, where the input dim is a multiple of 128 and, under tensor parallelism, the "
        "split falls on whole blocks): projections run as FP8 matmuls (activations quantized per token and 128-group), "
        "experts are dequantized a layer at a time inside the step; a bf16 checkpoint is quantized at load (an HF "
        "one layer by layer as it is read); none runs an FP8 checkpoint dequantized; auto is fp8 for an FP8 "
        "checkpoint on a GPU with FP8 tensor cores, none otherwise", choices=QUANTIZATIONS)
    max_num_seqs: int = _option(16, "sequences running at once (one state slot each)", metavar="N")
    max_model_len: int | None = _option(None, "longest sequence, prompt + output", metavar="N",
                                        none="min(model context, 4096)")
    block_size: int = _option(16, "tokens per KV block", metavar="N")
    num_kv_blocks: int | None = _option(None, "KV blocks in the device pool", metavar="N",
                                        none="what --gpu-memory-utilization leaves after the state slots")
    gpu_memory_utilization: float = _option(
        0.9, "share of the device memory free once the weights are loaded that the KV pool and the state slots may "
        "take, a tenth of it kept for activations (vLLM's name; vLLM's share also counts the weights)", metavar="F",
        aliases=("memory_fraction",))
    max_num_batched_tokens: int | None = _option(
        None, "token budget of one step (longer prompts are prefilled in chunks)", metavar="N",
        none="max(512, min(2048, max_model_len))")
    max_prefill_tokens_with_decodes: int | None = _option(
        None, "prefill tokens a step that carries decode rows may take beside them (then up to the end of the "
        "token bucket, a power of two, that this lands the step in: its program runs over the whole bucket): "
        "smaller lowers running streams' inter-token latency while prompts arrive, at a cost in throughput "
        "(measured on the H200 in benchmarks/RESULTS.md, sessions 16-17)", metavar="N", none="the step's whole budget")
    num_scheduler_steps: int | None = _option(
        None, "multi-step decode: while every running sequence decodes and none waits, run this many decode steps in "
        "one program, each step's sampled tokens fed to the next on the device, and read them together (vLLM's "
        "option of this name); at batches of up to 8 rows the host's work between steps is then paid once per N "
        "tokens. Outputs are those of single steps. A sequence that stops early wastes the rest of its steps, and "
        "streamed tokens arrive N at a time; 1: off", metavar="N",
        none=f"{OFFLINE_SCHEDULER_STEPS} for the offline API (jhybrid.LLM, jhybrid.generate, `jhybrid generate`) on a "
        "GPU; else 1 (the server, whose streams would get tokens 8 at a time, and the CPU)")
    seed: int = _option(0, "seed of requests that give none", metavar="N")
    host_kv_memory_gb: float = _option(
        0.0, "host memory (GiB) for the KV blocks and state slots of preempted sequences (and, with prefix caching, "
        "for the cache's blocks and snapshots evicted from the device); 0: no host tier",
        metavar="G", group="host memory tier")
    preemption_mode: str = _option(
        "auto", "what a preempted sequence does: swap to the host tier (whenever it has room), recompute its tokens "
        "when it resumes, or auto: swap where the cost model prices it below recomputing; without a host tier it "
        "always recomputes", choices=PREEMPTION_MODES, group="host memory tier")
    swap_transfer: str = _option(
        "pageable", "where swapped-out KV and state wait: the host tier's pageable NumPy arrays, or JAX's page-locked "
        "pinned_host memory (as JAX arrays, until swapped back in)", choices=TRANSFERS, group="host memory tier")
    swap_bandwidth_gbps: float | None = _option(
        None, "the cost model's host-device bandwidth in GB/s", metavar="GBPS", none="measured at start",
        group="host memory tier")
    prefill_tokens_per_s: float | None = _option(
        None, "the cost model's prefill rate in tokens/s", metavar="R", none="measured at start",
        group="host memory tier")
    kv_offload: str = _option(
        "off", "let running sequences keep their oldest KV blocks in the host tier instead of being preempted "
        "(needs --host-kv-memory-gb), attending over them on the CPU (cpu) or over copies sent to the GPU each step "
        "(copy); where each wins: benchmarks/RESULTS.md", choices=KV_OFFLOAD_MODES, group="host memory tier")
    offload_policy: str = _option(
        "cost", "with --kv-offload: offload only where the cost model prices the rest of the sequence's host "
        "attention below the preemption it avoids (cost), or whenever a running sequence would otherwise be "
        "preempted (always; far slower than recomputing in benchmarks/RESULTS.md)", choices=OFFLOAD_POLICIES,
        group="host memory tier")
    offload_overlap: bool = _option(
        True, "with --kv-offload cpu: pipeline the CPU attention with the GPU's work (two sub-batches)",
        group="host memory tier")
    offload_threads: int | None = _option(None, "with --kv-offload cpu: CPU attention workers", metavar="N",
                                          none="half the CPU cores, at most 8", group="host memory tier")
    offload_admission: bool = _option(
        False, "with --kv-offload: also offload to admit waiting sequences, not only to keep running ones "
        "(slower than waiting in benchmarks/RESULTS.md)", group="host memory tier")
    enable_prefix_caching: bool = _option(
        False, "reuse the KV blocks and the linear layers' state of prompt prefixes seen before (exact: state "
        "snapshots at block boundaries, jhybrid/cache/prefix_cache.py); a hit's tokens are reported as "
        "usage.prompt_tokens_details.cached_tokens", group="prefix caching")
    prefix_snapshot_slots: int | None = _option(
        None, "with --enable-prefix-caching: state snapshots kept on the device (each the size of one sequence's "
        "linear state; counted by the memory planner)", metavar="N",
        none="a tenth of the cache memory, at least 2 * max_num_seqs + 2", group="prefix caching")
    prefix_snapshot_interval: int = _option(
        0, "with --enable-prefix-caching: also snapshot the state every N blocks of a long prompt (each costs a "
        "step boundary and a snapshot slot); 0: only where chunks end anyway", metavar="N",
        group="prefix caching")
    prefix_snapshot_prompt_end: bool = _option(
        False, "with --enable-prefix-caching: also cut each prompt's prefill at its last block boundary and snapshot "
        "there, so that the next request with the same prompt resumes there (without it, that request is the one "
        "that snapshots there, and the one after resumes); costs every prompt a short extra chunk: about 3.5 percent of "
        "served throughput at 64 streams without reuse on the H200 (benchmarks/RESULTS.md, session 26)",
        group="prefix caching")
    tensor_parallel_size: int = _option(
        1, "shard the model over N devices (a tensor-parallel mesh over the first N; N must divide the head counts)",
        metavar="N", group="parallelism")
    warmup: bool = _option(
        False, "compile every step program the scheduler can produce at start, on several threads, then never "
        "compile on the request path (sampling settings are runtime arrays, so that is the whole set); without "
        "it, a step waits for the compile of each shape the first time it meets it", group="compilation")

    def __post_init__(self):
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size"):
            _check_count(name, getattr(self, name))
        for name in ("max_model_len", "num_kv_blocks", "max_num_batched_tokens", "max_prefill_tokens_with_decodes",
                     "offload_threads", "prefix_snapshot_slots", "num_scheduler_steps"):
            if getattr(self, name) is not None:
                _check_count(name, getattr(self, name), " (or None: the default)")
        for name, choices in (("quantization", QUANTIZATIONS), ("preemption_mode", PREEMPTION_MODES),
                              ("swap_transfer", TRANSFERS),
                              ("kv_offload", KV_OFFLOAD_MODES), ("offload_policy", OFFLOAD_POLICIES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"unknown {name}={getattr(self, name)!r}; choose one of {choices}")
        if not _is_real(self.gpu_memory_utilization) or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization (memory_fraction) must be in (0, 1], got "
                             f"{self.gpu_memory_utilization!r}")
        if not self.host_kv_memory_gb >= 0:
            raise ValueError(f"host_kv_memory_gb={self.host_kv_memory_gb} must be >= 0 (0: no host tier)")
        for name in ("swap_bandwidth_gbps", "prefill_tokens_per_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 (or None: measured at start)")
        if self.preemption_mode == "swap" and not self.host_kv_memory_gb:
            raise ValueError("preemption_mode='swap' needs a host tier: set host_kv_memory_gb > 0")
        if self.kv_offload != "off" and not self.host_kv_memory_gb > 0:
            raise ValueError(f"kv_offload={self.kv_offload!r} keeps KV blocks in the host tier: set host_kv_memory_gb > 0")
        if isinstance(self.prefix_snapshot_interval, bool) or not isinstance(self.prefix_snapshot_interval, int) \
                or self.prefix_snapshot_interval < 0:
            raise ValueError(f"prefix_snapshot_interval must be an integer >= 0 (0: none), got {self.prefix_snapshot_interval!r}")
        if self.kv_offload != "off" and self.tensor_parallel_size > 1:
            raise ValueError(f"kv_offload={self.kv_offload!r} is not supported with "
                             f"tensor_parallel_size={self.tensor_parallel_size}: use kv_offload='off'")

    @property
    def memory_fraction(self) -> float:
        """The older name of `gpu_memory_utilization`."""
        return self.gpu_memory_utilization


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_count(name: str, value: Any, note: str = "") -> None:
    try:
        ok = not isinstance(value, bool) and operator.index(value) >= 1
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be an integer >= 1{note}, got {value!r}")


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(EngineConfig))
ALIASES = {alias: f.name for f in dataclasses.fields(EngineConfig) for alias in f.metadata["aliases"]}  # old -> field


def _renamed(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with older names (`ALIASES`) replaced by their fields' names."""
    options = dict(options)
    for alias, name in ALIASES.items():
        if alias in options:
            if name in options:
                raise TypeError(f"{name} and {alias} (its older name) both given: give {name} alone")
            options[name] = options.pop(alias)
    return options


_dataclass_init = EngineConfig.__init__


@functools.wraps(_dataclass_init)
def _init(self, /, **options: Any) -> None:
    _dataclass_init(self, **_renamed(options))


EngineConfig.__init__ = _init  # EngineConfig(memory_fraction=0.5) still works


def engine_config(config: EngineConfig | None = None, /, **options: Any) -> EngineConfig:
    """`config` (default: `EngineConfig()`) with the named fields replaced, validated. An unknown name raises
    TypeError listing the options; an older name (`ALIASES`) sets its field."""
    options = _renamed(options)
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise TypeError(f"unknown engine option(s) {', '.join(unknown)}; EngineConfig has: {', '.join(OPTION_NAMES)}")
    config = config if config is not None else EngineConfig()
    return dataclasses.replace(config, **options) if options else config


def offline_defaults(config: EngineConfig, backend: str) -> EngineConfig:
    """`config` with the offline API's defaults (`jhybrid.LLM`, hence `jhybrid.generate` and `jhybrid generate`)
    resolved: `num_scheduler_steps` None is `OFFLINE_SCHEDULER_STEPS` when `backend` (`jax.default_backend()`) is
    "gpu", else 1; a value given is kept. Offline, nobody watches tokens arrive, and on the H200 8 decode steps a
    program made batch-1 decode 6-30% faster per token with the same outputs (benchmarks/RESULTS.md, Session 31,
    call 3); the server (`LLMEngine` as built, which reads None as 1) keeps single steps, as its streams would get
    their tokens 8 at a time, and so does the CPU."""
    if config.num_scheduler_steps is not None:
        return config
    steps = OFFLINE_SCHEDULER_STEPS if backend == "gpu" else 1
    return dataclasses.replace(config, num_scheduler_steps=steps)
