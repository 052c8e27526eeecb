"""vLLM's `LLM(...)` options that are not `EngineConfig` fields, so that a vLLM script's constructor runs:
each is translated to a field, accepted and logged where it would change nothing here, or refused (ValueError
naming it) where it would change the output and jhybrid does not have it.

    LLM("dir", gpu_memory_utilization=0.8, dtype="auto", enforce_eager=True, num_gpu_blocks_override=512)
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("jhybrid.engine")

DTYPES = {"auto": None, "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
          "float32": "float32"}  # vLLM's dtype names -> EngineConfig.dtype (None: the checkpoint's)
RENAMED = {"num_gpu_blocks_override": "num_kv_blocks"}
# options that change nothing here (what they tune does not exist in jhybrid, or is always on): logged
NO_EFFECT = {
    "enforce_eager": "no CUDA graphs to capture", "max_seq_len_to_capture": "no CUDA graphs to capture",
    "compilation_config": "XLA compiles each step program once", "disable_custom_all_reduce": "XLA's collectives",
    "disable_async_output_proc": "the engine always reads a step behind", "async_scheduling": "always on",
    "swap_space": "the host tier is host_kv_memory_gb",
    "enable_chunked_prefill": "prefills are always chunked", "disable_log_stats": "no periodic stats log",
    "disable_log_requests": "requests are not logged", "trust_remote_code": "no remote code is run",
    "download_dir": "checkpoints are local directories", "hf_token": "checkpoints are local directories",
    "distributed_executor_backend": "one process drives every device", "max_logprobs": "at most 20 always",
    "use_v2_block_manager": "one block manager",
}
# options accepted at their vLLM default (or values meaning the same) only: any other value would change the
# output, and jhybrid does not have it
ACCEPTED_ONLY = {
    "tokenizer": (None,), "tokenizer_mode": ("auto", "hf"), "skip_tokenizer_init": (False,),
    "revision": (None,), "tokenizer_revision": (None,), "code_revision": (None,), "kv_cache_dtype": ("auto",),
    "load_format": ("auto", "safetensors"), "pipeline_parallel_size": (1,), "data_parallel_size": (1,),
    "cpu_offload_gb": (0,), "hf_overrides": (None,), "enable_lora": (False,), "speculative_config": (None,),
    "mm_processor_kwargs": (None,), "override_pooler_config": (None,), "logits_processors": (None,),
    "enable_sleep_mode": (False,), "task": ("auto", "generate"), "runner": ("auto", "generate"),
    "scheduling_policy": ("fcfs",),
}


def translate(model: Any, options: dict[str, Any]) -> dict[str, Any]:
    """`options` with vLLM's names and values turned into `EngineConfig` fields (unknown names are left for
    `engine_config` to name). Raises ValueError naming an option whose value jhybrid cannot honour."""
    out = {}
    for name, value in options.items():
        if name == "dtype" and value is not None and not isinstance(value, str):
            value = str(value).removeprefix("torch.")  # torch.bfloat16 -> "bfloat16"
        if name == "dtype" and isinstance(value, str) and value in DTYPES:
            out[name] = DTYPES[value]
        elif name == "seed" and value is None:
            continue  # vLLM's "no seed": the engine's default seed
        elif name == "quantization" and value is None:
            out[name] = "auto"  # vLLM's None: what the checkpoint's config says
        elif name in RENAMED:
            out[RENAMED[name]] = value
        elif name == "tokenizer" and value is not None and str(value) == str(model):
            continue  # the model's own tokenizer, named
        elif name in ACCEPTED_ONLY:
            if value not in ACCEPTED_ONLY[name]:
                raise ValueError(f"{name}={value!r} is not supported by jhybrid (it takes "
                                 f"{' or '.join(map(repr, ACCEPTED_ONLY[name]))}): leave it out")
        elif name in NO_EFFECT:
            log.info("vLLM option %s=%r changes nothing in jhybrid (%s)", name, value, NO_EFFECT[name])
        else:
            out[name] = value
    return out
