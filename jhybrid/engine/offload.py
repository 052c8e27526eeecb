"""Offloaded attention (`kv_offload`): running sequences whose oldest KV blocks live in the host tier.

Moving blocks (`Offloader.dispatch` / `flush`): the scheduler's `OffloadOp`s are executed like swap outs,
KV only (the sequence's state slot stays on the GPU: it is still running): one jitted gather of the device
blocks is dispatched before the step (JAX orders it after the step that last wrote them) and its host copy
starts at once; `flush()`, called after the previous step is read, stores it into the host blocks. The
scheduler commits the op at its next `schedule()`, so no step reads a host block before it is written.

Attending (`HostAttention`): for a step with host-KV rows the runner builds a `HostPart` (traced arrays
inside the jitted step); every full layer then attends in two parts, each returning (o, lse):
  * the GPU part: the usual paged kernel over the row's device blocks (`block_table`), with positions
    shifted by `-n_host * BS` (RoPE was applied with the true positions before the cache write; the
    kernel uses positions only for the causal bound and the table index);
  * the host part, by mode:
      "cpu":  `jhybrid.cache.host_attention.host_paged_attention` on the CPU over the host blocks, called
              from inside the step (`jax.pure_callback`, or with `overlap` the two-sub-batch pipeline of
              `jhybrid.engine.pipeline`, whose start/finish callbacks let the GPU run the other half of
              the batch while the CPU attends);
      "copy": the baseline: the rows' host blocks are copied to the GPU before every step (one staging
              array per full layer, H2D) and attended there by the same paged kernel;
and `merge_attention` combines them (a row with nothing on the host has lse = -inf there: weight 0).

`HostAttention` is a static argument of the jitted step, hashed by identity: each engine compiles its
host-part programs once (steps without host-KV rows share the usual programs). The host block tables
never cross to the device: the runner registers each step's tables (`register_step`) and the callbacks
receive the step id.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import dataclasses
import functools
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.cache.host_attention import host_paged_attention
from jhybrid.cache.host_tier import HostTier
from jhybrid.cache.state import HybridState
from jhybrid.config import ModelConfig
from jhybrid.engine.scheduler import OffloadOp


_KEEP_STEPS = 8
log = logging.getLogger("jhybrid.engine")


def _pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


@jax.jit
def gather_blocks(state: HybridState, block_ids):
    """KV of `block_ids [N]` in every full layer: `k[i]`, `v[i]` `[N, BS, KVH, hd]`."""
    return tuple(k[block_ids] for k in state.k_pages), tuple(v[block_ids] for v in state.v_pages)


@dataclasses.dataclass
class OffloadStats:
    num_offload_ops: int = 0
    offload_bytes: int = 0  # device -> host, blocks offloaded
    offload_seconds: float = 0.0  # host time dispatching + flushing them
    num_steps_plain: int = 0  # steps with no host-KV row
    num_steps_host: int = 0  # steps with at least one host-KV row
    num_host_rows: int = 0  # host-KV rows summed over steps
    host_tokens_attended: int = 0  # host tokens summed over rows, steps (per full layer)
    num_cpu_calls: int = 0  # CPU attention jobs (per full layer per host step; the pipeline: one per half)
    cpu_attention_seconds: float = 0.0  # CPU time in them (worker threads, summed)
    cpu_job_seconds: float = 0.0  # wall time from submitting each CPU job to its last result, summed
    cpu_wait_seconds: float = 0.0  # of which the step waited (blocked in `finish`): not hidden
    copy_bytes: int = 0  # "copy": host -> device staging bytes
    copy_seconds: float = 0.0  # "copy": host time gathering + dispatching the staging arrays


class HostAttention:
    """The host part of offloaded attention for one engine: the host tier, the mode and the CPU workers.

    Passed to the jitted step as a static argument (hashed by identity: one compile set per engine)."""

    def __init__(self, cfg: ModelConfig, host: HostTier, mode: str, *, overlap: bool = True, num_threads: int = 4):
        if mode not in ("cpu", "copy"):
            raise ValueError(f"unknown host attention {mode=}")
        self.cfg, self.host, self.mode, self.overlap = cfg, host, mode, overlap and mode == "cpu"
        self.stats = OffloadStats()
        self.num_threads = max(1, num_threads)
        if self.mode == "cpu" and self.num_threads > 1:
            log.info("CPU attention: %d workers; NumPy's BLAS: %s", self.num_threads, single_threaded_blas())
        self._pool = concurrent.futures.ThreadPoolExecutor(self.num_threads, thread_name_prefix="jhybrid-cpu-attn")
        self._jobs: dict[int, tuple] = {}  # job id -> (futures, their row chunks, q shape, submit time)
        self._next_job = 1
        # step id -> host block tables `[B, M]` of its rows: host data never crosses to the device and back
        self._steps: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._next_step = 1
        self._lock = threading.Lock()

    def register_step(self, tables: np.ndarray) -> int:
        """Keeps a step's host block tables `[B, M]` (a snapshot) for its callbacks; returns its id. The last
        `_KEEP_STEPS` steps are kept (the engine has at most two in flight)."""
        with self._lock:
            step = self._next_step
            self._next_step = self._next_step % (2**31 - 2) + 1
            self._steps[step] = tables
            while len(self._steps) > _KEEP_STEPS:
                self._steps.popitem(last=False)
        return step

    # ------------------------------------------------------------- the CPU part
    def _attend_rows(self, layer: int, q, tables, lengths):
        t0 = time.perf_counter()
        o, lse = host_paged_attention(q, self.host.k[layer], self.host.v[layer], tables, lengths,
                                      scale=self.cfg.attention_scale)
        t1 = time.perf_counter()
        with self._lock:
            self.stats.cpu_attention_seconds += t1 - t0
        return o, lse, t1

    def _chunks(self, lengths) -> list[np.ndarray]:
        """Rows with host tokens in up to `num_threads` groups of similar total length (longest first, each
        to the lightest group)."""
        lengths = np.asarray(lengths)
        live = np.flatnonzero(lengths > 0)
        if len(live) == 0:
            return []
        parts = min(self.num_threads, len(live))
        groups: list[list[int]] = [[] for _ in range(parts)]
        load = np.zeros(parts)
        for row in live[np.argsort(-lengths[live], kind="stable")]:
            g = int(load.argmin())
            groups[g].append(int(row))
            load[g] += lengths[row]
        return [np.asarray(sorted(g)) for g in groups if g]

    def attend(self, layer: int, step, first_row, q, lengths):
        """Synchronous CPU attention of one full layer (`start` then `finish`)."""
        return self.finish(self.start(layer, step, first_row, q, lengths))

    def start(self, layer: int, step, first_row, q, lengths) -> np.ndarray:
        """Submits one full layer's CPU attention to the workers and returns a job id (int32 scalar) at once.

        q `[R, H, D]`: the queries of the step's rows `first_row .. first_row + R - 1`; lengths `[R]` their
        host tokens (0: nothing to do); their host block tables come from `register_step(step)`."""
        q, lengths = np.asarray(q, np.float32), np.asarray(lengths)
        first_row = int(first_row)
        tables = self._steps[int(step)][first_row : first_row + len(q)]
        chunks = self._chunks(lengths)
        submitted = time.perf_counter()
        futures = [self._pool.submit(self._attend_rows, layer, q[c], tables[c], lengths[c]) for c in chunks]
        with self._lock:
            job = self._next_job
            self._next_job = self._next_job % (2**31 - 2) + 1
            self._jobs[job] = (futures, chunks, q.shape, submitted)
            self.stats.num_cpu_calls += 1
        return np.int32(job)

    def finish(self, job) -> tuple[np.ndarray, np.ndarray]:
        """Waits for job `job` and returns its (o, lse)."""
        t0 = time.perf_counter()
        with self._lock:
            futures, chunks, shape, submitted = self._jobs.pop(int(job))
        concurrent.futures.wait(futures)
        waited = time.perf_counter() - t0
        o = np.zeros(shape, np.float32)
        lse = np.full(shape[:2], -np.inf, np.float32)
        done = submitted
        for rows, fut in zip(chunks, futures):
            o[rows], lse[rows], end = fut.result()
            done = max(done, end)
        with self._lock:
            self.stats.cpu_wait_seconds += waited
            self.stats.cpu_job_seconds += done - submitted
        return o, lse

    # ------------------------------------------------------------- copy mode
    def stage(self, host_tables: list[list[int]]):
        """"copy": the rows' host blocks gathered into fresh staging arrays and sent to the device.

        Returns (`k[i]`, `v[i]` `[NS, BS, KVH, hd]` device arrays, tables `[R, M]` into them); staging
        block 0 is zeros (padding)."""
        t0 = time.perf_counter()
        ids = [b for t in host_tables for b in t]
        num = _pow2(len(ids) + 1, 256)  # bucketed: each size is a compile
        order = np.zeros(num, np.int64)
        order[1 : len(ids) + 1] = ids
        staged = []
        for a in self.host.k + self.host.v:
            x = a[order]
            x[0] = 0
            x[len(ids) + 1 :] = 0
            staged.append(jax.device_put(x))
        nk = len(self.host.k)
        self.stats.copy_bytes += len(ids) * self.host.block_bytes
        self.stats.copy_seconds += time.perf_counter() - t0
        return tuple(staged[:nk]), tuple(staged[nk:])

    def __del__(self):
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)


def single_threaded_blas() -> str:
    """Makes NumPy's OpenBLAS run each call in its caller's thread (one thread).

    The CPU attention workers call BLAS concurrently; a multi-threaded OpenBLAS then serialises or
    oversubscribes them (measured: 2 workers slower than 1; with one BLAS thread they scale). Setting
    `OPENBLAS_NUM_THREADS=1` before NumPy loads does the same; this does it afterwards, through OpenBLAS's
    own `*set_num_threads*` entry point of the library NumPy loaded. Only NumPy's BLAS is affected (XLA
    does not use it). Returns what was done."""
    if os.environ.get("OPENBLAS_NUM_THREADS") == "1":
        return "OPENBLAS_NUM_THREADS=1"
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        paths = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], None
                fn(1)
                return f"{name}(1) in {os.path.basename(path)}"
    return "not OpenBLAS or not found: set OPENBLAS_NUM_THREADS=1 (or the BLAS's equivalent) if workers do not scale"


class Offloader:
    """Executes the scheduler's `OffloadOp`s: gather before the step, store in the host after it."""

    def __init__(self, host: HostTier, stats: OffloadStats):
        self.host, self.stats = host, stats
        self._pending: list[tuple[list[int], int, tuple]] = []

    def dispatch(self, state: HybridState, ops: list[OffloadOp]) -> None:
        if not ops:
            return
        t0 = time.perf_counter()
        device = [b for op in ops for b in op.device_blocks]
        host_blocks = [b for op in ops for b in op.host_blocks]
        assert len(device) == len(host_blocks) and 0 not in device and 0 not in host_blocks, ops
        ids = np.zeros(_pow2(len(device), 4), np.int32)  # padding reads the null page; not stored
        ids[: len(device)] = device
        data = gather_blocks(state, jnp.asarray(ids))
        for leaf in jax.tree.leaves(data):
            leaf.copy_to_host_async()
        self._pending.append((host_blocks, len(device), data))
        self.stats.num_offload_ops += len(ops)
        self.stats.offload_bytes += len(device) * self.host.block_bytes
        self.stats.offload_seconds += time.perf_counter() - t0

    def flush(self) -> None:
        """Stores the gathered blocks into their host blocks (waits for them)."""
        if not self._pending:
            return
        t0 = time.perf_counter()
        for host_blocks, n, (k, v) in self._pending:
            for dst, src in zip(self.host.k + self.host.v, tuple(k) + tuple(v)):
                dst[host_blocks] = np.asarray(src)[:n]
        self._pending.clear()
        self.stats.offload_seconds += time.perf_counter() - t0


