"""Tensor parallelism over a device mesh with JAX sharding (XLA SPMD inserts the collectives).

`make_mesh(N)` builds the 1-D "tp" mesh; `shard_params` / `init_sharded_state` place the packed parameters
(shard-major, `layout`) and the state pytree with NamedShardings (`sharding`); `init_distributed` joins a
multi-process job. The engine uses them when `LLM(..., tensor_parallel_size=N)`.
"""

from jhybrid.parallel.layout import TP_AXIS, deinterleave, interleave, num_shards, split_packed
from jhybrid.parallel.mesh import init_distributed, make_mesh
from jhybrid.parallel.sharding import (
    constrain_state,
    init_sharded_state,
    kv_replication,
    param_specs,
    replicate_kv_heads,
    replicated,
    shard_fraction,
    shard_params,
    shard_params_from,
    state_shardings,
    state_specs,
    to_shard_major,
    validate_tensor_parallel,
)

__all__ = [
    "TP_AXIS",
    "constrain_state",
    "deinterleave",
    "init_distributed",
    "init_sharded_state",
    "interleave",
    "kv_replication",
    "make_mesh",
    "num_shards",
    "param_specs",
    "replicate_kv_heads",
    "replicated",
    "shard_fraction",
    "shard_params",
    "shard_params_from",
    "split_packed",
    "state_shardings",
    "state_specs",
    "to_shard_major",
    "validate_tensor_parallel",
]
