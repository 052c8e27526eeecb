"""Turns a scheduled step into arrays and runs the jitted step (forward + sampling) without waiting.

Host overhead per step is what bounds small-batch decode, so the runner keeps it small: block tables live
in a persistent NumPy array indexed by state slot (updated only when a sequence gains blocks), the step's
metadata is built with vectorised NumPy and crosses to the device as ONE int32 buffer (unpacked inside
the jitted step), and the sampled tokens with their log-probabilities come back as one array.

Rows whose last fed token was sampled by the previous step (not yet read on the host) take it from that
step's device output (`token_src`), so step n+1 is dispatched before step n's tokens reach the host. The call
of the step program runs on a dispatch thread of the runner (`dispatch_thread`, on the GPU), so the engine reads
step n and schedules step n+2 while it launches; `state`, `drain()` and `StepResult`'s outputs wait for that call.
The state programs between steps (zeroing new slots, prefix-cache restores, and the snapshot copies a step
program did not take in itself: `STEP_SNAPSHOT_SHARE`) are queued on the same thread behind it (`_state_op`).

Programs. Sampling settings are runtime arrays (`jhybrid.engine.sampling`), so a step's program depends only
on its shape: decode steps bucket their rows (powers of two from 4), mixed (prefill) steps carry `max_rows`
rows and bucket their tokens (powers of two from 64); on the CPU mixed steps bucket their rows too. The runner keeps the compiled programs in a
table of its own (`jax.jit(...).lower(...).compile()`), so `compile_all` can build every program of the
grid at once, on several threads, before serving; once `seal()`ed, a step whose bucket was not compiled
runs in the smallest compiled bucket that holds it instead of compiling on the request path (and a compile
that cannot be avoided is counted in `num_compiled_after_seal`). Steps with a row that wants prompt
log-probabilities run a variant of the mixed program (all `max_rows` rows, the smallest and largest token
buckets: `prompt_logprob_grid`) that keeps every position's hidden state and turns it into the log-probability of the
next prompt token and the top ones, a chunk of positions at a time; other steps run the plain programs, so a
request without prompt logprobs costs what it did. What a request asks for beyond a row of metadata (logit
bias, banned token sequences, allowed tokens) lives in device tables per state slot, written when such a
sequence takes a slot, and the token history that penalties read is per-slot state that each step updates with
the tokens it feeds (`jhybrid.engine.slot_tables`): these are arguments of every program, never new programs.
So is the structured-output grammar bitmask (`[rows, ceil(V/32)]` int32, `_token_mask`): built on the host for
the rows that sample under a grammar, an all-ones device array kept per row bucket when no row does. A decode step
whose masks need the tokens of the step before it (on the device when it is dispatched) runs split, as two
programs: `engine_forward` at once, and `engine_sample` once the host has read the step before and filled the
masks, during the forward (`_split_ready`, `sample_split`).

With a tensor-parallel `mesh` (`jhybrid.parallel`) the parameters and the state are sharded over its
devices, the step is jitted with them (XLA SPMD inserts the collectives) and sampling runs on gathered
logits; the outputs are replicated, so every process of a multi-process run reads them locally.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import os
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.cache.state import CacheConfig, HybridState, copy_rows, copy_slots, init_state, zero_rows, zero_slots
from jhybrid.config import ModelConfig
from jhybrid.engine.heap import freeze_startup_heap
from jhybrid.engine.sampling import (FLAG_PENALTIES, MAX_BAN_TOKENS, MAX_LOGPROBS, SamplerPlan, SamplingArrays,
                                     SamplingParams, SlotTables, TokenHistory, plan_for, prompt_logprobs,
                                     record_fed_tokens, sample)
from jhybrid.engine.slot_tables import SlotTableKeeper, recent_window
from jhybrid.engine.structured_output import bitmask_width, fill_bitmask, new_bitmask
from jhybrid.engine.scheduler import SchedulerOutput
from jhybrid.models.batch import Batch
from jhybrid.models.hybrid import forward, lm_head
from jhybrid import parallel

log = logging.getLogger("jhybrid.engine")
MIN_ROWS = 4  # smallest row bucket
# An engine of fewer sequences than MIN_ROWS (`max_num_seqs` 1 or 2) runs row buckets of its own size, not MIN_ROWS'
# padded ones: a single-sequence engine's steps are 1-row programs, and it compiles no more programs than before.
# Off until timed on the GPU (JHYBRID_SMALL_ENGINE_ROWS=1): a MiniMax-shaped batch-1 token took 0.744 ms in the
# device loop's 1-row program against 0.874 in the engine's 4-row bucket on an H100 (benchmarks/RESULTS.md, "Session
# 46"), where the padding rows' share of that difference is unmeasured.
SMALL_ENGINE_ROWS = os.environ.get("JHYBRID_SMALL_ENGINE_ROWS", "0") == "1"
# A mixed step's program zeroes the linear state of its rows that start their sequence (first fed token at position
# 0) before its forward, where the engine queued a `zero_slots` program of its own ahead of the step: that call
# held the step's dispatch back by 0.5-0.9 ms of host time on an H100, in every new request's first step; zeroed in
# the step, an 8k prompt's `generate` took 0.8% (NemotronH) and 2.4% (Qwen3-Next) less (benchmarks/RESULTS.md,
# "Session 51"). It costs each mixed step two scatters a linear layer. Decode programs do
# not do it (every decode step would pay the scatters, and their rows rarely start a sequence); the new slots of
# their rows, and of rows that start past position 0 (prefix hits, swap-ins), keep the separate program
# (`ModelRunner.slots_zeroed_by_step`). JHYBRID_ZERO_IN_STEP=0: always the separate program.
ZERO_IN_STEP = os.environ.get("JHYBRID_ZERO_IN_STEP", "1") == "1"
MIN_MIXED_TOKENS = 64  # smallest token bucket of a mixed (prefill) step
# multi-step decode (`num_scheduler_steps` > 1): the most rows a step may have to run several decode steps in one
# program (beyond them the device's step is long enough to hide the host's), and the sampler plans `warmup` builds
# such programs for: greedy rows, and rows that sample (temperature, top-k / top-p); JHYBRID_MULTI_STEP_MAX_ROWS
MULTI_STEP_MAX_ROWS = int(os.environ.get("JHYBRID_MULTI_STEP_MAX_ROWS", "8"))
WARM_BURST_PLANS = (SamplerPlan(), SamplerPlan(draw=True), SamplerPlan(draw=True, filtered=True))
SPLIT_COMPILE_THREAD = "jhybrid-split-compile"  # the thread that compiles split-step programs in the background
BURST_COMPILE_THREAD = "jhybrid-burst-compile"  # the thread that compiles multi-step programs in the background
# `burst_background` starts a multi-step program's compile only for rows of which one may still generate this many
# tokens: a compile took 3-4 s on the H200 (session 31) and multi-step decode saves 0.1-0.5 ms a token, so a short
# job would gain nothing from it, and its process would wait for the compile's thread at exit
BACKGROUND_BURST_MIN = 512
# With prefix caching, a step program copies up to ceil(rows x this) of its rows' state into snapshot slots after
# its forward (the pairs ride in its packed metadata), so the snapshots a step takes need no program call of their
# own (a `copy_slots` call cost ~1 ms of the dispatch thread per step at 64 rows on the H200); a prompt's snapshots
# beyond them go to `copy_slots`, a decode row's rolling ones beyond them are skipped (`Scheduler._register`). A
# padding pair still moves a row (~75 MB read and written for the 2.2 B model), so the share is what decode rows
# need on average: each snapshots once every `block_size` (16) tokens. 0: every snapshot is a `copy_slots` call,
# none skipped (benchmarks/RESULTS.md, "Session 25"). JHYBRID_STEP_SNAPSHOTS sets it.
STEP_SNAPSHOT_SHARE = float(os.environ.get("JHYBRID_STEP_SNAPSHOTS", "0.0625"))

# the packed metadata: (name, length as a function of T, B, M); float fields travel bit-cast to int32
_FIELDS = (
    ("token_ids", lambda t, b, m: t), ("positions", lambda t, b, m: t), ("token_seq", lambda t, b, m: t),
    ("slot_mapping", lambda t, b, m: t), ("cu_seqlens", lambda t, b, m: b + 1), ("block_tables", lambda t, b, m: b * m),
    ("slot_ids", lambda t, b, m: b), ("logits_index", lambda t, b, m: b), ("token_src", lambda t, b, m: b),
    ("temperature", lambda t, b, m: b), ("top_k", lambda t, b, m: b), ("top_p", lambda t, b, m: b),
    ("seeds", lambda t, b, m: b), ("counters", lambda t, b, m: b), ("host_offsets", lambda t, b, m: b),
    ("want_logprobs", lambda t, b, m: b), ("flags", lambda t, b, m: b), ("prompt_len", lambda t, b, m: b),
    ("min_p", lambda t, b, m: b), ("presence_penalty", lambda t, b, m: b), ("frequency_penalty", lambda t, b, m: b),
    ("repetition_penalty", lambda t, b, m: b), ("recent", lambda t, b, m: b * (MAX_BAN_TOKENS - 1)),
    ("steps", lambda t, b, m: b),  # a multi-step program's inner steps of each row (`_decode_burst`)
)
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_ROW_MATRICES = {"block_tables": lambda m: m, "recent": lambda m: MAX_BAN_TOKENS - 1}  # [B, ...] fields


# the step programs' conditionals (the sampler's `lax.cond`s) as CUDA-graph conditional nodes, evaluated on the
# device, instead of XLA's default: the runtime copies each predicate to the host and waits for the device to reach
# it, so the next program's launch cannot be queued ahead. Off (JHYBRID_GRAPH_CONDITIONALS=1 turns it on): on the
# H200 it moved neither the batch-64 step nor the sampling controls' cost (RESULTS, session 29); the prefill split's
# cond, which cost 15% of served throughput (session 28), is off by default
GRAPH_CONDITIONALS = os.environ.get("JHYBRID_GRAPH_CONDITIONALS", "0") == "1"
# XLA's default command-buffer kinds (its DebugOptions defaults), to which GRAPH_CONDITIONALS adds CONDITIONAL
# and WHILE: the option replaces the list, it cannot add to it
_DEFAULT_GRAPH_KINDS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"


def default_compiler_options(backend: str) -> dict[str, str | bool | int] | None:
    """XLA options for the step programs on `backend`. On the GPU: matmuls through cuBLAS, not Triton GEMM
    fusions (`xla_gpu_enable_triton_gemm=false`): the autotuner then only picks among cuBLAS algorithms, which cut
    the step programs' cold compilation by about a third on the H200 with the steps as fast (benchmarks/
    RESULTS.md, "Session 18"), except decode programs of few rows (`program_compiler_options`). An
    `xla_gpu_enable_triton_gemm` in XLA_FLAGS is the user's choice and is kept; so is an
    `xla_gpu_enable_command_buffer` there, over GRAPH_CONDITIONALS."""
    if backend != "gpu":
        return None
    flags = os.environ.get("XLA_FLAGS", "")
    options: dict[str, str | bool | int] = {}
    if "xla_gpu_enable_triton_gemm" not in flags:
        options["xla_gpu_enable_triton_gemm"] = False
    if GRAPH_CONDITIONALS and "xla_gpu_enable_command_buffer" not in flags:
        options["xla_gpu_enable_command_buffer"] = _DEFAULT_GRAPH_KINDS + ",CONDITIONAL,WHILE"
    return options or None


# Decode programs of at most this many rows keep XLA's Triton GEMM fusions (XLA's default) where
# `default_compiler_options` turns them off for the rest. With cuBLAS, a few rows' projections ran as split-K GEMMs,
# each with a reduction kernel and padding kernels of its own; Triton's GEMM fusions take in the padding and the
# neighbouring elementwise work. The engine's batch-1 token (a 4-row program) took 13% less time on the H200
# (qwen3_next, single steps), and in 8-step programs 21% (NemotronH) and 9% (MiniMax) less on the H200, 18%, 13% and
# 9% on an H100. Single steps of 8, 16, 32 and 64 rows: 0%, -5%, -1%, +1% (benchmarks/RESULTS.md, "Session 37").
# Few programs are this small, so their GEMM autotuning adds little to start-up. 0: every program with cuBLAS
# (JHYBRID_TRITON_GEMM_ROWS).
TRITON_GEMM_MAX_ROWS = int(os.environ.get("JHYBRID_TRITON_GEMM_ROWS", "16"))


def program_compiler_options(options: dict | None, decode: bool, num_rows: int) -> dict | None:
    """The XLA options of one step program: `options` (the runner's), with Triton GEMM fusions back on for a
    decode program of at most `TRITON_GEMM_MAX_ROWS` rows where `options` turned them off."""
    if options and options.get("xla_gpu_enable_triton_gemm") is False and decode and num_rows <= TRITON_GEMM_MAX_ROWS:
        return {**options, "xla_gpu_enable_triton_gemm": True}
    return options


def _pow2(n: int, minimum: int) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _unpack(meta: jax.Array, t: int, b: int, m: int) -> dict[str, jax.Array]:
    out, offset = {}, 0
    for name, size in _FIELDS:
        n = size(t, b, m)
        x = meta[offset : offset + n]
        if name in _FLOAT_FIELDS:
            x = jax.lax.bitcast_convert_type(x, jnp.float32)
        out[name] = x.reshape(b, _ROW_MATRICES[name](m)) if name in _ROW_MATRICES else x
        offset += n
    return out


def meta_size(layout: tuple[int, int, int], snaps: int = 0) -> int:
    """Length of the packed metadata of `layout = (T, B, M)`, with `snaps` snapshot pairs after the fields."""
    return sum(size(*layout) for _, size in _FIELDS) + 2 * snaps


def step_snapshot_rows(num_rows: int, share: float) -> int:
    """The snapshot pairs a step program of `num_rows` rows takes in (`STEP_SNAPSHOT_SHARE`)."""
    return 0 if share <= 0 else min(num_rows, max(1, math.ceil(num_rows * share)))


def _step_inputs(meta: jax.Array, prev_out: jax.Array, history: TokenHistory, layout: tuple[int, int, int]):
    """The step's unpacked metadata, its `Batch` (the rows' fed tokens taken from `prev_out` where the previous
    step sampled them), its `SamplingArrays`, and `history` with the fed tokens of rows with penalties added."""
    f = _unpack(meta, *layout)
    num_tokens = layout[0]
    token_src = f["token_src"]
    target = jnp.where(token_src >= 0, f["cu_seqlens"][1:] - 1, num_tokens)  # out of range: dropped
    token_ids = f["token_ids"].at[target].set(prev_out[0][jnp.maximum(token_src, 0)], mode="drop")
    batch = Batch(token_ids=token_ids, positions=f["positions"], token_seq=f["token_seq"],
                  slot_mapping=f["slot_mapping"], cu_seqlens=f["cu_seqlens"], block_tables=f["block_tables"],
                  slot_ids=f["slot_ids"], logits_index=f["logits_index"])
    # the fed tokens of rows with penalties join their slot's history (before sampling: a decode row's fed token
    # is its last output token); padding tokens (past cu_seqlens[-1]) are not recorded
    prompt_len, flags, rows = f["prompt_len"], f["flags"], f["token_seq"]
    real = jnp.arange(num_tokens) < f["cu_seqlens"][-1]
    history = record_fed_tokens(history, f["slot_ids"][rows], token_ids, f["positions"] >= prompt_len[rows],
                                real & ((flags[rows] & FLAG_PENALTIES) != 0))
    last_fed = token_ids[f["logits_index"]]  # [B]
    sampling = SamplingArrays(temperature=f["temperature"], top_k=f["top_k"], top_p=f["top_p"],
                              seeds=f["seeds"], counters=f["counters"], want_logprobs=f["want_logprobs"],
                              slot_ids=f["slot_ids"], flags=flags, min_p=f["min_p"],
                              presence_penalty=f["presence_penalty"], frequency_penalty=f["frequency_penalty"],
                              repetition_penalty=f["repetition_penalty"],
                              num_output=f["positions"][f["logits_index"]] + 1 - prompt_len,
                              recent=jnp.where(f["recent"] == -3, last_fed[:, None], f["recent"]))
    return f, batch, sampling, history


def _zero_started_rows(state: HybridState, f: dict, num_tokens: int) -> HybridState:
    """`state` with the linear state of each row that starts its sequence in this step (it feeds tokens, the first
    at position 0) zeroed (`ZERO_IN_STEP`); other rows and padding rows are left alone."""
    if not state.conv and not state.ssm:
        return state
    cu = f["cu_seqlens"]
    first = f["positions"][jnp.minimum(cu[:-1], num_tokens - 1)]
    starts = (cu[1:] > cu[:-1]) & (first == 0)
    past = (state.ssm or state.conv)[0].shape[0]  # a state row index past the last: dropped
    return zero_rows(state, jnp.where(starts, f["slot_ids"], past))


def _sample_packed(logits, sampling: SamplingArrays, tables: SlotTables, history: TokenHistory,
                   token_mask: jax.Array | None, max_rows: int, mesh, plan: SamplerPlan | None = None):
    """Samples each row and packs the tokens with their bit-cast logprobs into `[2, max_rows]` int32; returns
    (packed, top logprobs, top ids), replicated over `mesh`."""
    tokens, token_logp, top_lp, top_ids = sample(logits, sampling, tables, history, token_mask, plan)
    packed = jnp.zeros((2, max_rows), jnp.int32)
    packed = packed.at[0, : tokens.shape[0]].set(tokens)
    packed = packed.at[1, : tokens.shape[0]].set(jax.lax.bitcast_convert_type(token_logp, jnp.int32))
    if mesh is not None:
        packed, top_lp, top_ids = (parallel.replicated(x, mesh) for x in (packed, top_lp, top_ids))
    return packed, top_lp, top_ids


def _decode_burst(cfg: ModelConfig, params, state: HybridState, f: dict, batch: Batch, sampling: SamplingArrays,
                  tables: SlotTables, history: TokenHistory, *, steps: int, plan: SamplerPlan, max_rows: int,
                  block_size: int):
    """`steps` decode steps of one program (multi-step scheduling): each inner step's sampled tokens are the
    next one's fed tokens, on the device. Row i runs `f["steps"][i]` of them (padding rows none); once a row has
    run its own, its later inner steps write the null slot and the null page and keep its position, so they
    change nothing of its KV or state, and their tokens are not read. Each inner step is the plain decode step's
    work for the same inputs: the fed tokens join the penalties' history, the sampling counter (the draws'
    key) and the output count advance by one. The sampler runs as `plan` says (no `lax.cond`). Returns (`[2, R]`
    each row's last token and logprob, `[K, 2, R]` every inner step's, `[K, B, L]` top logprobs and ids, state,
    history)."""
    num_rows = batch.slot_ids.shape[0]  # a decode step: token i is row i's (padding tokens: padding rows')
    limit = f["steps"]
    penalised = (sampling.flags & FLAG_PENALTIES) != 0
    rows = jnp.arange(num_rows)
    null_page = rows % block_size  # where padding tokens write: the null page
    last_block = batch.block_tables.shape[1] - 1

    def body(j, carry):
        state, history, batch, sampling, last, outs, top_lps, top_ids = carry
        live = j < limit  # [B]
        run = dataclasses.replace(batch, slot_ids=jnp.where(live, batch.slot_ids, 0),
                                  slot_mapping=jnp.where(live, batch.slot_mapping, null_page))
        logits, state = forward(cfg, params, state, run, decode=True)
        packed, top_lp, top_id = _sample_packed(logits, sampling, tables, history, None, max_rows, None, plan)
        live_r = jnp.zeros(max_rows, bool).at[:num_rows].set(live)
        last = jnp.where(live_r[None, :], packed, last)
        outs, top_lps, top_ids = outs.at[j].set(packed), top_lps.at[j].set(top_lp), top_ids.at[j].set(top_id)
        # the next inner step feeds each row's token (rows past their last keep their inputs)
        more = live & (j + 1 < limit)
        tokens = packed[0, :num_rows]
        positions = batch.positions + more
        page = batch.block_tables[rows, jnp.minimum(positions // block_size, last_block)]
        history = record_fed_tokens(history, batch.slot_ids, tokens, more, more & penalised)
        batch = dataclasses.replace(
            batch, token_ids=jnp.where(more, tokens, batch.token_ids), positions=positions,
            slot_mapping=jnp.where(more, page * block_size + positions % block_size, batch.slot_mapping))
        sampling = dataclasses.replace(sampling, counters=sampling.counters + more,
                                       num_output=sampling.num_output + more)
        return state, history, batch, sampling, last, outs, top_lps, top_ids

    width = MAX_LOGPROBS
    carry = (state, history, batch, sampling, jnp.zeros((2, max_rows), jnp.int32),
             jnp.zeros((steps, 2, max_rows), jnp.int32), jnp.zeros((steps, num_rows, width), jnp.float32),
             jnp.zeros((steps, num_rows, width), jnp.int32))
    state, history, _, _, last, outs, top_lps, top_ids = jax.lax.fori_loop(0, steps, body, carry)
    return last, outs, top_lps, top_ids, state, history


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "layout", "decode", "max_rows", "mesh", "host_layout", "host_attn", "snaps", "burst",
                     "plan", "block_size"),
    donate_argnames=("state", "history"),
)
def engine_step(cfg: ModelConfig, params, state: HybridState, meta: jax.Array, prev_out: jax.Array,
                tables: SlotTables, history: TokenHistory, host_meta: jax.Array | None = None, stage=None,
                plp_meta: jax.Array | None = None, token_mask: jax.Array | None = None, *,
                layout: tuple[int, int, int], decode: bool, max_rows: int, mesh=None,
                host_layout: tuple[int, int] | None = None, host_attn=None, snaps: int = 0, burst: int = 1,
                plan: SamplerPlan | None = None, block_size: int = 16):
    """One step. `meta` is the packed int32 metadata of `layout = (T, B, M)`; `prev_out [2, R]` the previous
    step's output (row 0: its sampled tokens); `tables` the per-slot sampling tables and `history` (donated) the
    per-slot token history, to which the step adds the tokens it feeds (rows with penalties). Returns (`[2, R]`
    int32: tokens and their bit-cast fp32 logprobs, `[B, L]` top logprobs, `[B, L]` top ids, state, history), and
    with `plp_meta` (`[T + 1]`: each packed token's next prompt token whose logprob is
    wanted, -1 for none; then 1 when some row wants top prompt logprobs) a sixth item, the prompt
    log-probabilities (`[T]` logprob of each target, `[T, L]` top logprobs, `[T, L]` top ids). Steps without
    `plp_meta` are the programs of requests that want no prompt logprobs, unchanged. `token_mask` (`[B,
    ceil(V/32)]` int32) is the structured-output grammar bitmask of the rows with FLAG_MASKED (`sample`).

    Offloaded attention (`host_attn`: the engine's `HostAttention`, static, by identity): `host_layout` is
    None for a step without host-KV rows, `(0,)` for "cpu" (`host_meta [1]`: the step's registered id) and
    `(MH,)` for "copy" (`host_meta [B * MH]`: staging block tables; `stage`: the staging arrays).

    `snaps`: prefix-cache snapshots taken after the forward, `copy_rows(state, src, dst)` with `src` and `dst` the
    `snaps` ints each that follow the fields in `meta` (pairs with `dst` past the last state row are padding).

    `burst` > 1 (a decode step on one device, without host-KV rows, prompt logprobs or grammar masks): that many
    decode steps in this one program (`_decode_burst`, sampling by `plan`; `block_size` the KV pages'); the
    outputs' top logprobs and ids are then `[burst, B, L]`, and a sixth item, `[burst, 2, R]`, holds every inner
    step's tokens and logprobs (the first item: each row's last)."""
    f, batch, sampling, history = _step_inputs(meta, prev_out, history, layout)
    num_tokens = layout[0]
    if burst > 1:
        last, outs, top_lp, top_ids, state, history = _decode_burst(
            cfg, params, state, f, batch, sampling, tables, history, steps=burst, plan=plan, max_rows=max_rows,
            block_size=block_size)
        if snaps:
            pairs = meta[meta_size(layout) : meta_size(layout, snaps)]
            state = copy_rows(state, pairs[:snaps], pairs[snaps:])
        return last, top_lp, top_ids, state, history, outs
    if ZERO_IN_STEP and not decode:
        state = _zero_started_rows(state, f, num_tokens)
    host = None
    if host_layout is not None:
        from jhybrid.engine.offload import HostPart

        real = jnp.arange(num_tokens) < f["cu_seqlens"][-1]  # padding tokens keep their positions
        offsets = jnp.where(real, f["host_offsets"][f["token_seq"]], 0)
        (mh,) = host_layout
        host = HostPart(attn=host_attn, offsets=offsets, row_tokens=f["logits_index"], row_lengths=f["host_offsets"],
                        step=host_meta[0] if mh == 0 else None,
                        tables=host_meta.reshape(layout[1], mh) if mh else None, stage=stage)
    if host is not None and decode and host_attn.overlap:
        from jhybrid.engine.pipeline import forward_pipelined

        logits, state = forward_pipelined(cfg, params, state, batch, host,
                                          kernels=dict(impl="auto", interpret=False, mesh=None))
    elif plp_meta is not None:  # every position's hidden state, then this step's sampling logits from it
        hidden, state = forward(cfg, params, state, batch, decode=decode, mesh=mesh, host_attention=host,
                                return_hidden=True)
        logits = lm_head(cfg, params, hidden[batch.logits_index])  # [B, V]
    else:
        logits, state = forward(cfg, params, state, batch, decode=decode, mesh=mesh, host_attention=host)
    if mesh is not None:  # sample on the gathered logits; keep the state in its shards
        logits, state = parallel.replicated(logits, mesh), parallel.constrain_state(state, cfg, mesh)
    if snaps:
        pairs = meta[meta_size(layout) : meta_size(layout, snaps)]
        state = copy_rows(state, pairs[:snaps], pairs[snaps:])
    packed, top_lp, top_ids = _sample_packed(logits, sampling, tables, history, token_mask, max_rows, mesh)
    if plp_meta is None:
        return packed, top_lp, top_ids, state, history
    plp = prompt_logprobs(lambda h: lm_head(cfg, params, h), hidden, plp_meta[:num_tokens], plp_meta[num_tokens] > 0)
    if mesh is not None:
        plp = tuple(parallel.replicated(x, mesh) for x in plp)
    return packed, top_lp, top_ids, state, history, plp


# A step whose grammar masks wait on the previous step's tokens runs as two programs (`ModelRunner.execute`,
# `split`): the forward, dispatched at once, and the sampling, dispatched once the host has read the previous
# step and filled the masks, which it does while the device runs the forward (vLLM splits its step the same way
# for structured output). The two compose to `engine_step` exactly: the same helpers, in the same order.
@functools.partial(jax.jit, static_argnames=("cfg", "layout", "decode"), donate_argnames=("state", "history"))
def engine_forward(cfg: ModelConfig, params, state: HybridState, meta: jax.Array, prev_out: jax.Array,
                   history: TokenHistory, *, layout: tuple[int, int, int], decode: bool):
    """`engine_step` up to its logits (one device, no host-KV rows, no prompt logprobs): returns (`[B, V]`
    logits, the step's `SamplingArrays`, state, history)."""
    _, batch, sampling, history = _step_inputs(meta, prev_out, history, layout)
    logits, state = forward(cfg, params, state, batch, decode=decode)
    return logits, sampling, state, history


@functools.partial(jax.jit, static_argnames=("max_rows",))
def engine_sample(logits, sampling: SamplingArrays, tables: SlotTables, history: TokenHistory, token_mask: jax.Array,
                  *, max_rows: int):
    """`engine_step`'s sampling on `engine_forward`'s outputs: returns (`[2, R]` packed tokens and logprobs, top
    logprobs, top ids)."""
    return _sample_packed(logits, sampling, tables, history, token_mask, max_rows, None)


class StepResult:
    """A dispatched step. Its device outputs: `out` ([2, R]: tokens, bit-cast logprobs), `top_logp` / `top_ids`
    ([B, L]; None when no row asked for log-probabilities: not fetched) and `plp` (steps with rows that want
    prompt log-probabilities: `engine_step`'s fifth output). With a dispatch thread they exist once the step
    program's call there has returned: reading them waits for that (not for the device). `plp_rows`: per row
    that wants prompt log-probabilities, (sequence, first prompt position, packed index of its first token,
    positions). `split`: a step whose forward alone is dispatched (`ModelRunner.execute`); its sampling follows
    with `ModelRunner.sample_split`. `accepted`: row -> whether its grammar took the row's token, for the rows
    whose matchers took this step's tokens before the host read it (`ModelRunner.read_matchers`). `burst`: the
    inner steps of a multi-step decode step (`sched.burst`); its `out` holds each row's last token, and its
    tokens, logprobs and top ones come back per inner step (`fetch_tokens`, `fetch`)."""

    def __init__(self, sched: SchedulerOutput, outputs: tuple | None, plp_rows: tuple = (),
                 want_logprobs: bool = True, pending: Future | None = None, split: "SplitStep | None" = None,
                 num_rows: int = 0):
        self.sched, self.plp_rows, self.split = sched, plp_rows, split
        self.burst = sched.burst
        self.num_rows = num_rows  # the row bucket (a burst's top logprobs: inner step j's row i at j * it + i)
        self._want_logprobs, self._pending = want_logprobs, pending
        self._outputs = outputs  # (out, top_logp, top_ids, [plp]) once the call has returned
        self._fetched = None
        self._tokens = None
        self.accepted: dict[int, bool] | None = None

    def _get(self, i: int):
        if self._outputs is None:
            if self._pending is None:
                raise AssertionError("a split step was read before its sampling was dispatched (sample_split)")
            self._outputs, self._pending = self._pending.result(), None
        out, top_lp, top_ids, rest = self._outputs
        plp_out = rest[0] if rest and self.burst == 1 else None
        steps_out = rest[0] if self.burst > 1 else None
        return (out, top_lp if self._want_logprobs else None, top_ids if self._want_logprobs else None,
                plp_out, steps_out)[i]

    out = property(lambda self: self._get(0))
    top_logp = property(lambda self: self._get(1))
    top_ids = property(lambda self: self._get(2))
    plp = property(lambda self: self._get(3))
    steps_out = property(lambda self: self._get(4))  # a burst's `[K, 2, R]`

    def fetch_prompt_logprobs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(`[T]` logprob of each packed position's next prompt token, `[T, L]` top logprobs, `[T, L]` their
        ids) on the host, or None for a step without prompt log-probabilities."""
        if self.plp is None:
            return None
        lp, top_lp, top_ids = self.plp
        if not any(seq.params.prompt_logprobs for seq, *_ in self.plp_rows):
            return _local(lp), None, None  # no row wants the top ones: they are zeros
        return _local(lp), _local(top_lp), _local(top_ids)

    @property
    def needs_sampling(self) -> bool:
        """A split step whose sampling is not dispatched yet (`ModelRunner.sample_split`)."""
        return self.split is not None and self._outputs is None and self._pending is None

    def fetch_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, their logprobs) on the host, `[R]` each (a burst's: `[K, R]`, by inner step); transferred
        once (waits for this step only)."""
        if self._tokens is None:
            if self.burst > 1:
                out = _local(self.steps_out)
                self._tokens = out[:, 0], out[:, 1].view(np.float32)
            else:
                out = _local(self.out)
                self._tokens = out[0], out[1].view(np.float32)
        return self._tokens

    def fetch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        """(tokens, their logprobs, top logprobs, top ids) on the host; transferred once (waits for this step
        only). A burst's top logprobs and ids are `[K * B, L]`: inner step j's row i at `j * B + i`."""
        if self._fetched is None:
            tokens, logp = self.fetch_tokens()
            top_lp = _local(self.top_logp) if self.top_logp is not None else None
            top_ids = _local(self.top_ids) if self.top_ids is not None else None
            if self.burst > 1 and top_lp is not None:
                top_lp, top_ids = top_lp.reshape(-1, top_lp.shape[-1]), top_ids.reshape(-1, top_ids.shape[-1])
            self._fetched = tokens, logp, top_lp, top_ids
        return self._fetched


class SplitStep(NamedTuple):
    """What `ModelRunner.sample_split` needs of a split step beyond its schedule: the rows that sample under a
    grammar, the row bucket, the sampling tables it was dispatched with, the sampling program, and the forward's
    outputs (a Future of them on the dispatch thread)."""

    masked: list[int]
    num_rows: int
    tables: SlotTables
    program: object
    forward: object


def _local(x: jax.Array) -> np.ndarray:
    """A replicated output on the host (across processes: this process's copy)."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def _shapes(tree):
    """`tree` with its arrays replaced by their shapes and dtypes, for a program traced on another thread (the
    arrays may be donated meanwhile). One device, no sharding: the program's outputs stay uncommitted, as the whole
    step's are, so the programs that take the state next see what they were built for."""
    spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array | np.ndarray) else x  # noqa: E731
    return jax.tree.map(spec, tree)


def _in_background(thread_name: str, fn) -> Future:
    """`fn()` on a thread of its own named `thread_name` (its pool shut down at once: the thread ends with `fn`)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


class ModelRunner:
    """`mesh`: a tensor-parallel mesh (`jhybrid.parallel.make_mesh`); the packed `params` are then
    re-laid out shard-major and sharded over it, and the state is created in its shards."""

    def __init__(self, cfg: ModelConfig, params, cache: CacheConfig, *, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, seed: int = 0, mesh=None, host_attn=None,
                 mixed_row_buckets: bool | None = None):
        # mixed steps: one row count (fewer programs; on the GPU padding rows cost little: benchmarks/RESULTS.md)
        # or bucketed rows (default on the CPU, whose reference prefill path pays for every padding row)
        self.mixed_row_buckets = jax.default_backend() == "cpu" if mixed_row_buckets is None else mixed_row_buckets
        self.host_attn = host_attn  # offloaded attention (`jhybrid.engine.offload.HostAttention`) or None
        self.mesh = mesh if parallel.num_shards(mesh) > 1 else None
        if self.mesh is not None:
            params = parallel.shard_params(cfg, params, self.mesh)
        self.cfg, self.params, self.cache = cfg, params, cache
        # prefix-cache snapshots folded into the step programs (`STEP_SNAPSHOT_SHARE`), read once: the programs'
        # shapes depend on it
        self.step_snapshot_share = STEP_SNAPSHOT_SHARE if cache.num_snapshot_slots else 0.0
        self._folded = 0  # the snapshot pairs the step just dispatched took in
        self._state = init_state(cfg, cache) if self.mesh is None else parallel.init_sharded_state(cfg, cache, self.mesh)
        self.max_blocks = -(-max_model_len // cache.block_size)
        self.max_model_len = max_model_len
        self.max_rows = _pow2(max_num_seqs, 1 if SMALL_ENGINE_ROWS else MIN_ROWS)
        self.max_tokens_bucket = _pow2(max(max_num_batched_tokens, self.max_rows + 1), MIN_MIXED_TOKENS)
        self.seed = seed
        # the previous step's output when there is none (compiled programs take it wherever it lives)
        self._no_prev = np.zeros((2, self.max_rows), np.int32)
        # block table of the sequence in each state slot, kept in sync incrementally
        self._tables = np.zeros((cache.num_slots, self.max_blocks), np.int32)
        self._table_len = np.zeros(cache.num_slots, np.int64)
        self._table_owner: list[tuple[int, int] | None] = [None] * cache.num_slots
        # per-slot sampling tables and token history (device) and the sequence each slot's rows belong to
        self.slot_tables = SlotTableKeeper(cache.num_slots, cfg.vocab_size, self.max_rows, self._replicate)
        # compiled step programs by (decode, num_tokens, num_rows); see the module docstring
        self._programs: dict[tuple[bool, int, int], jax.stages.Compiled] = {}
        # On the GPU step program calls run on a thread of their own: a call holds the host while XLA launches
        # (and updates) the step's CUDA graph, with the GIL released, and the engine reads the previous step
        # and schedules the next one in that time (benchmarks/RESULTS.md, "Session 15"). On the CPU the thread
        # only adds hand-offs (the test suite ran ~6% slower with it); JHYBRID_DISPATCH_THREAD=1 / 0 forces it.
        forced = os.environ.get("JHYBRID_DISPATCH_THREAD")
        self.dispatch_thread = forced != "0" if forced else jax.default_backend() == "gpu"
        self._pool: ThreadPoolExecutor | None = None
        self._pending = None  # the Future of the call in flight on the dispatch thread
        self.sealed = False
        self.num_compiled = 0
        self.compile_seconds = 0.0  # lowering included
        self.dispatch_seconds = 0.0  # host time inside the step programs' calls (`LLMEngine.stats`)
        # a list to trace every program call into (benchmarks/step_trace.py), one CallRecord per call
        self.call_log: list[CallRecord] | None = None
        # XLA options for the step programs compiled from now on (`Lowered.compile(compiler_options)`, e.g.
        # {"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"}): benchmarks/compile_options.py compares them
        self.compiler_options = default_compiler_options(jax.default_backend())
        # step programs found on disk without tracing (jhybrid/engine/program_cache.py): on where
        # `enable_compilation_cache` was called before this engine was built, on one GPU (XLA:CPU crashes running
        # the second of two step executables deserialised in one process)
        from jhybrid.engine import compilation

        self.program_cache = None
        if compilation.program_cache_dir is not None and self.mesh is None and jax.default_backend() == "gpu":
            from jhybrid.engine.program_cache import ProgramCache

            self.program_cache = ProgramCache(compilation.program_cache_dir)
        self.lower_seconds = 0.0
        # seconds XLA took for each step program `compile_all` compiled (on its thread; loads not included)
        self.compile_times: dict[tuple, float] = {}
        self.num_compiled_after_seal = 0
        self.compiled_shapes: set[tuple] = set()  # every (layout, decode, host layout) a step ran with
        self._all_allowed: dict[int, jax.Array] = {}  # [rows, W] all-ones grammar bitmasks (device), by rows
        # split steps (structured output: `_split_ready`): the engine's reader of a step's tokens into the grammar
        # matchers (`LLMEngine._read_matchers`), the programs by decode bucket, background compiles, counters
        self.read_matchers = None
        self.split_sampling = True
        self._split_programs: dict[tuple[int, int], tuple] = {}
        self._split_compiling: dict[tuple[int, int], Future] = {}
        self.num_split_compiled = 0
        self.num_split_steps = 0
        self.burst_steps = 1  # decode steps a multi-step program runs (the engine's `num_scheduler_steps`)
        # compile a multi-step program on a background thread when first wanted, running plain steps until it is
        # ready (`can_burst`), instead of compiling it on the request path: the offline API's default (`jhybrid.LLM`)
        self.burst_background = False
        self._burst_compiling: dict[tuple, Future] = {}
        self.num_bursts = 0  # multi-step programs dispatched

    def _replicate(self, make):
        """`make()`'s arrays, replicated over the mesh (one device: where JAX puts them)."""
        if self.mesh is None:
            return make()
        from jax.sharding import NamedSharding, PartitionSpec

        return jax.jit(make, out_shardings=NamedSharding(self.mesh, PartitionSpec()))()

    def slot_buckets(self) -> list[int]:
        """The row counts the slot programs are built for: powers of 4 up to `max_rows`, and `max_rows`. A call is
        padded to the next one with the null slot, and a padding row is a real copy of a whole row of linear state,
        so padding every call to `max_rows` made each decode step that takes a snapshot measurably longer
        (benchmarks/RESULTS.md, "Session 20")."""
        sizes, n = [], 1
        while n < self.max_rows:
            sizes.append(n)
            n *= 4
        return sizes + [self.max_rows]

    def _slot_bucket(self, n: int) -> int:
        return next(b for b in self.slot_buckets() if b >= n)

    def zero_slots(self, slots: list[int]) -> None:
        """Zeroes the linear state of `slots` (padded with the null slot to a `slot_buckets` size)."""
        if slots:
            if len(slots) > self.max_rows:
                raise AssertionError(f"{len(slots)} new slots in one step exceed {self.max_rows} rows")
            padded = np.zeros(self._slot_bucket(len(slots)), np.int32)
            padded[: len(slots)] = slots
            self._state_op(zero_slots, padded)

    @staticmethod
    def slots_zeroed_by_step(sched: SchedulerOutput) -> set[int]:
        """The slots that `sched`'s step program zeroes itself before its forward (`ZERO_IN_STEP`): those of its
        rows that start their sequence, in a mixed step (`_execute`'s `decode` false). The engine zeroes the
        step's other new slots with `zero_slots` first."""
        if not ZERO_IN_STEP or (sched.is_decode and not _prompt_logprob_rows(sched.rows)):
            return set()
        return {r.seq.slot for r in sched.rows if r.start == 0}

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copies the linear state of state row `src` into row `dst` for each `(src, dst)` (prefix-cache snapshots
        and restores; padded to a `slot_buckets` size with the null slot onto itself)."""
        for at in range(0, len(pairs), self.max_rows):
            chunk = pairs[at : at + self.max_rows]
            size = self._slot_bucket(len(chunk))
            src, dst = np.zeros(size, np.int32), np.zeros(size, np.int32)
            src[: len(chunk)], dst[: len(chunk)] = zip(*chunk)
            self._state_op(copy_slots, src, dst)

    def _state_op(self, program, *args) -> None:
        """`state = program(state, *args)`. With a dispatch thread the call is queued there behind the step in
        flight, and the engine goes on (a prefix-cache snapshot after a step used to wait here for the step's
        call, then make its own: benchmarks/RESULTS.md, "Session 16"); whatever reads the state next drains it.
        A failed call before it fails it too, so that `drain` raises what the step raised."""
        if not self.dispatch_thread:
            self.state = program(self.state, *args)
            return
        before = self._pending

        queued = time.perf_counter()

        def run():
            if before is not None:
                before.result()
            t0 = time.perf_counter()
            self._state = program(self._state, *args)
            calls = self.call_log  # read once: the engine's thread may turn the log off meanwhile
            if calls is not None:
                calls.append(CallRecord(getattr(program, "__name__", "state_op"), queued, t0, time.perf_counter(), 0.0))

        self._pending = self._dispatcher().submit(run)

    def _sync_table(self, seq) -> None:
        slot, table = seq.slot, seq.block_table
        # a re-admitted sequence has new blocks; an offload removes blocks from the front of the table
        owner = (seq.seq_id, seq.num_preemptions, len(seq.host_blocks))
        if self._table_owner[slot] != owner or self._table_len[slot] > len(table):
            self._table_owner[slot], self._table_len[slot] = owner, 0
        n = self._table_len[slot]
        if n < len(table):
            self._tables[slot, n : len(table)] = table[n:]
            self._table_len[slot] = len(table)

    def buckets(self, decode: bool, num_rows: int, num_tokens: int) -> tuple[int, int]:
        """The (rows, tokens) bucket of a step of `num_rows` rows and `num_tokens` tokens: decode steps bucket
        their rows, mixed steps carry `max_rows` rows (or, with `mixed_row_buckets`, bucket them too) and
        bucket their tokens."""
        rows = min(_pow2(num_rows, MIN_ROWS), self.max_rows)
        if decode:
            return rows, rows
        return rows if self.mixed_row_buckets else self.max_rows, min(_pow2(num_tokens, MIN_MIXED_TOKENS),
                                                                      self.max_tokens_bucket)

    def _fit(self, decode: bool, num_rows: int, num_tokens: int, plp: bool = False) -> tuple[int, int]:
        """Once sealed: the smallest compiled bucket that holds the step (the same bucket when compiled)."""
        if not self.sealed or _key(decode, num_tokens, num_rows, plp) in self._programs:
            return num_rows, num_tokens
        tail = (True,) if plp else ()
        fits = [(t, r) for d, t, r, *p in self._programs
                if d == decode and tuple(p) == tail and t >= num_tokens and r >= num_rows]
        if not fits:
            return num_rows, num_tokens
        num_tokens, num_rows = min(fits)
        return num_rows, num_tokens

    def step_snapshots(self, num_rows: int) -> int:
        """How many snapshot pairs the step program of `num_rows` rows takes in."""
        return step_snapshot_rows(num_rows, self.step_snapshot_share)

    @staticmethod
    def burst_plan(rows) -> SamplerPlan:
        """The sampler plan of a multi-step decode step of `rows` (`SamplerPlan`: the parts some row needs)."""
        return plan_for([r.seq.params for r in rows], [r.seq.flags for r in rows])

    def can_burst(self, rows) -> bool:
        """Whether decode rows `rows` may run as one multi-step program (`Scheduler`'s check, before it commits):
        one device, at most `MULTI_STEP_MAX_ROWS` rows, and the program of their row bucket and sampler plan
        compiled, or to be compiled when first dispatched (unsealed and not `burst_background`). Sealed, a burst
        never compiles on the request path; with `burst_background` a missing program starts compiling on a thread
        of its own (`BURST_COMPILE_THREAD`); either way the rows run plain steps meanwhile."""
        if self.mesh is not None or len(rows) > MULTI_STEP_MAX_ROWS:
            return False
        if not self.sealed and not self.burst_background:
            return True
        num_rows = self.buckets(True, len(rows), len(rows))[0]
        key = _key(True, num_rows, num_rows, False, self.burst_steps, self.burst_plan(rows))
        if key in self._programs:
            return True
        if not self.sealed and max(r.seq.params.max_tokens - r.seq.num_generated for r in rows) >= BACKGROUND_BURST_MIN:
            self._compile_burst_in_background(key)
        return False

    def _compile_burst_in_background(self, key: tuple) -> None:
        """Starts compiling the multi-step program of `key` on a thread of its own (once): traced there from the
        shapes of the step's arguments, read here (the arrays themselves may be donated by the step in flight)."""
        if key in self._burst_compiling:
            return
        (cfg, *arrays), kwargs = self._step_args(*key)
        args = (cfg, *_shapes(arrays))
        cache_key = self._cache_key(key)

        def build():
            t0 = time.perf_counter()
            self._programs[key] = self._compile(engine_step.lower(*args, **kwargs), cache_key, key)
            log.info("compiled the multi-step decode program of %d rows (%s) in the background in %.1f s", key[2],
                     key[-1].name if key[-1] is not None else "-", time.perf_counter() - t0)

        self._burst_compiling[key] = _in_background(BURST_COMPILE_THREAD, build)

    def wait_burst_compiles(self) -> None:
        """Waits for the multi-step programs compiling in the background (raises what a compile raised)."""
        for future in list(self._burst_compiling.values()):
            future.result()

    def burst_grid(self, max_num_seqs: int) -> list[tuple]:
        """The multi-step decode programs `warmup` builds: each decode row bucket of at most `MULTI_STEP_MAX_ROWS`
        rows, for greedy steps and for steps with sampling rows (`WARM_BURST_PLANS`); none when `burst_steps` is 1.
        Other plans compile on first use until the runner is sealed; then their steps run one token at a time."""
        if self.burst_steps <= 1 or self.mesh is not None:
            return []
        buckets = sorted({self.buckets(True, n, n)[0] for n in range(1, min(max_num_seqs, MULTI_STEP_MAX_ROWS) + 1)})
        return [_key(True, r, r, False, self.burst_steps, plan) for r in buckets for plan in WARM_BURST_PLANS]

    def execute(self, sched: SchedulerOutput, prev: StepResult | None) -> StepResult:
        """Dispatches the step, then the prefix-cache snapshots after it (`sched.snapshots`): the step program takes
        in up to `step_snapshots(rows)` of them, `copy_slots` the rest (and all of them for a split step or one
        with host-KV rows)."""
        self._folded = 0
        result = self._execute(sched, prev)
        if len(sched.snapshots) > self._folded:
            self.copy_slots(sched.snapshots[self._folded :])
        return result

    def _execute(self, sched: SchedulerOutput, prev: StepResult | None) -> StepResult:
        rows = sched.rows
        num_real = len(rows)
        plp_wanted = _prompt_logprob_rows(rows)
        plp = bool(plp_wanted)
        decode = sched.is_decode and not plp  # a one-token prompt chunk that wants prompt logprobs: a mixed step
        num_rows, num_tokens = self.buckets(decode, num_real, sched.num_tokens)
        if plp:  # prompt-logprob programs: one per token bucket (all rows)
            num_rows = self.max_rows
        host_step = self.host_attn is not None and any(r.seq.host_blocks for r in rows)
        if host_step:
            # steps with host-KV rows compile per engine: mixed steps take one shape; decode steps keep
            # their row buckets (the pipeline's halves are the bucket's halves)
            if decode and self.host_attn.overlap:
                _spread_host_rows(rows, num_rows // 2)
            elif not decode:
                num_rows, num_tokens = self.max_rows, self.max_tokens_bucket
        else:
            num_rows, num_tokens = self._fit(decode, num_rows, num_tokens, plp)
        bs, m = self.cache.block_size, self.max_blocks
        # each row of the previous step: its index there and the tokens it sampled (a burst's row: several)
        prev_row = {r.seq.seq_id: (i, r.steps) for i, r in enumerate(prev.sched.rows)} if prev is not None else {}
        burst = sched.burst
        if burst > 1 and (not decode or host_step or self.mesh is not None):
            raise AssertionError("a multi-step decode step must be a decode step on one device, without host KV")
        steps = np.zeros(num_rows, np.int32)

        lengths = np.zeros(num_rows, np.int64)
        starts = np.zeros(num_rows, np.int64)
        slots = np.zeros(num_rows, np.int32)
        token_src = np.full(num_rows, -1, np.int32)
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        # [B, 6]: flags, prompt length, min_p, presence, frequency, repetition penalty (floats bit-cast below)
        extra = np.zeros((num_rows, 6), np.float32)
        extra[:, 5] = 1.0
        recent = np.full((num_rows, MAX_BAN_TOKENS - 1), -2, np.int32)
        seeds = np.zeros(num_rows, np.uint32)
        host_offsets = np.zeros(num_rows, np.int64)  # tokens of each row held in the host tier
        host_rows: list[int] = []
        pieces = []
        for i, r in enumerate(rows):
            seq, p = r.seq, r.seq.params
            self._sync_table(seq)
            end, known = r.start + r.num_tokens, len(seq.token_ids)
            if end > known:  # the last token is pending on the device: the previous step sampled it (its last)
                src, sampled = prev_row.get(seq.seq_id, (-1, 0))
                if end - known != sampled:
                    raise AssertionError(f"{seq}: row [{r.start}, {end}) needs tokens the last step did not sample")
                token_src[i] = src
                pieces.append(seq.token_ids[r.start : known] + [0])  # placeholder, replaced on the device
            else:
                pieces.append(seq.token_ids[r.start : end])
            lengths[i], starts[i], slots[i], steps[i] = r.num_tokens, r.start, seq.slot, r.steps
            temperature[i], top_k[i], top_p[i] = p.temperature, max(p.top_k, 0), p.top_p
            if seq.flags or p.min_p:
                extra[i] = (seq.flags, len(seq.prompt_ids), p.min_p, p.presence_penalty, p.frequency_penalty,
                            p.repetition_penalty)
                if seq.ban_window:
                    recent_window(seq, end, known, recent[i])
            seeds[i] = self._seed(seq)
            if seq.host_blocks:
                if r.num_tokens != 1:
                    raise AssertionError(f"{seq}: a row with host KV must be a decode row")
                host_offsets[i] = len(seq.host_blocks) * bs
                host_rows.append(i)
        total = int(lengths.sum())
        cu = np.zeros(num_rows + 1, np.int64)
        np.cumsum(lengths, out=cu[1:])
        token_ids = np.zeros(num_tokens, np.int32)
        token_ids[:total] = np.fromiter(itertools.chain.from_iterable(pieces), np.int32, total)
        token_seq = np.full(num_tokens, max(num_real - 1, 0), np.int64)
        token_seq[:total] = np.repeat(np.arange(num_rows), lengths)
        positions = np.zeros(num_tokens, np.int64)
        positions[:total] = np.arange(total) - np.repeat(cu[:-1] - starts, lengths)
        tables = self._tables[slots]  # [B, M]; padding rows read slot 0's row: zeros
        tables[num_real:] = 0
        slot_mapping = np.arange(num_tokens) % bs  # padding tokens -> page 0 (the null page)
        device_pos = positions[:total] - host_offsets[token_seq[:total]]  # the table starts after the host blocks
        slot_mapping[:total] = tables[token_seq[:total], device_pos // bs] * bs + positions[:total] % bs
        counters = (starts + lengths).astype(np.int32)
        fields = dict(
            token_ids=token_ids, positions=positions, token_seq=token_seq, slot_mapping=slot_mapping, cu_seqlens=cu,
            block_tables=tables, slot_ids=slots, logits_index=np.maximum(cu[1:] - 1, 0), token_src=token_src,
            temperature=temperature.view(np.int32), top_k=top_k, top_p=top_p.view(np.int32),
            seeds=seeds.view(np.int32), counters=counters, host_offsets=host_offsets,
        )
        want_logprobs = np.zeros(num_rows, np.int32)
        want_logprobs[:num_real] = [r.seq.params.logprobs is not None for r in rows]
        fields["want_logprobs"] = want_logprobs
        fields.update(flags=extra[:, 0].astype(np.int32), prompt_len=extra[:, 1].astype(np.int32),
                      min_p=extra[:, 2].view(np.int32), presence_penalty=extra[:, 3].view(np.int32),
                      frequency_penalty=extra[:, 4].view(np.int32), repetition_penalty=extra[:, 5].view(np.int32),
                      recent=recent, steps=steps)
        meta = np.concatenate([np.asarray(fields[name], np.int32).ravel() for name, _ in _FIELDS])
        masked = [i for i, r in enumerate(rows) if r.samples and r.seq.matcher is not None]
        waits = any(token_src[i] >= 0 for i in masked)  # a mask needs a token the host has not read yet
        split = waits and not plp and not host_step and self._split_ready(decode, num_tokens, num_rows)
        if waits and not split:  # the masks are filled now, from the previous step's tokens
            if self.read_matchers is None or prev is None:
                raise AssertionError("a grammar row's last token is on the device and nothing reads it")
            self.read_matchers(prev)
        token_mask = None if split else self._token_mask(rows, masked, num_rows)
        t_drain = time.perf_counter()
        self.drain()  # the previous call has returned: its state, history and outputs are ours to pass on
        drain_wait = time.perf_counter() - t_drain
        keeper = self.slot_tables
        keeper.sync(rows)
        if self.host_attn is not None:
            stats = self.host_attn.stats
            stats.num_steps_host += bool(host_rows)
            stats.num_steps_plain += not host_rows
        prev_out = prev.out if prev is not None else self._no_prev
        layout = (num_tokens, num_rows, m)
        plp_args, plp_rows = {}, ()
        if plp:
            plp_meta = np.full(num_tokens + 1, -1, np.int32)  # each packed token's next prompt token, or -1
            plp_rows = tuple((rows[i].seq, lo + 1, int(cu[i]) + lo - rows[i].start, hi - lo) for i, lo, hi in plp_wanted)
            for seq, first, at, n in plp_rows:
                plp_meta[at : at + n] = seq.prompt_ids[first : first + n]
            plp_meta[num_tokens] = any(seq.params.prompt_logprobs for seq, *_ in plp_rows)
            plp_args = dict(plp_meta=plp_meta)
        if host_step:
            statics = dict(layout=layout, decode=decode, max_rows=self.max_rows, mesh=self.mesh)
            host_meta, stage, statics["host_layout"] = self._host_part(rows, host_rows, num_rows)
            self.compiled_shapes.add((layout, decode, statics["host_layout"]))
            out, top_lp, top_ids, self.state, keeper.history, *plp_out = engine_step(
                self.cfg, self.params, self.state, meta, prev_out, keeper.tables, keeper.history, host_meta, stage,
                **plp_args, token_mask=token_mask, **statics, host_attn=self.host_attn)
        else:
            self.compiled_shapes.add((layout, decode, None))
            if split:
                return self._dispatch_forward(sched, masked, layout, meta, prev_out, want_logprobs.any())
            plan = self.burst_plan(rows) if burst > 1 else None
            self.num_bursts += burst > 1
            program = self._program(decode, num_tokens, num_rows, plp, burst, plan)
            snaps = self.step_snapshots(num_rows)
            if snaps:  # the first `snaps` snapshot pairs ride in the metadata; padding: a destination past the rows
                pairs = np.full((2, snaps), self.cache.num_state_rows, np.int32)
                pairs[0] = 0
                taken = sched.snapshots[:snaps]
                if taken:
                    pairs[:, : len(taken)] = np.array(taken, np.int32).T
                meta = np.concatenate([meta, pairs.ravel()])
                self._folded = len(taken)
            args = (self.params, self._state, meta, prev_out, keeper.tables, keeper.history)
            kwargs = dict(plp_args, token_mask=token_mask)
            name = f"{'decode' if decode else 'mixed'}:{num_tokens}:{num_rows}{':plp' if plp else ''}"
            if burst > 1:
                name += f":x{burst}:{plan.name}"
            trace = (name, time.perf_counter(), drain_wait) if self.call_log is not None else None
            if self.dispatch_thread:
                self._pending = self._dispatcher().submit(self._call, program, args, kwargs, trace)
                return StepResult(sched, None, plp_rows, bool(want_logprobs.any()), self._pending, num_rows=num_rows)
            out, top_lp, top_ids, plp_out = self._call(program, args, kwargs, trace)
        return StepResult(sched, (out, top_lp, top_ids, plp_out), plp_rows, bool(want_logprobs.any()),
                          num_rows=num_rows)

    def _call(self, program, args: tuple, kwargs: dict, trace: tuple | None = None):
        """Calls a step program and takes its state and token history as the runner's (on the dispatch thread
        when there is one). `trace`: (name, queued at, drain wait) for `call_log`."""
        t0 = time.perf_counter()
        out, top_lp, top_ids, self._state, self.slot_tables.history, *plp_out = program(*args, **kwargs)
        t1 = time.perf_counter()
        self.dispatch_seconds += t1 - t0
        calls = self.call_log  # read once: the engine's thread may turn the log off meanwhile
        if trace is not None and calls is not None:
            calls.append(CallRecord(trace[0], trace[1], t0, t1, trace[2]))
        return out, top_lp, top_ids, plp_out

    def _dispatcher(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="jhybrid-dispatch")
            weakref.finalize(self, self._pool.shutdown, wait=False)
        return self._pool

    def drain(self) -> None:
        """Waits until the step program call in flight on the dispatch thread has returned (not for the device:
        the call returns once the step is queued there), so the state it produced is the runner's; raises what
        the call raised. Everything that reads or replaces the state goes through `state`, which drains."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @property
    def state(self) -> HybridState:
        self.drain()
        return self._state

    @state.setter
    def state(self, value: HybridState) -> None:
        self.drain()
        self._state = value

    def _token_mask(self, rows, masked: list[int], num_rows: int):
        """The step's grammar bitmask `[num_rows, ceil(V/32)]`: the rows in `masked` (they sample under a grammar)
        get their matcher's mask, filled on the host; a step without such rows passes a cached all-ones device
        array (nothing to send). A row whose sequence finished or whose grammar ended or refused its last token
        keeps all tokens (the host drops what it samples). Each matcher must have taken every output token
        before the row's: the previous step's tokens too, read by `read_matchers` or by the engine's read."""
        if not masked:
            mask = self._all_allowed.get(num_rows)
            if mask is None:
                width = bitmask_width(self.cfg.vocab_size)
                ones = np.full((num_rows, width), -1, np.int32)
                # one transfer, no program (over a mesh: replicated by a small jitted copy, made at warm-up)
                mask = jax.device_put(ones) if self.mesh is None else self._replicate(lambda: jnp.asarray(ones))
                self._all_allowed[num_rows] = mask
            return mask
        spec = []
        for i in masked:
            r = rows[i]
            matcher = r.seq.matcher
            if r.seq.is_finished or matcher is None or matcher.terminated or matcher.rejected:
                continue
            num_output = r.start + r.num_tokens - len(r.seq.prompt_ids)  # output tokens before the one sampled
            if matcher.num_accepted != num_output:
                raise AssertionError(f"{r.seq}: its grammar took {matcher.num_accepted} tokens, the row samples "
                                     f"after {num_output}")
            spec.append((i, matcher, num_output < r.seq.params.min_tokens))
        mask = new_bitmask(num_rows, self.cfg.vocab_size)
        if spec:
            fill_bitmask(mask, spec)
        return mask

    # ----------------------------------------------------------------- split steps
    def _split_ready(self, decode: bool, num_tokens: int, num_rows: int) -> bool:
        """Whether the step of this bucket can run split (forward, then sampling once its masks are filled): on
        one device, for decode buckets. Unsealed, the two programs compile here; sealed (a server), a missing
        pair compiles on a background thread (named `SPLIT_COMPILE_THREAD`, so `CompileWatch` counts it apart)
        while the steps of this bucket fill their masks before the forward, as every step did before."""
        if not self.split_sampling or self.mesh is not None or not decode:
            return False
        key = (num_tokens, num_rows)
        if key in self._split_programs:
            return True
        if not self.sealed:
            self._split_programs[key] = self._compile_split(key)
            return True
        if key not in self._split_compiling:
            specs = self._split_specs()

            def build():
                self._split_programs[key] = self._compile_split(key, specs)

            self._split_compiling[key] = _in_background(SPLIT_COMPILE_THREAD, build)
        return False

    def wait_split_compiles(self) -> None:
        """Waits for the split programs compiling in the background (raises what a compile raised)."""
        for future in list(self._split_compiling.values()):
            future.result()

    def _split_specs(self):
        """Shapes of the state, the token history and the sampling tables (read on the engine's
        thread; a background compile must not touch arrays the dispatch thread may be donating)."""
        keeper = self.slot_tables
        return _shapes((self.state, keeper.history, keeper.tables))

    def _compile_split(self, key: tuple[int, int], specs=None):
        """(engine_forward, engine_sample) compiled for decode bucket `key` = (num_tokens, num_rows)."""
        num_tokens, num_rows = key
        state, history, tables = specs if specs is not None else self._split_specs()
        layout = (num_tokens, num_rows, self.max_blocks)
        t0 = time.perf_counter()
        meta = jax.ShapeDtypeStruct((meta_size(layout),), jnp.int32)
        forward_low = engine_forward.lower(self.cfg, self.params, state, meta, self._no_prev, history, layout=layout,
                                           decode=True)
        logits, sampling = forward_low.out_info[:2]
        mask = jax.ShapeDtypeStruct((num_rows, bitmask_width(self.cfg.vocab_size)), jnp.int32)
        sample_low = engine_sample.lower(logits, sampling, tables, history, mask, max_rows=self.max_rows)
        options = self._options((True, num_tokens, num_rows))
        programs = forward_low.compile(options), sample_low.compile(options)
        self.num_split_compiled += 1
        log.info("compiled the split programs of decode:%d:%d (structured output) in %.1f s", num_tokens, num_rows,
                 time.perf_counter() - t0)
        return programs

    def _dispatch_forward(self, sched: SchedulerOutput, masked: list[int], layout: tuple, meta: np.ndarray, prev_out,
                          want_logprobs) -> StepResult:
        """Dispatches a split step's forward; `sample_split` dispatches its sampling."""
        num_tokens, num_rows, _ = layout
        forward, sample = self._split_programs[(num_tokens, num_rows)]
        keeper = self.slot_tables
        args = (self.params, self._state, meta, prev_out, keeper.history)
        self.num_split_steps += 1

        def call():
            t0 = time.perf_counter()
            logits, sampling, self._state, keeper.history = forward(*args)
            self.dispatch_seconds += time.perf_counter() - t0
            return logits, sampling, keeper.history

        if self.dispatch_thread:
            outputs = self._pending = self._dispatcher().submit(call)
        else:
            outputs = call()
        split = SplitStep(masked, num_rows, keeper.tables, sample, outputs)
        return StepResult(sched, None, (), bool(want_logprobs), None, split)

    def sample_split(self, result: StepResult) -> None:
        """Fills the grammar masks of a split step (its rows' matchers have now taken the previous step's tokens)
        and dispatches its sampling; on the GPU the forward runs meanwhile."""
        split = result.split
        mask = self._token_mask(result.sched.rows, split.masked, split.num_rows)
        before = self._pending

        def call():
            if before is not None:
                before.result()  # a failure of the forward (or of a state program behind it) is this step's
            t0 = time.perf_counter()
            logits, sampling, history = split.forward.result() if isinstance(split.forward, Future) else split.forward
            out = split.program(logits, sampling, split.tables, history, mask)
            self.dispatch_seconds += time.perf_counter() - t0
            return (*out, ())

        if self.dispatch_thread:
            result._pending = self._pending = self._dispatcher().submit(call)
        else:
            result._outputs = call()

    # ----------------------------------------------------------------- programs
    def _step_args(self, decode: bool, num_tokens: int, num_rows: int, plp: bool = False, burst: int = 1,
                   plan: SamplerPlan | None = None):
        """engine_step's arguments for the program of key `_key(decode, num_tokens, num_rows, plp, burst, plan)`:
        (args, kwargs)."""
        layout = (num_tokens, num_rows, self.max_blocks)
        snaps = self.step_snapshots(num_rows)
        meta = jax.ShapeDtypeStruct((meta_size(layout, snaps),), jnp.int32)
        extra = dict(plp_meta=jax.ShapeDtypeStruct((num_tokens + 1,), jnp.int32)) if plp else {}
        extra["token_mask"] = jax.ShapeDtypeStruct((num_rows, bitmask_width(self.cfg.vocab_size)), jnp.int32)
        if burst > 1:
            extra.update(burst=burst, plan=plan, block_size=self.cache.block_size)
        return ((self.cfg, self.params, self.state, meta, self._no_prev, self.slot_tables.tables,
                 self.slot_tables.history),
                dict(**extra, layout=layout, decode=decode, max_rows=self.max_rows, mesh=self.mesh, snaps=snaps))

    def _lower(self, *key):
        args, kwargs = self._step_args(*key)
        return engine_step.lower(*args, **kwargs)

    def _cache_key(self, key: tuple) -> str | None:
        """The step-program cache's key of bucket `key` (None: no cache)."""
        if self.program_cache is None:
            return None
        (cfg, *args), kwargs = self._step_args(*key)
        arrays = {k: kwargs.pop(k) for k in ("plp_meta", "token_mask") if k in kwargs}  # the rest is static
        static = (repr(cfg), repr(sorted(kwargs.items())), repr(sorted((self._options(key) or {}).items())))
        return self.program_cache.key(static, (args, arrays))

    def _cached(self, key: tuple):
        """(the program of bucket `key` from the step-program cache or None, its cache key or None)."""
        cache_key = self._cache_key(key)
        return (None if cache_key is None else self.program_cache.load(cache_key)), cache_key

    def _options(self, key: tuple) -> dict | None:
        """The XLA options of the program of bucket `key` (`program_compiler_options`)."""
        return program_compiler_options(self.compiler_options, key[0], key[2])

    def _compile(self, low, cache_key: str | None, key: tuple):
        program = low.compile(self._options(key))
        if cache_key is not None:
            self.program_cache.store(cache_key, program)
        return program

    def _program(self, decode: bool, num_tokens: int, num_rows: int, plp: bool = False, burst: int = 1,
                 plan: SamplerPlan | None = None):
        key = _key(decode, num_tokens, num_rows, plp, burst, plan)
        program = self._programs.get(key)
        if program is None:
            if self.sealed:
                self.num_compiled_after_seal += 1
                log.warning("compiling a step program on the request path: decode=%s tokens=%d rows=%d prompt "
                            "logprobs=%s steps=%d", decode, num_tokens, num_rows, plp, burst)
            t0 = time.perf_counter()
            program, cache_key = self._cached(key)
            if program is None:
                program = self._compile(self._lower(*key), cache_key, key)
            self._programs[key] = program
            self.num_compiled += 1
            self.compile_seconds += time.perf_counter() - t0
            freeze_startup_heap("step program compiled", collect=False)  # jax's new cache entries: heap.py
        return program

    def program_grid(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[bool, int, int]]:
        """Every (decode, num_tokens, num_rows) bucket `execute` can meet with these limits (no host-KV rows)."""
        grid = {self.buckets(True, n, n)[::-1] for n in range(1, max_num_seqs + 1)}
        grid = {(True, t, r) for t, r in grid}
        # a mixed step has a row of two or more tokens, and each row fewer than max_model_len
        for n in range(1, max_num_seqs + 1) if self.mixed_row_buckets else (1,):
            rows = n if self.mixed_row_buckets else max_num_seqs  # the most rows that share the tokens
            most = min(max_num_batched_tokens, rows * (self.max_model_len - 1))
            for t in range(n + 1, most + 1):
                rows, tokens = self.buckets(False, n, t)
                grid.add((False, tokens, rows))
        return sorted(grid)

    def prompt_logprob_grid(self, max_num_batched_tokens: int) -> list[tuple[bool, int, int, bool]]:
        """The programs of steps with rows that want prompt log-probabilities: mixed steps of all `max_rows`
        rows (keys `(False, num_tokens, max_rows, True)`) in the smallest and the largest token bucket only. Each
        program costs about a second of cached start-up (a few cold) and only requests that ask for prompt
        logprobs use them, so the buckets between are not built: a step between runs in the largest."""
        most = self.buckets(False, self.max_rows, max_num_batched_tokens)[1]
        least = self.buckets(False, 1, 2)[1]
        return [(False, t, self.max_rows, True) for t in sorted({least, most})]

    def compile_all(self, grid: list[tuple[bool, int, int]], *, threads: int | None = None, progress=None) -> int:
        """Compiles the programs of `grid` not compiled yet: traced here one by one (tracing holds the GIL), each
        handed to XLA on one of `threads` threads (default: one per CPU core, at most 8) as soon as it is traced,
        so that tracing the next overlaps compiling the last; the largest token buckets first, so that the
        longest compiles do not come last. Returns how many it compiled."""
        todo = sorted((key for key in grid if key not in self._programs), key=lambda key: -key[1])
        if not todo:
            return 0
        threads = threads or max(1, min(8, os.cpu_count() or 1, len(todo)))
        t0 = time.perf_counter()

        def build(key, low, cache_key):
            t1 = time.perf_counter()
            program = self._compile(low, cache_key, key)
            self.compile_times[key] = time.perf_counter() - t1
            return key, program

        def load(key):
            return key, self.program_cache.load(cache_keys[key])

        cache_keys = {key: self._cache_key(key) for key in todo}
        with ThreadPoolExecutor(threads, thread_name_prefix="jhybrid-compile") as pool:
            futures = []
            if self.program_cache is not None:  # found on disk: no tracing (jhybrid/engine/program_cache.py)
                for future in as_completed([pool.submit(load, key) for key in todo]):
                    key, program = future.result()
                    if program is not None:
                        self._programs[key] = program
                        if progress is not None:
                            progress(key)
            for key in [k for k in todo if k not in self._programs]:
                # a trace that raises leaves the pool's exit to wait for the compiles in flight
                t1 = time.perf_counter()
                low = self._lower(*key)
                self.lower_seconds += time.perf_counter() - t1
                futures.append(pool.submit(build, key, low, cache_keys[key]))
            for future in as_completed(futures):
                key, program = future.result()
                self._programs[key] = program
                if progress is not None:
                    progress(key)
        self.num_compiled += len(todo)
        self.compile_seconds += time.perf_counter() - t0
        return len(todo)

    def seal(self) -> None:
        """From now on a step takes the smallest compiled bucket that holds it rather than compiling."""
        self.sealed = True

    def _host_part(self, rows, host_rows: list[int], num_rows: int):
        """The host-KV rows' metadata: "cpu": their host block tables registered with the `HostAttention`
        (the callbacks look them up by step id); "copy": the staging arrays and the tables into them."""
        attn = self.host_attn
        tables = {i: rows[i].seq.host_blocks for i in host_rows}
        width = max(len(t) for t in tables.values())
        attn.stats.num_host_rows += len(host_rows)
        attn.stats.host_tokens_attended += sum(len(t) for t in tables.values()) * self.cache.block_size
        if attn.mode == "cpu":
            table = np.zeros((num_rows, width), np.int32)
            for i, t in tables.items():
                table[i, : len(t)] = t
            return np.asarray([attn.register_step(table)], np.int32), None, (0,)
        mh = self.max_blocks  # fixed: one compile per staging size only (the kernel reads up to each row's length)
        table = np.zeros((num_rows, mh), np.int32)
        ordered = [tables[i] for i in host_rows]
        stage = attn.stage(ordered)
        first = 1  # staging block 0 is the zero page
        for i, t in zip(host_rows, ordered):
            table[i, : len(t)] = np.arange(first, first + len(t))
            first += len(t)
        return table.ravel(), stage, (mh,)

    def warm(self, key: tuple) -> None:
        """Runs the program of bucket `key` once on dummy rows that write only the null slot and the null
        page (which padding rows write anyway), so that its first real step pays no one-time start-up cost.
        Waits for it."""
        from jhybrid.engine.scheduler import ScheduledRow
        from jhybrid.engine.sequence import Sequence

        decode, num_tokens, num_rows, *rest = key
        plp = bool(rest) and rest[0]
        burst, plan = rest[1:] if len(rest) > 1 else (1, None)
        bs = self.cache.block_size
        if decode:
            sizes = [1] * num_rows
        else:  # as many tokens as the bucket holds, in rows that each fit a sequence
            num_real = min(num_rows, -(-num_tokens // (self.max_model_len - 1)))
            if self.mixed_row_buckets:  # enough rows to reach the row bucket
                num_real = max(num_real, num_rows // 2 + 1 if num_rows > MIN_ROWS else 1)
            tokens = max(num_real + 1, min(num_tokens, num_real * (self.max_model_len - 1)))
            sizes = [tokens // num_real + (i < tokens % num_real) for i in range(num_real)]
        rows = []
        for i, k in enumerate(sizes):
            length = k + 1 if decode else k  # decode: one known token before the fed one
            params = SamplingParams(temperature=0.0, prompt_logprobs=1 if plp else None)
            if burst > 1 and i == 0:  # the first row asks for what the plan runs
                params = SamplingParams(temperature=1.0 if plan.draw else 0.0, top_k=2 if plan.filtered else 0,
                                        logprobs=1 if plan.top else None, seed=0)
            seq = Sequence(f"warmup-{i}", [0] * length, params)
            seq.block_table = [0] * -(-(length + burst) // bs)  # the null page; slot 0 is the null slot
            rows.append(ScheduledRow(seq, length - k, k, True, burst))
        if burst > 1 and self.burst_plan(rows) != plan:
            raise ValueError(f"cannot warm a multi-step program of plan {plan}: only its sampling parts without "
                             "per-slot tables (draw, filtered, top)")
        self.execute(SchedulerOutput(rows, [], [], burst=burst), None).fetch()
        self._tables[0], self._table_len[0], self._table_owner[0] = 0, 0, None  # the null slot's row stays zeros

    def warm_slot_programs(self) -> None:
        """Compiles (and runs, on the null slot only) the slot-zeroing and sampling-table programs, and returns
        once they have: with the dispatch thread the slot programs are queued there (`_state_op`), and their
        compile would otherwise finish after the engine reports ready (on the H200 it did: benchmarks/RESULTS.md,
        "Session 20")."""
        self.drain()  # the sampling tables and token history are the last call's outputs
        for size in self.slot_buckets():
            self.zero_slots([0] * size)
            if self.cache.num_snapshot_slots:
                self.copy_slots([(0, 0)] * size)
        self.slot_tables.warm()
        self.drain()

    def _seed(self, seq) -> int:
        if seq.params.seed is not None:
            return seq.params.seed
        return (self.seed * 1_000_003 + seq.seq_id * 7919) % 2**32


class CallRecord(NamedTuple):
    """One program call as `ModelRunner.call_log` records it: the program (`decode:T:R`, `mixed:T:R`, or a state
    op's name), perf_counter seconds when it was queued, when the call began (after the call before it) and when
    it returned (the step is then queued on the device, not run); for a step, the seconds the engine waited for
    the call before it to return first."""

    program: str
    queued: float
    started: float
    returned: float
    drain_wait: float


def _key(decode: bool, num_tokens: int, num_rows: int, plp: bool = False, burst: int = 1,
         plan: SamplerPlan | None = None) -> tuple:
    """A program's key: `(decode, num_tokens, num_rows)`, with a fourth item True for a prompt-logprob program,
    and `(decode, num_tokens, num_rows, False, burst, plan)` for a multi-step decode program."""
    if burst > 1:
        return (decode, num_tokens, num_rows, False, burst, plan)
    return (decode, num_tokens, num_rows, True) if plp else (decode, num_tokens, num_rows)


def _prompt_logprob_rows(rows) -> list[tuple[int, int, int]]:
    """(row index, lo, hi) of the rows that want prompt log-probabilities this step: the row's positions
    `[lo, hi)` predict prompt tokens `lo + 1 .. hi` not read yet (a recomputed prompt's are read already)."""
    out = []
    for i, r in enumerate(rows):
        got = r.seq.prompt_logprobs
        if got is None:
            continue
        lo, hi = r.start, min(r.start + r.num_tokens, len(r.seq.prompt_ids) - 1)
        while lo < hi and got[lo + 1] is not None:
            lo += 1
        if lo < hi:
            out.append((i, lo, hi))
    return out


def _spread_host_rows(rows: list, half: int) -> None:
    """Reorders a decode step's rows (in place: the step's result follows `sched.rows`) so that rows with
    host KV alternate between the pipeline's halves `[0, half)` and `[half, ...)`."""
    host = [r for r in rows if r.seq.host_blocks]
    if not host or len(rows) <= half:
        return
    plain = [r for r in rows if not r.seq.host_blocks]
    first = host[0::2]
    second = host[1::2]
    num_first = half - len(first)
    if num_first < 0:  # more host rows than the first half holds
        first, second = host[:half], host[half:]
        num_first = 0
    rows[:] = first + plain[:num_first] + second + plain[num_first:]