@dataclasses.dataclass(frozen=True)
class HostPart:
    """The traced host-part metadata of one step (built inside the jitted step).

    offsets `[T]`: host tokens before each query token's device part (0 for rows without host KV);
    row_tokens `[B]`: packed index of each row's (single) query token; row_lengths `[B]`: host tokens of
    each row (0: none, and for padding rows); step: the `HostAttention.register_step` id ("cpu"); tables
    `[B, MH]` and stage: "copy"'s staging block tables and arrays."""

    attn: HostAttention
    offsets: jax.Array
    row_tokens: jax.Array
    row_lengths: jax.Array
    step: jax.Array | None = None
    tables: jax.Array | None = None
    stage: tuple | None = None

    def layer(self, i: int) -> "LayerHostPart":
        return LayerHostPart(self, i)

    def attend(self, i: int, q):
        """Host part of full layer `i` for all T query tokens: (o `[T, H, D]`, lse `[T, H]` fp32, -inf where
        a token has no host KV)."""
        num_tokens, num_heads, _ = q.shape
        q_rows = q[self.row_tokens]  # [B, H, D]
        if self.attn.mode == "copy":
            from pallas_kernels import paged_attention

            k_stage, v_stage = self.stage[0][i], self.stage[1][i]
            o_h, lse_h = paged_attention(q_rows, k_stage, v_stage, self.tables, jnp.arange(q_rows.shape[0]),
                                         self.row_lengths - 1, decode=True, scale=self.attn.cfg.attention_scale,
                                         return_lse=True)
        else:
            shapes = (jax.ShapeDtypeStruct(q_rows.shape, jnp.float32),
                      jax.ShapeDtypeStruct(q_rows.shape[:2], jnp.float32))
            o_h, lse_h = jax.pure_callback(functools.partial(self.attn.attend, i), shapes, self.step, jnp.int32(0),
                                           q_rows.astype(jnp.float32), self.row_lengths)
        live = self.row_lengths > 0  # padding rows repeat the last token: never scatter them
        target = jnp.where(live, self.row_tokens, num_tokens)
        lse_h = jnp.where(live[:, None], lse_h, -jnp.inf)  # an empty row read nothing
        o = jnp.zeros(q.shape, q.dtype).at[target].set(o_h.astype(q.dtype), mode="drop")
        lse = jnp.full((num_tokens, num_heads), -jnp.inf, jnp.float32).at[target].set(lse_h, mode="drop")
        return o, lse


@dataclasses.dataclass(frozen=True)
class LayerHostPart:
    """What `jhybrid.models.attention.attention_layer` sees of full layer `index`'s host part."""

    part: HostPart
    index: int

    @property
    def offsets(self) -> jax.Array:
        return self.part.offsets

    def __call__(self, q):
        return self.part.attend(self.index, q)
