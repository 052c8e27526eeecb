"""Turns a scheduled step into arrays and runs the jitted step (forward + sampling) without waiting.

Rows whose last fed token was sampled by the previous step (not yet read on the host) take it from that
step's device output (`token_src`), so step n+1 is dispatched before step n's tokens reach the host.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.cache.state import CacheConfig, HybridState, init_state, zero_slots
from jhybrid.config import ModelConfig
from jhybrid.engine.sampling import MAX_LOGPROBS, SamplingArrays, sample
from jhybrid.engine.scheduler import SchedulerOutput
from jhybrid.models.batch import Batch, RowSpec, make_batch
from jhybrid.models.hybrid import forward


def _pow2(n: int, minimum: int) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "decode", "all_greedy", "filtered", "num_logprobs", "max_rows"),
    donate_argnames=("state",),
)
def engine_step(
    cfg: ModelConfig,
    params,
    state: HybridState,
    batch: Batch,
    prev_tokens: jax.Array,  # [R] the previous step's sampled tokens (padded to R = max_rows)
    token_src: jax.Array,  # [B] row of the previous step whose token is this row's last token, or -1
    sampling: SamplingArrays,
    *,
    decode: bool,
    all_greedy: bool,
    filtered: bool,
    num_logprobs: int,
    max_rows: int,
):
    num_tokens = batch.token_ids.shape[0]
    last = batch.cu_seqlens[1:] - 1
    target = jnp.where(token_src >= 0, last, num_tokens)  # out of range: dropped
    token_ids = batch.token_ids.at[target].set(prev_tokens[jnp.maximum(token_src, 0)], mode="drop")
    batch = dataclasses.replace(batch, token_ids=token_ids)
    logits, state = forward(cfg, params, state, batch, decode=decode)
    tokens, token_logp, top_lp, top_ids = sample(
        logits, sampling, all_greedy=all_greedy, filtered=filtered, num_logprobs=num_logprobs
    )
    padded = jnp.zeros((max_rows,), jnp.int32).at[: tokens.shape[0]].set(tokens)
    return padded, token_logp, top_lp, top_ids, state


@dataclasses.dataclass
class StepResult:
    sched: SchedulerOutput
    tokens: jax.Array  # [R] device
    token_logp: jax.Array
    top_logp: jax.Array | None
    top_ids: jax.Array | None


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, cache: CacheConfig, *, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, seed: int = 0):
        self.cfg, self.params, self.cache = cfg, params, cache
        self.state = init_state(cfg, cache)
        self.max_blocks = -(-max_model_len // cache.block_size)
        self.max_rows = _pow2(max_num_seqs, 1)
        self.max_tokens_bucket = _pow2(max_num_batched_tokens, 16)
        self.seed = seed
        self._no_prev = jnp.zeros((self.max_rows,), jnp.int32)
        self.compiled_shapes: set[tuple] = set()

    def zero_slots(self, slots: list[int]) -> None:
        if slots:
            padded = slots + [0] * (_pow2(len(slots), 4) - len(slots))  # bucketed; slot 0 is the null slot
            self.state = zero_slots(self.state, jnp.asarray(padded, jnp.int32))

    def execute(self, sched: SchedulerOutput, prev: StepResult | None) -> StepResult:
        rows = sched.rows
        prev_row = {id(r.seq): i for i, r in enumerate(prev.sched.rows)} if prev is not None else {}
        specs, src = [], []
        for r in rows:
            seq = r.seq
            known = len(seq.token_ids)  # host-known tokens; position `known` is pending on the device
            end = r.start + r.num_tokens
            ids = seq.token_ids[r.start : min(end, known)]
            if end > known:
                if end != known + 1 or id(seq) not in prev_row:
                    raise AssertionError(f"{seq}: row [{r.start}, {end}) needs tokens the last step did not sample")
                src.append(prev_row[id(seq)])
                ids = ids + [0]  # placeholder, replaced on the device
            else:
                src.append(-1)
            specs.append(RowSpec(ids, r.start, seq.block_table, seq.slot))
        decode = sched.is_decode
        num_rows = min(_pow2(len(rows), 4), self.max_rows)  # len(rows) <= max_num_seqs <= max_rows
        num_tokens = num_rows if decode else min(_pow2(sched.num_tokens, 16), self.max_tokens_bucket)
        batch = make_batch(specs, block_size=self.cache.block_size, max_blocks_per_seq=self.max_blocks,
                           num_tokens=num_tokens, num_rows=num_rows)
        token_src = np.full(num_rows, -1, np.int32)
        token_src[: len(src)] = src
        params = [r.seq.params for r in rows]
        sampling = SamplingArrays(
            temperature=np.array([p.temperature for p in params] + [0.0] * (num_rows - len(rows)), np.float32),
            top_k=np.array([max(p.top_k, 0) for p in params] + [0] * (num_rows - len(rows)), np.int32),
            top_p=np.array([p.top_p for p in params] + [1.0] * (num_rows - len(rows)), np.float32),
            seeds=np.array([self._seed(r.seq) for r in rows] + [0] * (num_rows - len(rows)), np.uint32),
            counters=np.array([r.start + r.num_tokens for r in rows] + [0] * (num_rows - len(rows)), np.int32),
        )
        wants_logprobs = any(p.logprobs is not None for p in params)
        statics = dict(
            decode=decode,
            all_greedy=all(p.greedy for p in params),
            filtered=any(p.filtered for p in params),
            num_logprobs=MAX_LOGPROBS if wants_logprobs else 0,
            max_rows=self.max_rows,
        )
        self.compiled_shapes.add((num_tokens, num_rows, *statics.values()))
        prev_tokens = prev.tokens if prev is not None else self._no_prev
        tokens, token_logp, top_lp, top_ids, self.state = engine_step(
            self.cfg, self.params, self.state, batch, prev_tokens, token_src, sampling, **statics
        )
        return StepResult(sched, tokens, token_logp, top_lp, top_ids)

    def _seed(self, seq) -> int:
        if seq.params.seed is not None:
            return seq.params.seed
        return (self.seed * 1_000_003 + seq.seq_id * 7919) % 2**32
