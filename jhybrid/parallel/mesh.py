"""The device mesh for tensor parallelism, and multi-host start-up through `jax.distributed`.

One process per host runs the same program (JAX's multi-controller model): every process builds the same
engine, schedules the same requests in the same order and dispatches the same steps; XLA runs each step
over the global mesh and inserts the collectives (NCCL on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh

from jhybrid.parallel.layout import TP_AXIS

# environment variables `init_distributed` reads when its arguments are not given
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JHYBRID_COORDINATOR", "JHYBRID_NUM_PROCESSES", "JHYBRID_PROCESS_ID"


def make_mesh(tensor_parallel_size: int, devices=None) -> Mesh:
    """A 1-D mesh (axis "tp") over the first `tensor_parallel_size` devices (`jax.devices()`: every
    process's devices once `jax.distributed` is initialised)."""
    devices = list(jax.devices() if devices is None else devices)
    n = tensor_parallel_size
    if not isinstance(n, int) or not 1 <= n <= len(devices):
        raise ValueError(
            f"tensor_parallel_size={n!r} needs that many devices; {len(devices)} are visible "
            f"({devices[0].platform if devices else 'none'}). On a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
            "(set before JAX starts) gives N host devices"
        )
    return Mesh(np.asarray(devices[:n]), (TP_AXIS,))


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, cpu_collectives: str = "gloo") -> bool:
    """Joins this process to a multi-process JAX job (`jax.distributed.initialize`); call it before any
    other JAX call. Arguments default to $JHYBRID_COORDINATOR ("host:port" of process 0),
    $JHYBRID_NUM_PROCESSES and $JHYBRID_PROCESS_ID. Returns False (and does nothing) when no coordinator
    is given. On a CPU backend the cross-process collectives use `cpu_collectives` ("gloo").
    """
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    if not coordinator:
        return False
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if num_processes is None or process_id is None:
        raise ValueError(
            f"a multi-process run needs the number of processes and this process's id with {coordinator=}: pass "
            f"--num-processes/--process-id or set ${ENV_NUM_PROCESSES}/${ENV_PROCESS_ID}"
        )
    if not 0 <= process_id < num_processes:
        raise ValueError(f"need 0 <= process_id < num_processes, got {process_id=} {num_processes=}")
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if cpu_collectives and (platforms == "cpu" or platforms.startswith("cpu,")):
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    return True


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {value!r}") from None
