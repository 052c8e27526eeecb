"""Turns a scheduled step into arrays and runs the jitted step (forward + sampling) without waiting.

Host overhead per step is what bounds small-batch decode, so the runner keeps it small: block tables live
in a persistent NumPy array indexed by state slot (updated only when a sequence gains blocks), the step's
metadata is built with vectorised NumPy and crosses to the device as ONE int32 buffer (unpacked inside
the jitted step), and the sampled tokens with their log-probabilities come back as one array.

Rows whose last fed token was sampled by the previous step (not yet read on the host) take it from that
step's device output (`token_src`), so step n+1 is dispatched before step n's tokens reach the host.

With a tensor-parallel `mesh` (`jhybrid.parallel`) the parameters and the state are sharded over its
devices, the step is jitted with them (XLA SPMD inserts the collectives) and sampling runs on gathered
logits; the outputs are replicated, so every process of a multi-process run reads them locally.
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
from jhybrid.models.batch import Batch
from jhybrid.models.hybrid import forward
from jhybrid import parallel

# the packed metadata: (name, length as a function of T, B, M); float fields travel bit-cast to int32
_FIELDS = (
    ("token_ids", lambda t, b, m: t), ("positions", lambda t, b, m: t), ("token_seq", lambda t, b, m: t),
    ("slot_mapping", lambda t, b, m: t), ("cu_seqlens", lambda t, b, m: b + 1), ("block_tables", lambda t, b, m: b * m),
    ("slot_ids", lambda t, b, m: b), ("logits_index", lambda t, b, m: b), ("token_src", lambda t, b, m: b),
    ("temperature", lambda t, b, m: b), ("top_k", lambda t, b, m: b), ("top_p", lambda t, b, m: b),
    ("seeds", lambda t, b, m: b), ("counters", lambda t, b, m: b), ("host_offsets", lambda t, b, m: b),
)
_FLOAT_FIELDS = ("temperature", "top_p")


def _pow2(n: int, minimum: int) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def _unpack(meta: jax.Array, t: int, b: int, m: int) -> dict[str, jax.Array]:
    out, offset = {}, 0
    for name, size in _FIELDS:
        n = size(t, b, m)
        x = meta[offset : offset + n]
        if name in _FLOAT_FIELDS:
            x = jax.lax.bitcast_convert_type(x, jnp.float32)
        out[name] = x.reshape(b, m) if name == "block_tables" else x
        offset += n
    return out


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "layout", "decode", "all_greedy", "filtered", "num_logprobs", "max_rows", "mesh",
                     "host_layout", "host_attn"),
    donate_argnames=("state",),
)
def engine_step(cfg: ModelConfig, params, state: HybridState, meta: jax.Array, prev_out: jax.Array,
                host_meta: jax.Array | None = None, stage=None, *,
                layout: tuple[int, int, int], decode: bool, all_greedy: bool, filtered: bool, num_logprobs: int,
                max_rows: int, mesh=None, host_layout: tuple[int, int] | None = None, host_attn=None):
    """One step. `meta` is the packed int32 metadata of `layout = (T, B, M)`; `prev_out [2, R]` the previous
    step's output (row 0: its sampled tokens). Returns (`[2, R]` int32: tokens and their bit-cast fp32 logprobs, top logprobs,
    top ids, state).

    Offloaded attention (`host_attn`: the engine's `HostAttention`, static, by identity): `host_layout` is
    None for a step without host-KV rows, `(0,)` for "cpu" (`host_meta [1]`: the step's registered id) and
    `(MH,)` for "copy" (`host_meta [B * MH]`: staging block tables; `stage`: the staging arrays)."""
    f = _unpack(meta, *layout)
    num_tokens = layout[0]
    token_src = f["token_src"]
    target = jnp.where(token_src >= 0, f["cu_seqlens"][1:] - 1, num_tokens)  # out of range: dropped
    token_ids = f["token_ids"].at[target].set(prev_out[0][jnp.maximum(token_src, 0)], mode="drop")
    batch = Batch(token_ids=token_ids, positions=f["positions"], token_seq=f["token_seq"],
                  slot_mapping=f["slot_mapping"], cu_seqlens=f["cu_seqlens"], block_tables=f["block_tables"],
                  slot_ids=f["slot_ids"], logits_index=f["logits_index"])
    sampling = SamplingArrays(temperature=f["temperature"], top_k=f["top_k"], top_p=f["top_p"],
                              seeds=f["seeds"], counters=f["counters"])
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
    else:
        logits, state = forward(cfg, params, state, batch, decode=decode, mesh=mesh, host_attention=host)
    if mesh is not None:  # sample on the gathered logits; keep the state in its shards
        logits, state = parallel.replicated(logits, mesh), parallel.constrain_state(state, cfg, mesh)
    tokens, token_logp, top_lp, top_ids = sample(
        logits, sampling, all_greedy=all_greedy, filtered=filtered, num_logprobs=num_logprobs
    )
    packed = jnp.zeros((2, max_rows), jnp.int32)
    packed = packed.at[0, : tokens.shape[0]].set(tokens)
    packed = packed.at[1, : tokens.shape[0]].set(jax.lax.bitcast_convert_type(token_logp, jnp.int32))
    if mesh is not None:
        packed, top_lp, top_ids = (parallel.replicated(x, mesh) if x is not None else None for x in (packed, top_lp, top_ids))
    return packed, top_lp, top_ids, state


@dataclasses.dataclass
class StepResult:
    sched: SchedulerOutput
    out: jax.Array  # [2, R] device: tokens, bit-cast logprobs
    top_logp: jax.Array | None
    top_ids: jax.Array | None

    def fetch(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
        out = _local(self.out)  # one transfer; waits for this step only
        top_lp = _local(self.top_logp) if self.top_logp is not None else None
        top_ids = _local(self.top_ids) if self.top_ids is not None else None
        return out[0], out[1].view(np.float32), top_lp, top_ids


def _local(x: jax.Array) -> np.ndarray:
    """A replicated output on the host (across processes: this process's copy)."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


class ModelRunner:
    """`mesh`: a tensor-parallel mesh (`jhybrid.parallel.make_mesh`); the packed `params` are then
    re-laid out shard-major and sharded over it, and the state is created in its shards."""

    def __init__(self, cfg: ModelConfig, params, cache: CacheConfig, *, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, seed: int = 0, mesh=None, host_attn=None):
        self.host_attn = host_attn  # offloaded attention (`jhybrid.engine.offload.HostAttention`) or None
        self.mesh = mesh if parallel.num_shards(mesh) > 1 else None
        if self.mesh is not None:
            params = parallel.shard_params(cfg, params, self.mesh)
        self.cfg, self.params, self.cache = cfg, params, cache
        self.state = init_state(cfg, cache) if self.mesh is None else parallel.init_sharded_state(cfg, cache, self.mesh)
        self.max_blocks = -(-max_model_len // cache.block_size)
        self.max_rows = _pow2(max_num_seqs, 1)
        self.max_tokens_bucket = _pow2(max_num_batched_tokens, 16)
        self.seed = seed
        # the previous step's output when there is none; after the first step, zeros placed exactly like the
        # step's outputs (`_settle_no_prev`): JAX keys its cache on where arguments live (NumPy or device,
        # committed or not, their sharding), so a mismatch would compile every bucket twice
        self._no_prev = np.zeros((2, self.max_rows), np.int32)  # NumPy: valid input on any mesh, any process
        if self.mesh is None:
            self._no_prev = jnp.asarray(self._no_prev)  # where outputs usually live on one device
        self._no_prev_settled = False
        # block table of the sequence in each state slot, kept in sync incrementally
        self._tables = np.zeros((cache.num_slots, self.max_blocks), np.int32)
        self._table_len = np.zeros(cache.num_slots, np.int64)
        self._table_owner: list[tuple[int, int] | None] = [None] * cache.num_slots
        self.compiled_shapes: set[tuple] = set()

    def _settle_no_prev(self, out) -> None:
        """Replaces the no-previous-step input by zeros placed like `out` (a step's output), once."""
        self._no_prev_settled = True
        like = jnp.zeros_like(out)
        old = self._no_prev
        if not (isinstance(old, jax.Array) and old.committed == like.committed and old.sharding == like.sharding):
            self._no_prev = like

    def zero_slots(self, slots: list[int]) -> None:
        if slots:
            padded = slots + [0] * (_pow2(len(slots), 4) - len(slots))  # bucketed; slot 0 is the null slot
            self.state = zero_slots(self.state, np.asarray(padded, np.int32))

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

    def execute(self, sched: SchedulerOutput, prev: StepResult | None) -> StepResult:
        rows = sched.rows
        num_real = len(rows)
        decode = sched.is_decode
        num_rows = min(_pow2(num_real, 4), self.max_rows)  # num_real <= max_num_seqs <= max_rows
        num_tokens = num_rows if decode else min(_pow2(sched.num_tokens, 16), self.max_tokens_bucket)
        if self.host_attn is not None and any(r.seq.host_blocks for r in rows):
            # steps with host-KV rows compile per engine: mixed steps take one shape; decode steps keep
            # their row buckets (the pipeline's halves are the bucket's halves)
            if decode and self.host_attn.overlap:
                _spread_host_rows(rows, num_rows // 2)
            elif not decode:
                num_rows, num_tokens = self.max_rows, self.max_tokens_bucket
        bs, m = self.cache.block_size, self.max_blocks
        prev_row = {r.seq.seq_id: i for i, r in enumerate(prev.sched.rows)} if prev is not None else {}

        lengths = np.zeros(num_rows, np.int64)
        starts = np.zeros(num_rows, np.int64)
        slots = np.zeros(num_rows, np.int32)
        token_src = np.full(num_rows, -1, np.int32)
        temperature = np.zeros(num_rows, np.float32)
        top_k = np.zeros(num_rows, np.int32)
        top_p = np.ones(num_rows, np.float32)
        seeds = np.zeros(num_rows, np.uint32)
        host_offsets = np.zeros(num_rows, np.int64)  # tokens of each row held in the host tier
        host_rows: list[int] = []
        pieces = []
        for i, r in enumerate(rows):
            seq, p = r.seq, r.seq.params
            self._sync_table(seq)
            end, known = r.start + r.num_tokens, len(seq.token_ids)
            if end > known:  # the last token is pending on the device: the previous step sampled it
                if end != known + 1 or seq.seq_id not in prev_row:
                    raise AssertionError(f"{seq}: row [{r.start}, {end}) needs tokens the last step did not sample")
                token_src[i] = prev_row[seq.seq_id]
                pieces.append(seq.token_ids[r.start : known] + [0])  # placeholder, replaced on the device
            else:
                pieces.append(seq.token_ids[r.start : end])
            lengths[i], starts[i], slots[i] = r.num_tokens, r.start, seq.slot
            temperature[i], top_k[i], top_p[i] = p.temperature, max(p.top_k, 0), p.top_p
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
        token_ids[:total] = np.fromiter((t for piece in pieces for t in piece), np.int32, total)
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
        meta = np.concatenate([np.asarray(fields[name], np.int32).ravel() for name, _ in _FIELDS])
        params = [r.seq.params for r in rows]
        statics = dict(
            layout=(num_tokens, num_rows, m),
            decode=decode,
            all_greedy=all(p.greedy for p in params),
            filtered=any(p.filtered for p in params),
            num_logprobs=MAX_LOGPROBS if any(p.logprobs is not None for p in params) else 0,
            max_rows=self.max_rows,
            mesh=self.mesh,
        )
        host_meta = stage = None
        if self.host_attn is not None:
            stats = self.host_attn.stats
            stats.num_steps_host += bool(host_rows)
            stats.num_steps_plain += not host_rows
        if host_rows:
            host_meta, stage, statics["host_layout"] = self._host_part(rows, host_rows, num_rows)
            statics["host_attn"] = self.host_attn
        self.compiled_shapes.add(tuple(statics.values()))
        prev_out = prev.out if prev is not None else self._no_prev
        out, top_lp, top_ids, self.state = engine_step(self.cfg, self.params, self.state, meta, prev_out, host_meta,
                                                       stage, **statics)
        if not self._no_prev_settled:
            self._settle_no_prev(out)
        return StepResult(sched, out, top_lp, top_ids)

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

    def step_layouts(self, max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[bool, int, int, int]]:
        """Every (decode, num_rows, num_tokens) bucket `execute` can meet with these limits, with the fewest real
        rows and the most real tokens that reach it: (decode, rows, tokens, real rows). A mixed (prefill) step
        needs a row of two or more tokens, so it has more tokens than real rows."""
        row_bucket = lambda n: min(_pow2(n, 4), self.max_rows)  # noqa: E731  (as in execute)
        tok_bucket = lambda t: min(_pow2(t, 16), self.max_tokens_bucket)  # noqa: E731
        fewest_rows: dict[int, int] = {}
        for n in range(max_num_seqs, 0, -1):
            fewest_rows[row_bucket(n)] = n
        most_tokens: dict[int, int] = {}
        for t in range(1, max_num_batched_tokens + 1):
            most_tokens[tok_bucket(t)] = t
        out = [(True, r, r, n) for r, n in sorted(fewest_rows.items())]
        for r, n in sorted(fewest_rows.items()):
            for tb, t in sorted(most_tokens.items()):
                if t > n and -(-t // n) < self.max_blocks * self.cache.block_size:  # one chunk fits a sequence
                    out.append((False, r, tb, n))
        return out

    def warm(self, decode: bool, num_real: int, num_tokens: int, params) -> None:
        """Runs one step of `num_real` dummy rows and `num_tokens` tokens (decode: one each) with sampling
        `params`, writing only the null slot and the null page (which padding rows write anyway), so that its
        program is compiled before real requests need it. Waits for it."""
        from jhybrid.engine.scheduler import ScheduledRow
        from jhybrid.engine.sequence import Sequence

        bs = self.cache.block_size
        sizes = [1] * num_real if decode else [num_tokens // num_real + (i < num_tokens % num_real)
                                               for i in range(num_real)]
        rows = []
        for i, k in enumerate(sizes):
            length = k + 1 if decode else k  # decode: one known token before the fed one
            seq = Sequence(f"warmup-{i}", [0] * length, params)
            seq.block_table = [0] * -(-length // bs)  # the null page; slot 0 is the null slot
            rows.append(ScheduledRow(seq, length - k, k, True))
        no_prev = self._no_prev
        self.execute(SchedulerOutput(rows, [], []), None).fetch()
        if self._no_prev is not no_prev:  # the first step settled where outputs live: compile that variant too
            self.execute(SchedulerOutput(rows, [], []), None).fetch()
        self._tables[0], self._table_len[0], self._table_owner[0] = 0, 0, None  # the null slot's row stays zeros

    def warm_zero_slots(self, max_num_seqs: int) -> None:
        """Compiles `zero_slots` for every slot-count bucket admissions can meet (on the null slot only)."""
        for n in sorted({_pow2(k, 4) for k in range(1, max_num_seqs + 1)}):
            self.zero_slots([0] * n)

    def _seed(self, seq) -> int:
        if seq.params.seed is not None:
            return seq.params.seed
        return (self.seed * 1_000_003 + seq.seq_id * 7919) % 2**32


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
