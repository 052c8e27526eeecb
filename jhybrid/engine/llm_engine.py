"""The engine loop: read a step's tokens -> schedule -> dispatch -> the read step's text and stop handling.

`step()` dispatches step n+1 before it reads step n's sampled tokens (JAX dispatch is asynchronous), so
tokenisation, stop checks and scheduling on the host overlap the device's work. A sequence that stops at
step n was already scheduled into step n+1; that row's token is dropped. A step's read comes in two halves
around the next dispatch: its tokens and the stops they decide first, its text after (`step()`).

Structured output (`SamplingParams.structured_outputs`, `jhybrid.engine.structured_output`): a request's grammar
mask for its next token depends on the token step n sampled, which the host has not read when step n+1 is
dispatched. Such a step is split (`ModelRunner.execute`): its forward is dispatched at once, the host reads step
n (the matchers take its tokens) and fills the masks while the device runs the forward, and then dispatches the
step's sampling with them, as vLLM does. Where a bucket's split programs are not compiled yet (a server compiles
them in the background on first use) or the step cannot split (mixed steps, tensor parallelism, prompt
logprobs, offloaded attention), the matchers take step n's tokens first (`_read_matchers`) and the masks go in
with the whole step. A matcher's tokens are the sequence's: where step n is dropped unread (a failed step),
they are taken back (`Matcher.undo`), so preemption and failures leave it where the sequence is.

With `host_kv_memory_gb > 0` a host tier (`jhybrid.cache.host_tier`) holds the KV and state of preempted
sequences (`jhybrid.engine.swap`); `preemption_mode` picks swap or recompute ("auto": by the cost model,
whose host-device bandwidth and prefill rate are measured at start unless given as
`swap_bandwidth_gbps` / `prefill_tokens_per_s`). With prefix caching on as well, the cache's evicted blocks and
snapshots go to the same host tier and come back on a hit where the cost model says so
(`jhybrid.engine.prefix_tier`).

`kv_offload` (needs the host tier; default "off"): running decode sequences may keep their oldest KV
blocks in the host tier instead of being preempted (`jhybrid.engine.offload`); their attention over those
blocks runs on the CPU ("cpu", overlapped with the GPU's work unless `offload_overlap=False`) or on the
GPU over copies sent every step ("copy", the baseline). Off by default: benchmarks/offload.py decides
where it wins. With `offload_policy="cost"` (the default) blocks are offloaded only where the cost model
prices the rest of the sequence's host attention below the preemption it avoids; "always" offloads
whenever a running sequence would otherwise be preempted.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from typing import Any, NamedTuple

import numpy as np

from jhybrid.cache.allocator import BlockAllocator, SlotAllocator
from jhybrid.cache.host_tier import HostTier, SwapCostModel, plan_host_tier
from jhybrid.cache.planner import plan_cache
from jhybrid.cache.prefix_cache import PrefixCache
from jhybrid.engine.engine_config import EngineConfig, engine_config
from jhybrid.engine.heap import freeze_startup_heap
from jhybrid.engine.runner import SPLIT_COMPILE_THREAD, ModelRunner, StepResult
from jhybrid.engine.sampling import SamplingParams, bad_words_token_ids
from jhybrid.engine.scheduler import Scheduler
from jhybrid.engine.sequence import Sequence
from jhybrid.engine.slot_tables import ban_rows
from jhybrid.engine.prefix_tier import PrefixTierMover
from jhybrid.engine.prompts import int_array
from jhybrid.engine.swap import (Swapper, check_transfer, measure_prefill_rate, measure_transfer_bandwidth,
                                 warm_swap_programs)
from jhybrid.engine.offload import HostAttention, Offloader, OffloadStats
from jhybrid.model_loader import quantize

log = logging.getLogger("jhybrid.engine")

# `step()` writes a step's text, logprob entries and stop strings' effects after it dispatched the next step, so
# that the device gets its next step sooner; off (JHYBRID_DEFER_POSTPROCESS=0): before scheduling, as through
# session 28, for comparison (benchmarks/RESULTS.md, "Session 29")
DEFER_POSTPROCESS = os.environ.get("JHYBRID_DEFER_POSTPROCESS", "1") != "0"


def _tp_free_bytes(tensor_parallel_size: int) -> int | None:
    """Under tensor parallelism each device holds 1/N of the KV pool and of the state slots: the budget
    is N devices' free memory (None: the planner measures one device)."""
    if tensor_parallel_size == 1:
        return None
    from jhybrid.cache.planner import device_memory_bytes

    return device_memory_bytes() * tensor_parallel_size



class StepRecord(NamedTuple):
    """One engine step as `LLMEngine.step_log` records it: perf_counter seconds when its scheduling started,
    after scheduling, after dispatching and at its end; its rows and tokens, those of prompts, the state restores
    and snapshots it carried, the seconds it waited for the device (reading the step before last), and when the
    `step()` call began (its read of that step's tokens comes before the scheduling)."""

    start: float
    scheduled: float
    dispatched: float
    end: float
    rows: int
    tokens: int
    prompt_rows: int
    prompt_tokens: int
    restores: int
    snapshots: int
    device_wait: float
    read_start: float | None = None

    @property
    def rest(self) -> float:
        """Seconds of the call spent neither scheduling, dispatching nor waiting for the device: reading the
        results into the requests (before the scheduling and after the dispatch)."""
        before = self.start - self.read_start if self.read_start is not None else 0.0
        return before + self.end - self.dispatched - self.device_wait

class LLMEngine:
    """The engine over a loaded model. `config` holds the options (`EngineConfig`; `options` replace its fields,
    e.g. `LLMEngine(model, max_num_seqs=8)`); `config.dtype` is not used (the model is loaded already)."""

    def __init__(self, model, config: EngineConfig | None = None, /, **options: Any):
        config = self.config = engine_config(config, **options)
        cfg = model.cfg
        tensor_parallel_size = config.tensor_parallel_size
        from jhybrid.parallel import kv_replication, make_mesh, replicate_kv_heads, validate_tensor_parallel

        validate_tensor_parallel(cfg, tensor_parallel_size)  # before any planning: a bad N names the counts
        model = quantize(model, config.quantization, tensor_parallel_size)  # a LoadedModel given as is (idempotent)
        if (copies := kv_replication(cfg, tensor_parallel_size)) > 1:  # fewer kv heads than devices
            log.info("tensor_parallel_size=%d > %d kv heads: each kv head is stored %d times", tensor_parallel_size,
                     cfg.num_kv_heads, copies)
            cfg, params = replicate_kv_heads(cfg, model.params, copies)
            model = dataclasses.replace(model, cfg=cfg, params=params)
        self.mesh = make_mesh(tensor_parallel_size) if tensor_parallel_size > 1 else None
        self.model = model
        self.tokenizer = model.tokenizer
        self.eos_token_ids = frozenset(model.eos_token_ids)
        # the checkpoint's generation_config.json sampling defaults (vLLM's `--generation-config auto`): the
        # server applies them to the fields a request leaves out; `default_sampling_params` is them as params
        self.generation_defaults = dict(getattr(model, "generation_defaults", None) or {})
        self.default_sampling_params = SamplingParams(**self.generation_defaults)
        if self.generation_defaults:
            log.info("sampling defaults from the checkpoint's generation_config.json (for fields a request does not "
                     "set): %s", ", ".join(f"{k}={v}" for k, v in self.generation_defaults.items()))
        max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 4096)
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"{max_model_len=} exceeds the model's max_position_embeddings ({cfg.max_position_embeddings})")
        max_num_seqs, block_size = config.max_num_seqs, config.block_size
        self.max_model_len = max_model_len
        max_num_batched_tokens = config.max_num_batched_tokens or max(512, min(2048, max_model_len))
        kv_dtype = np.dtype(model.params["embed"].dtype).name
        num_snapshots = 0
        if config.enable_prefix_caching and cfg.num_linear_layers:
            num_snapshots = config.prefix_snapshot_slots  # None: the planner's share of the budget
        self.cache = plan_cache(cfg, max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size,
                                kv_dtype=kv_dtype, num_kv_blocks=config.num_kv_blocks,
                                memory_fraction=config.memory_fraction, free_bytes=_tp_free_bytes(tensor_parallel_size),
                                num_snapshot_slots=num_snapshots, prefix_caching=config.enable_prefix_caching)
        self.prefix_cache = None
        if config.enable_prefix_caching:
            self.prefix_cache = PrefixCache(self.cache.num_blocks, block_size, self.cache.snapshot_slots,
                                            has_state=cfg.num_linear_layers > 0,
                                            snapshot_interval=config.prefix_snapshot_interval,
                                            prompt_end=config.prefix_snapshot_prompt_end)
            self.blocks = self.prefix_cache.blocks
        else:
            self.blocks = BlockAllocator(self.cache.num_blocks, block_size)
        self.slots = SlotAllocator(self.cache.num_slots)
        self.runner = ModelRunner(cfg, model.params, self.cache, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                  max_num_batched_tokens=max_num_batched_tokens, seed=config.seed, mesh=self.mesh)
        self.runner.read_matchers = self._read_matchers
        kv_offload = config.kv_offload
        self.host, self.swapper, self.cost_model = self._host_tier(
            config, max_num_batched_tokens, needs_cost=kv_offload != "off" and config.offload_policy == "cost")
        self.prefix_mover = None  # the prefix cache's demotions to and promotions from the host tier
        if self.prefix_cache is not None and self.host is not None:
            self.prefix_cache.attach_host(self.host, self.cost_model, snapshot_bytes=self.host.slot_bytes)
            self.prefix_mover = PrefixTierMover(self.host)
        self.host_attn = self.offloader = None
        if kv_offload != "off":
            import os

            threads = config.offload_threads or max(1, min(8, (os.cpu_count() or 2) // 2))
            self.host_attn = HostAttention(cfg, self.host, kv_offload, overlap=config.offload_overlap,
                                           num_threads=threads)
            self.offloader = Offloader(self.host, self.host_attn.stats)
            self.runner.host_attn = self.host_attn
        self.scheduler = Scheduler(self.blocks, self.slots, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                                   host=self.host, cost_model=self.cost_model,
                                   preemption_mode=config.preemption_mode if self.host is not None else "recompute",
                                   kv_offload=kv_offload, offload_admission=config.offload_admission,
                                   offload_policy=config.offload_policy,
                                   max_prefill_tokens_with_decodes=config.max_prefill_tokens_with_decodes,
                                   prefix_cache=self.prefix_cache,
                                   token_bucket=lambda n: self.runner.buckets(False, 1, n)[1],
                                   snapshot_budget=self._snapshot_budget if self.runner.step_snapshot_share else None,
                                   num_scheduler_steps=(config.num_scheduler_steps or 1) if self.mesh is None else 1,
                                   can_burst=self.runner.can_burst)
        self.runner.burst_steps = self.scheduler.num_scheduler_steps
        self.requests: dict[Any, Sequence] = {}
        self.grammars = None  # GrammarCache, made with the first structured-output request (or by warmup())
        self._grammar_waiting: list[tuple[Sequence, Any]] = []  # (sequence, future of its compiled grammar)
        # the steps dispatched and not read yet: `_prev` the last, `_older` the one before it (`step()`)
        self._prev: StepResult | None = None
        self._older: StepResult | None = None
        self._lit: tuple | None = None  # (step, what `_take_tokens` left for `_finish_lit`) between the two
        self._arrivals = 0
        self.num_preemptions = 0
        self.startup_programs_compiled = 0
        self.startup_compile_seconds = 0.0
        self.startup_phases: dict[str, float] = {}  # seconds of each phase of `warmup`
        self._after_ready = None  # a CompileWatch once warmed up
        # host time per step by phase, and the time spent waiting for the device (`stats()`)
        self.timing = dict(num_steps=0, host_schedule_seconds=0.0, host_prepare_seconds=0.0,
                           host_postprocess_seconds=0.0, device_wait_seconds=0.0)
        # a list to trace every step into (benchmarks: prefix_serve, host_profile), one StepRecord per step
        self.step_log: list[StepRecord] | None = None
        log.info("KV pool: %d blocks of %d tokens; %d state slots%s", self.cache.num_blocks - 1, block_size,
                 self.cache.num_slots - 1, f"; prefix caching with {self.cache.num_snapshot_slots} state snapshots"
                 if self.prefix_cache is not None else "")
        if config.warmup:
            self.warmup()  # freezes the start-up heap once the programs exist
        else:
            freeze_startup_heap("engine start")

    def warmup(self, progress: bool = True, threads: int | None = None) -> int:
        """Compiles every step program the scheduler can need (each decode row bucket and each mixed-step token
        bucket, and each token bucket's variant for steps with prompt log-probabilities; sampling settings are
        runtime arrays, so these are all) on `threads` threads at once, runs each
        once on dummy rows (the null slot and page only; no request is touched), and seals the runner: from
        then on a step whose bucket is missing runs in a larger compiled one instead of compiling. Steps with
        host-resident KV (`kv_offload`) and swaps still compile on first use. Returns how many step programs
        it compiled; `stats()` reports the programs XLA built or loaded and the seconds taken.
        `jhybrid.engine.compilation.enable_compilation_cache` makes later starts load them from disk."""
        from tqdm import tqdm

        from jhybrid.engine.compilation import CompileWatch

        if self.has_unfinished():
            raise RuntimeError("warmup() runs before requests are added: it would reorder the device's work")
        t0 = time.perf_counter()
        grid = self.runner.program_grid(self.scheduler.max_num_seqs, self.scheduler.max_num_batched_tokens)
        grid += self.runner.prompt_logprob_grid(self.scheduler.max_num_batched_tokens)
        grid += self.runner.burst_grid(self.scheduler.max_num_seqs)
        runner, phases = self.runner, {}
        lower0, times0 = runner.lower_seconds, dict(runner.compile_times)
        with CompileWatch() as watch, tqdm(total=len(grid), desc="compiling step programs", unit="program",
                                           disable=not progress) as bar:
            t1 = time.perf_counter()
            compiled = runner.compile_all(grid, threads=threads, progress=lambda key: bar.update())
            bar.update(len(grid) - bar.n)
            phases["step programs"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            for key in grid:
                runner.warm(key)
            phases["first runs"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            runner.warm_slot_programs()
            if self.prefix_mover is not None:
                runner.state = self.prefix_mover.warm(runner.state)
            if self.swapper is not None and self.scheduler.preemption_mode != "recompute":
                runner.state = warm_swap_programs(self.swapper, runner.state,
                                                  self.blocks.blocks_needed(self.max_model_len))
            phases["slot programs"] = time.perf_counter() - t1
        runner.seal()
        t1 = time.perf_counter()
        if self.tokenizer is not None:  # the grammar library's view of the tokenizer (seconds at 150k tokens)
            try:
                self._grammar_cache().warm()
            except (ImportError, ValueError) as e:
                log.warning("structured output is unavailable: %s", e)
        phases["grammar"] = time.perf_counter() - t1
        self.startup_phases = phases
        times = {k: v for k, v in runner.compile_times.items() if k not in times0}
        slowest = ", ".join(f"{_bucket_name(k)} {v:.1f} s" for k, v in sorted(times.items(), key=lambda kv: -kv[1])[:4])
        log.info("start-up phases: step programs %.1f s (tracing %.1f s on this thread, %d XLA compiles taking "
                 "%.1f s together%s), first runs %.1f s, slot programs %.1f s, grammar %.1f s",
                 phases["step programs"], runner.lower_seconds - lower0, len(times), sum(times.values()),
                 f"; slowest: {slowest}" if slowest else "", phases["first runs"], phases["slot programs"],
                 phases["grammar"])
        # every program the process compiles from now on, each logged by name
        self.close()  # warmed up again: the last watch stops
        self._after_ready = CompileWatch(warn="after the engine was ready (a stall on the request path)",
                                         background=SPLIT_COMPILE_THREAD)
        weakref.finalize(self, self._after_ready.close)  # the watch holds no reference to the engine
        hits = self.runner.program_cache.hits if self.runner.program_cache else 0  # loaded without XLA's event
        self.startup_programs_compiled += watch.count + hits
        self.startup_compile_seconds += time.perf_counter() - t0
        freeze_startup_heap("warmup")
        log.info("start-up compilation: %d programs (%d step programs, %d of them from the step-program cache) "
                 "compiled or loaded in %.1f s", watch.count + hits, len(grid), hits, time.perf_counter() - t0)
        return compiled

    def _host_tier(self, config: EngineConfig, max_num_batched_tokens: int, needs_cost: bool = False):
        host_kv_memory_gb, mode, transfer = config.host_kv_memory_gb, config.preemption_mode, config.swap_transfer
        check_transfer(transfer)  # pinned_host memory: does this backend have it?
        if not host_kv_memory_gb:
            return None, None, None
        host = HostTier(self.model.cfg, plan_host_tier(self.model.cfg, self.cache, host_kv_memory_gb=host_kv_memory_gb,
                                                        max_num_seqs=config.max_num_seqs,
                                                        prefix_snapshots=config.enable_prefix_caching))
        cost = None
        if mode == "auto" or needs_cost:
            if config.swap_bandwidth_gbps is not None:
                h2d = d2h = config.swap_bandwidth_gbps * 1e9
            else:
                h2d, d2h = measure_transfer_bandwidth(transfer=transfer)
            prefill_rate = config.prefill_tokens_per_s
            if prefill_rate is None:
                prefill_rate = measure_prefill_rate(self.runner, min(max_num_batched_tokens, self.max_model_len - 1))
            cost = SwapCostModel(h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, prefill_tokens_per_s=prefill_rate)
            log.info("swap cost model: H2D %.2f GB/s, D2H %.2f GB/s, prefill %.0f tokens/s", h2d / 1e9, d2h / 1e9,
                     prefill_rate)
        log.info("host tier: %d KV blocks, %d state slots (%.2f GiB)", host.blocks.capacity - 1, host.slots.capacity - 1,
                 host.bytes_total / 2**30)
        return host, Swapper(host, transfer), cost

    # ----------------------------------------------------------------- requests
    def add_request(self, request_id: Any, prompt: str | list[int], params: SamplingParams | None = None) -> Sequence:
        """Queues a request. Bad prompts fail that request alone: it comes back finished with an error."""
        params = params or SamplingParams()
        if request_id in self.requests and not self.requests[request_id].is_finished:
            raise ValueError(f"request id {request_id!r} is already running")
        ids, error = self._encode(prompt)  # a tokenizer that raises leaves nothing registered
        seq = Sequence(request_id, ids, params, arrival=self._arrivals)
        if not error and (params.bad_words or params.min_tokens):
            error = self._set_bans(seq)
        compiling = None
        if not error and params.structured_outputs is not None:
            error, compiling = self._start_matcher(seq)
        if self.tokenizer is not None:
            from jhybrid.tokenizer import IncrementalDetokenizer

            seq.detok = IncrementalDetokenizer(self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens)
        self._arrivals += 1
        self.requests[request_id] = seq
        if error:
            self.scheduler.finish(seq, "error", error)
        elif compiling is not None:  # joins the scheduler's queue once its grammar is compiled (`_admit_compiled`)
            self._grammar_waiting.append((seq, compiling))
        else:
            self.scheduler.add(seq)
        return seq

    def _set_bans(self, seq: Sequence) -> str | None:
        """Gives `seq` its banned token sequences (bad words; stop ids before min_tokens); the error, if any."""
        params = seq.params
        if params.bad_words and self.tokenizer is None:
            return "bad_words: this checkpoint has no tokenizer to turn them into tokens"
        try:
            words = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else []
            seq.set_bans(ban_rows(params, words, self.eos_token_ids, self.model.cfg.vocab_size))
        except ValueError as e:
            return str(e)
        return None

    def _grammar_cache(self):
        if self.grammars is None:
            from jhybrid.engine.structured_output import GrammarCache

            self.grammars = GrammarCache(self.tokenizer, self.model.cfg.vocab_size, self.eos_token_ids)
        return self.grammars

    def _start_matcher(self, seq: Sequence):
        """Gives `seq` its grammar matcher when its grammar is compiled already; else starts compiling it (once per
        distinct grammar, on the cache's thread). Returns (error or None, the compile's future or None)."""
        if self.tokenizer is None:
            return "structured_outputs: this checkpoint has no tokenizer to build the grammar's token masks from", None
        try:
            future = self._grammar_cache().compile_async(seq.params.structured_outputs)
        except (ImportError, ValueError) as e:
            return str(e), None
        if not future.done():
            return None, future
        return self._set_matcher(seq, future), None

    def _set_matcher(self, seq: Sequence, compiled) -> str | None:
        """Gives `seq` a matcher of the grammar `compiled` (a done future) made; the error, if any."""
        try:
            seq.set_matcher(self.grammars.matcher(seq.params.structured_outputs, seq.params.stop_token_ids,
                                                  compiled.result()))
        except (ImportError, ValueError) as e:
            return str(e)
        return None

    def _snapshot_budget(self, decode: bool, num_rows: int, num_tokens: int) -> int:
        """The prefix-cache snapshots the program of such a step takes in itself (the scheduler's budget of rolling
        snapshots). A sealed runner may run the step in a larger program, which takes in as many or more."""
        rows = self.runner.buckets(decode, num_rows, num_tokens)[0]
        return self.runner.step_snapshots(rows)

    def _admit_compiled(self) -> list[Sequence]:
        """Queues the sequences whose grammar compiled (or fails them); returns those that failed. With nothing else
        to run, waits a little for a compile rather than spinning."""
        from concurrent.futures import FIRST_COMPLETED, wait

        if not self.scheduler.has_work() and self._prev is None and self._older is None:
            wait([f for _, f in self._grammar_waiting], timeout=0.05, return_when=FIRST_COMPLETED)
        failed, waiting = [], []
        for seq, future in self._grammar_waiting:
            if seq.is_finished:  # aborted while its grammar compiled
                continue
            if not future.done():
                waiting.append((seq, future))
            elif error := self._set_matcher(seq, future):
                self.scheduler.finish(seq, "error", error)
                failed.append(seq)
            else:
                self.scheduler.add(seq)
        self._grammar_waiting = waiting
        return failed

    def _encode(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return [], "this checkpoint has no tokenizer: pass the prompt as a list of token ids"
            ids = self.tokenizer.encode(prompt)
            arr = None
        else:
            arr = int_array(prompt)
            ids = arr.tolist() if arr is not None else [int(t) for t in prompt]
        vocab = self.model.cfg.vocab_size
        if not ids:
            return ids, "empty prompt: give at least one token"
        lo, hi = (int(arr.min()), int(arr.max())) if arr is not None else (min(ids), max(ids))
        if lo < 0 or hi >= vocab:
            return ids, f"prompt token ids must lie in [0, {vocab}), got {lo}..{hi}"
        if len(ids) >= self.max_model_len:
            return ids, f"prompt of {len(ids)} tokens is too long: max_model_len is {self.max_model_len}"
        return ids, None

    def close(self) -> None:
        """Stops counting (and logging) compiles as this engine's `programs_compiled_after_ready`: called when the
        engine is done serving (the server's engine thread ends), and when the engine is garbage-collected. Without
        it, the next engine of the process (a benchmark's second server, a test's reference engine) had its own
        warm-up logged as this one's stalls. Idempotent; the engine may still be used."""
        if self._after_ready is not None:
            self._after_ready.close()

    def abort(self, request_id: Any) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_work() or self._prev is not None or self._older is not None
                or bool(self._grammar_waiting))

    # ----------------------------------------------------------------- the loop
    def step(self) -> list[Sequence]:
        """One engine iteration; returns the sequences that got tokens or finished while reading.

        Two steps are in flight between calls: n+1 (`_older`) and n+2 (`_prev`). A call reads step n+1's tokens
        into its sequences (waits for the device; EOS, stop tokens, length and grammar stops), schedules and
        dispatches step n+3, then turns step n+1's tokens into text, log-probability entries and stop strings'
        effects. That last part runs while the device works (`DEFER_POSTPROCESS`): the time from one step's end to
        the next step's dispatch is then only the read, the scheduling and the dispatch (benchmarks/RESULTS.md,
        "Session 29"). Sequences with stop strings are finished in the read, text included, as their stop
        depends on the text."""
        timing, entered = self.timing, time.perf_counter()
        wait0, sched, current = timing["device_wait_seconds"], None, None
        updated = self._admit_compiled() if self._grammar_waiting else []
        if self._older is not None:
            older = self._older
            self._lit = (older, self._take_tokens(older))  # waits for that step
            self._older = None
            if self._prev is not None and self._prev.needs_sampling:  # its masks wanted the tokens just read
                self.runner.sample_split(self._prev)
            if not DEFER_POSTPROCESS:
                updated += self._finish_lit()
        self._flush_transfers()
        t0 = time.perf_counter()
        t1 = t2 = t0
        if self.scheduler.has_work():
            sched = self.scheduler.schedule()
            t1 = time.perf_counter()
            timing["host_schedule_seconds"] += t1 - t0
            self.num_preemptions += len(sched.preempted)
            if sched.swap_out:  # gather before anything below reuses the pages and slots
                self.swapper.swap_out(self.runner.state, sched.swap_out)
            if sched.tier is not None:  # prefix-cache blocks and snapshots demoted to the host: likewise
                self.prefix_mover.demote(self.runner.state, sched.tier)
                # host blocks back into device blocks, host snapshots into the slots of hits (before the step,
                # and before an offload below gathers a promoted block)
                self.runner.state = self.prefix_mover.promote(self.runner.state, sched.tier)
            if sched.offload:  # the blocks are reused from the next step on
                self.offloader.dispatch(self.runner.state, sched.offload)
            if sched.rows:
                if sched.new_slots:  # (most steps hand out none: no walk over their rows)
                    in_step = self.runner.slots_zeroed_by_step(sched)  # the step program zeroes these itself
                    self.runner.zero_slots([s for s in sched.new_slots if s not in in_step])
                if sched.restores:  # prefix hits: their slots start from a snapshot (before the step)
                    self.runner.copy_slots(sched.restores)
                if sched.swap_in:
                    self.runner.state = self.swapper.swap_in(self.runner.state, sched.swap_in)
                # rows that end at a snapshot point have their state copied after the step (most of them by the
                # step program itself: `ModelRunner.execute`)
                current = self.runner.execute(sched, self._prev)
            t2 = time.perf_counter()
            timing["host_prepare_seconds"] += t2 - t1
        if current is not None:
            self._older, self._prev = self._prev, current
        elif self._prev is not None:  # nothing new: the last step is read by the next call
            self._older, self._prev = self._prev, None
        updated += self._finish_lit()  # after the steps in flight are recorded: it may raise (`_recover`)
        timing["num_steps"] += 1
        if self.step_log is not None and sched is not None:
            prompt_rows = [r for r in sched.rows if r.start < len(r.seq.prompt_ids)]
            self.step_log.append(StepRecord(t0, t1, t2, time.perf_counter(), len(sched.rows),
                                            sum(r.num_tokens for r in sched.rows), len(prompt_rows),
                                            sum(r.num_tokens for r in prompt_rows), len(sched.restores),
                                            len(sched.snapshots), timing["device_wait_seconds"] - wait0, entered))
        return updated

    def _flush_transfers(self) -> None:
        """Waits for the host copies that the last schedule started (before the next schedule commits them)."""
        if self.swapper is not None:
            self.swapper.flush()  # the step before was read, so swap-out data has (nearly) arrived
        if self.prefix_mover is not None:
            self.prefix_mover.flush()  # likewise the prefix cache's demotions
        if self.offloader is not None:
            self.offloader.flush()  # before the next schedule() commits these offloads

    def stats(self) -> dict[str, float]:
        """Memory use and preemption counts: the KV pool, state slots, host tier, swaps and recomputes."""
        sched = self.scheduler
        out = dict(
            kv_blocks_used=self.blocks.num_used, kv_blocks_total=self.blocks.capacity - 1,
            state_slots_used=self.slots.num_used, state_slots_total=self.slots.capacity - 1,
            num_preemptions=self.num_preemptions, num_recompute_preemptions=sched.num_recompute_preemptions,
            num_swap_preemptions=sched.num_swap_preemptions, num_swap_fallbacks=sched.num_swap_fallbacks,
            host_blocks_used=0, host_blocks_total=0, host_slots_used=0, host_slots_total=0, host_bytes_used=0,
            host_bytes_total=0, num_swap_out=0, num_swap_in=0, swap_out_bytes=0, swap_in_bytes=0,
            swap_out_seconds=0.0, swap_in_seconds=0.0,
            host_resident_blocks=sched.num_host_resident_blocks, num_offloaded_blocks=sched.num_offloaded_blocks,
            num_offloads_declined=sched.num_offloads_declined,
            startup_programs_compiled=self.startup_programs_compiled,
            startup_compile_seconds=self.startup_compile_seconds,
            programs_compiled_after_ready=self._after_ready.count if self._after_ready is not None else 0,
            **self.timing,
            host_dispatch_seconds=self.runner.dispatch_seconds, num_multi_step_calls=self.runner.num_bursts,
            host_step_seconds=sum(self.timing[k] for k in ("host_schedule_seconds", "host_prepare_seconds",
                                                           "host_postprocess_seconds")),
        )
        out.update(dataclasses.asdict(self.host_attn.stats if self.host_attn is not None else OffloadStats()))
        pc = self.prefix_cache
        out.update(prefix_cache_queries=pc.num_queries if pc else 0, prefix_cache_hits=pc.num_hits if pc else 0,
                   prefix_snapshots_held=pc.num_snapshots if pc else 0,
                   prefix_snapshots_total=len(pc.snapshot_slots) if pc and pc.has_state else 0,
                   prefix_snapshots_taken=pc.num_snapshots_taken if pc else 0,
                   prefix_rolling_snapshots_skipped=self.scheduler.num_rolling_snapshots_skipped,
                   prefix_cached_blocks=pc.num_cached_blocks if pc else 0,
                   prefix_host_blocks=pc.num_host_blocks if pc else 0,
                   prefix_host_snapshots=pc.num_host_snapshots if pc else 0,
                   prefix_blocks_demoted=pc.num_blocks_demoted if pc else 0,
                   prefix_blocks_promoted=pc.num_blocks_promoted if pc else 0,
                   prefix_snapshots_demoted=pc.num_snapshots_demoted if pc else 0,
                   prefix_host_restores=pc.num_host_restores if pc else 0)
        mover = self.prefix_mover
        out.update(prefix_host_bytes_out=mover.bytes_out if mover else 0, prefix_host_bytes_in=mover.bytes_in if mover else 0,
                   prefix_host_seconds_out=mover.seconds_out if mover else 0.0,
                   prefix_host_seconds_in=mover.seconds_in if mover else 0.0)
        if self.host is not None:
            st = self.swapper.stats
            out.update(
                host_blocks_used=self.host.blocks.num_used, host_blocks_total=self.host.blocks.capacity - 1,
                host_slots_used=self.host.slots.num_used, host_slots_total=self.host.slots.capacity - 1,
                host_bytes_used=self.host.bytes_used, host_bytes_total=self.host.bytes_total,
                num_swap_out=st.num_swap_out, num_swap_in=st.num_swap_in, swap_out_bytes=st.bytes_out,
                swap_in_bytes=st.bytes_in, swap_out_seconds=st.seconds_out, swap_in_seconds=st.seconds_in,
            )
        return out

    def _read_matchers(self, result: StepResult) -> None:
        """Feeds the tokens of step `result` to its rows' grammar matchers ahead of its read (`_take_tokens` then
        takes what each returned), for a next step whose masks are filled before its forward
        (`ModelRunner.execute`)."""
        t0 = time.perf_counter()
        tokens = result.fetch_tokens()[0]
        self.timing["device_wait_seconds"] += time.perf_counter() - t0
        result.accepted = {i: row.seq.matcher.accept(int(tokens[i])) for i, row in enumerate(result.sched.rows)
                           if row.samples and not row.seq.is_finished and row.seq.matcher is not None}

    def _read(self, result: StepResult) -> list[Sequence]:
        """Reads step `result` whole (its tokens, then their text): for callers outside `step()`."""
        self._lit = (result, self._take_tokens(result))
        return self._finish_lit()

    def _take_tokens(self, result: StepResult) -> tuple[list, tuple | None]:
        """The first half of reading a step: waits for its tokens and appends them to their sequences, feeds the
        grammar matchers and ends the sequences that stop by token (EOS, stop token ids), by length or by their
        grammar; sequences with stop strings are read whole here. Returns, per row read, what `_finish_lit`
        still has to do: (row index, sequence, token, finish reason or None, whether the row is done); and the
        step's top logprobs as lists if it read them (`_top_lists`), else None."""
        t0 = time.perf_counter()
        tokens, token_logp = result.fetch_tokens()  # waits for that step only
        t1 = time.perf_counter()
        self.timing["device_wait_seconds"] += t1 - t0
        # Python lists once per step: indexing NumPy arrays per row and value is several times slower
        tokens, token_logp = tokens.tolist(), token_logp.tolist()
        if result.burst == 1:
            tokens, token_logp = [tokens], [token_logp]
        num_rows = result.num_rows  # a burst's top logprobs: inner step j's row i at j * num_rows + i
        accepted_early = getattr(result, "accepted", None)
        top = None
        todo = []
        for i, row in enumerate(result.sched.rows):
            if not row.samples:
                continue
            seq = row.seq
            for j in range(row.steps):  # a multi-step decode step's row: its inner steps' tokens in order
                seq.num_pending -= 1
                if not seq.is_finished:  # else stopped or aborted after this step was dispatched, or by a token
                    top = self._take_token(result, seq, j * num_rows + i, tokens[j][i], token_logp[j][i],
                                           accepted_early.get(i) if accepted_early is not None else None, todo, top)
        self.timing["host_postprocess_seconds"] += time.perf_counter() - t1
        return todo, top

    def _take_token(self, result: StepResult, seq: Sequence, i: int, token: int, logp: float, accepted: bool | None,
                    todo: list, top: tuple | None) -> tuple | None:
        """`_take_tokens` for one token of `seq`, `i` its index in the step's top logprobs; returns them as lists
        once read (else `top`)."""
        seq.token_ids.append(token)
        seq.token_logprobs.append(logp)
        matcher = seq.matcher
        if matcher is not None and not (matcher.accept(token) if accepted is None else accepted):
            self.scheduler.finish(seq, "error", f"structured_outputs: the sampled token {token} is not allowed by "
                                  "the grammar (allowed_token_ids, bad_words or min_tokens may exclude every "
                                  "token the grammar allows here)")
            todo.append((i, seq, token, "error", False))
            return top
        if seq.params.stop and seq.detok is not None:  # a stop string: the text decides, so read it now
            if top is None:
                top = _top_lists(result)
            self._add_logprobs(seq, i, *top)
            text_before = seq.text
            seq.text += seq.detok.add(token)
            self._check_stop(seq, token, text_before)
            self._grammar_stop(seq, text_before)
            todo.append((i, seq, token, None, True))
            return top
        todo.append((i, seq, token, self._token_stop(seq, token), False))
        return top

    def _finish_lit(self) -> list[Sequence]:
        """The second half of reading the step whose tokens `_take_tokens` took: prompt logprobs, each token's
        logprob entries and text, and the text's end where its sequence stopped. Returns the sequences read."""
        if self._lit is None:
            return []
        result, (todo, top) = self._lit
        self._lit = None
        t0 = time.perf_counter()
        plp = result.fetch_prompt_logprobs()
        top_lp, top_ids = top if top is not None else _top_lists(result)
        t1 = time.perf_counter()
        self.timing["device_wait_seconds"] += t1 - t0
        if plp is not None:  # before the tokens: a request's first token comes with all its prompt's
            self._fill_prompt_logprobs(result.plp_rows, *plp)
        updated, error = [], None
        for i, seq, token, reason, done in todo:
            updated.append(seq)
            if done:
                continue
            try:
                self._add_logprobs(seq, i, top_lp, top_ids)
                text_before = seq.text
                if seq.detok is not None:
                    seq.text += seq.detok.add(token)
                # (a grammar's end was checked with the token: its matcher may have taken the next step's since)
                if reason in ("stop", "grammar"):
                    if not seq.params.include_stop_str_in_output:
                        seq.text = text_before  # the stop token's text (EOS's is usually empty: a special token)
                    elif seq.detok is not None:
                        seq.text += seq.detok.flush()
                elif reason == "length" and seq.detok is not None:
                    seq.text += seq.detok.flush()
            except Exception as e:  # noqa: BLE001 - a detokenizer's fault: the other rows' text is still written
                error = error or e
        self.timing["host_postprocess_seconds"] += time.perf_counter() - t1
        if error is not None:  # their tokens were taken: a row left without its text would lose it for good
            raise error
        return list(dict.fromkeys(updated)) if result.sched.burst > 1 else updated

    @staticmethod
    def _add_logprobs(seq: Sequence, i: int, top_lp, top_ids) -> None:
        if seq.params.logprobs is not None and top_lp is not None:
            k = seq.params.logprobs
            seq.logprobs.append(dict(zip(top_ids[i][:k], top_lp[i][:k])))

    @staticmethod
    def _fill_prompt_logprobs(plp_rows, lp, top_lp, top_ids) -> None:
        """Writes each row's prompt positions: {prompt token: its logprob} and the top-k of the position."""
        for seq, first, at, n in plp_rows:
            k = seq.params.prompt_logprobs
            for j in range(n):
                entry = {seq.prompt_ids[first + j]: float(lp[at + j])}
                if k:
                    for t, v in zip(top_ids[at + j, :k].tolist(), top_lp[at + j, :k].tolist()):
                        entry.setdefault(t, v)
                seq.prompt_logprobs[first + j] = entry

    def _token_stop(self, seq: Sequence, token: int) -> str | None:
        """`_check_stop` without the text, for a sequence with no stop strings: ends it on EOS or a stop token id
        ("stop"), its length limit ("length") or its grammar's end ("grammar"; finished as "stop") and returns
        that reason, else None. `_finish_lit` then writes the token's text as `_check_stop` would have."""
        p = seq.params
        num_output = len(seq.token_ids) - len(seq.prompt_ids)
        if num_output >= p.min_tokens and ((not p.ignore_eos and token in self.eos_token_ids)
                                           or token in p.stop_token_ids):
            self.scheduler.finish(seq, "stop")
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self.scheduler.finish(seq, "length")
            return "length"
        if seq.matcher is not None and seq.matcher.terminated:
            # the grammar took a stop token that does not stop this request by itself (ignore_eos): it is done
            self.scheduler.finish(seq, "stop")
            return "grammar"
        return None

    def _grammar_stop(self, seq: Sequence, text_before: str) -> None:
        """Ends `seq`, still running after `_check_stop`, whose grammar took a stop token that does not stop the
        request by itself (ignore_eos)."""
        matcher = seq.matcher
        if matcher is not None and not seq.is_finished and matcher.terminated:
            if not seq.params.include_stop_str_in_output:
                seq.text = text_before
            self._finish(seq, "stop", flush=seq.params.include_stop_str_in_output)

    def _check_stop(self, seq: Sequence, token: int, text_before: str) -> None:
        """Stops `seq` on EOS, a stop token id or a stop string (none of them before `min_tokens` tokens, as vLLM:
        a stop string must end past the text of the first `min_tokens`), or at its length limit. The text of the
        stop token and the stop string are dropped unless `include_stop_str_in_output`."""
        p = seq.params
        num_output = len(seq.token_ids) - len(seq.prompt_ids)
        if num_output == p.min_tokens:
            seq.stop_text_floor = len(seq.text)
        if num_output >= p.min_tokens and ((not p.ignore_eos and token in self.eos_token_ids)
                                           or token in p.stop_token_ids):
            if p.include_stop_str_in_output:
                return self._finish(seq, "stop")
            seq.text = text_before  # the stop token's text (EOS's is usually empty: a special token)
            return self._finish(seq, "stop", flush=False)
        if p.stop and seq.detok is not None and num_output > p.min_tokens:
            window = max(len(s) for s in p.stop) + 16
            start = max(0, len(seq.text) - window)
            # the first stop string that ends past the text of the first min_tokens tokens
            floor = seq.stop_text_floor
            hits = [(i, s) for s in p.stop if (i := seq.text.find(s, max(start, floor - len(s) + 1))) >= 0]
            if hits:
                i, s = min(hits)
                seq.text = seq.text[: i + len(s) if p.include_stop_str_in_output else i]
                return self._finish(seq, "stop", flush=False)
        if len(seq.output_ids) >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str, flush: bool = True) -> None:
        if seq.detok is not None and flush:
            seq.text += seq.detok.flush()
        self.scheduler.finish(seq, reason)

    def release(self, request_id: Any) -> None:
        """Forgets a finished request (its output was delivered)."""
        seq = self.requests.get(request_id)
        if seq is not None and seq.is_finished:
            del self.requests[request_id]

    # ----------------------------------------------------------------- failed steps
    # `safe_step()` confines an exception raised by a step to the request behind it. The step's work is dropped
    # and every unfinished sequence goes back to waiting, to be recomputed from its tokens (its blocks and slot
    # are freed); a request's samples depend on its seed and position only, so the tokens come out as before.
    # With one sequence in the failed step, that sequence fails. With several, each runs alone (max_num_seqs
    # 1) until it is past the point where the step failed, and the one that fails alone is the cause.
    MAX_FAILED_STEPS_IN_A_ROW = 8  # then the engine itself is broken (EngineFailure): the process should restart
    MAX_STRIKES = 4  # failed steps one sequence may take part in before it is failed as their cause (a backstop
    # for failures that need two requests together: each passes alone, and they would meet again forever)
    _failed_steps_in_a_row = 0
    _failed_steps_total = 0
    _strikes: dict | None = None  # seq_id -> (seq, failed steps it took part in)
    _suspects: dict | None = None  # seq_id -> (seq, tokens it had when the step failed); None: not isolating
    _saved_max_num_seqs: int | None = None

    def safe_step(self) -> tuple[list[Sequence], list[Sequence]]:
        """`step()` that survives a failing request: returns (sequences updated, sequences failed by this call,
        finished with finish_reason "error"). After a failed step "updated" holds every sequence the step touched
        (some may have got tokens or finished before it failed). Raises EngineFailure when the engine cannot go
        on: steps failed `MAX_FAILED_STEPS_IN_A_ROW` times in a row, or the device state did not survive."""
        updated: list[Sequence] = []
        try:
            updated = self.step()
            self._failed_steps_in_a_row = 0
            if self._suspects is not None:
                updated += self._advance_isolation()
        except Exception as e:  # noqa: BLE001 - whatever one step raised is confined here
            touched, failed = self._recover(e)
            return updated + [s for s in touched if s not in updated], failed
        return updated, []

    def fail_requests(self, request_ids, error: str) -> list[Sequence]:
        """Ends the given unfinished requests with finish_reason "error" (their blocks and slots are freed)."""
        failed = []
        for request_id in request_ids:
            seq = self.requests.get(request_id)
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, "error", error)
                failed.append(seq)
        return failed

    def _recover(self, error: Exception) -> tuple[list[Sequence], list[Sequence]]:
        sched = self.scheduler
        try:
            touched = self._finish_lit()  # a step whose tokens were taken: its text too
        except Exception:  # noqa: BLE001 - a detokenizer's fault as well: the other rows' text is written
            touched = []
        touched += [s for s in sched.running if s not in touched]
        for step in (self._older, self._prev):  # the steps in flight
            if step is not None:
                touched += [r.seq for r in step.sched.rows if r.seq not in touched]
        suspects = [s for s in touched if not s.is_finished]
        if not suspects and sched.waiting:  # schedule() failed on the sequence it was admitting
            suspects = [sched.waiting[0]]
        self._failed_steps_in_a_row += 1
        self._failed_steps_total += 1
        log.error("engine step failed (%d in a row) with %d sequences in it (%s): %r", self._failed_steps_in_a_row,
                  len(suspects), ", ".join(repr(s.request_id) for s in suspects[:8]), error, exc_info=error)
        if self._failed_steps_in_a_row >= self.MAX_FAILED_STEPS_IN_A_ROW:
            raise EngineFailure(f"{self._failed_steps_in_a_row} engine steps failed in a row, the last with "
                                f"{error!r}") from error
        reached = {s.seq_id: s.num_tokens for s in suspects}  # tokens it had, sampled or in flight
        self._requeue_all()
        strikes = self._strikes = {k: v for k, v in (self._strikes or {}).items() if not v[0].is_finished}
        for seq in suspects:
            strikes[seq.seq_id] = (seq, strikes.get(seq.seq_id, (seq, 0))[1] + 1)
        message = f"the engine failed while running this request: {type(error).__name__}: {error}"
        culprits = [s for s in suspects if len(suspects) == 1 or strikes[s.seq_id][1] >= self.MAX_STRIKES]
        for seq in culprits:
            sched.finish(seq, "error", message)
            strikes.pop(seq.seq_id, None)
            if self._suspects is not None:
                self._suspects.pop(seq.seq_id, None)
        rest = [s for s in suspects if s not in culprits]
        if rest:
            self._isolate({s.seq_id: (s, reached[s.seq_id]) for s in rest})
        elif self._suspects is not None:
            self._isolate({})
        return touched, culprits

    def _requeue_all(self) -> None:
        """Drops the device work in flight; every unfinished sequence goes back to waiting (running ones first,
        in order) with nothing computed; raises EngineFailure when the device state is gone."""
        from jhybrid.engine.sequence import Status

        sched = self.scheduler
        for step in (self._older, self._prev):
            if step is not None and step.accepted:  # its tokens reached the matchers: take them back
                rows = step.sched.rows
                for i, accepted in step.accepted.items():
                    if rows[i].seq.matcher is not None:
                        rows[i].seq.matcher.undo(accepted)
        self._older = self._prev = self._lit = None
        seqs = [s for s in [*sched.running, *sched.waiting] if not s.is_finished]
        sched.running.clear()
        sched.waiting.clear()
        for seq in seqs:
            if seq.num_computed or seq.block_table or seq.slot or seq.host_blocks:
                seq.num_preemptions += 1  # the runner keys its cached block table on this: the blocks change
            sched._release(seq)
            seq.num_computed = seq.num_pending = 0
            seq.status = Status.WAITING
        sched.waiting.extend(seqs)
        if sched.prefix is not None:  # what the failed step wrote is unknown
            sched.prefix.clear()
        try:
            for part in (self.swapper, self.offloader, self.prefix_mover):
                if part is not None:
                    part.flush()  # released host entries (and the cleared cache's moves) are skipped
            import jax

            try:  # a program call queued behind the failed one (a slot program) raises the same error again
                self.runner.drain()
            except Exception:  # noqa: BLE001 - the failed step's own error, handled above
                pass
            jax.block_until_ready(self.runner.state)
        except Exception as e:  # noqa: BLE001
            raise EngineFailure(f"the engine's device state did not survive a failed step: {e!r}") from e

    def _isolate(self, suspects: dict) -> None:
        """Runs `suspects` (and those still under suspicion) one at a time, before anything else."""
        sched = self.scheduler
        if self._suspects is None:
            self._suspects, self._saved_max_num_seqs = {}, sched.max_num_seqs
        self._suspects.update(suspects)
        if not self._suspects:
            return self._end_isolation()
        sched.max_num_seqs = 1
        first = [s for s in sched.waiting if s.seq_id in self._suspects]
        others = [s for s in sched.waiting if s.seq_id not in self._suspects]
        sched.waiting.clear()
        sched.waiting.extend(first + others)

    def _advance_isolation(self) -> list[Sequence]:
        """After a good step: a suspect that got past its failure point (or finished) is cleared; a cleared one
        that still runs is preempted (recompute), its step in flight read now, so that the next suspect runs
        alone. Returns the sequences that read updated."""
        from jhybrid.engine.sequence import Status

        sched = self.scheduler
        parked = False
        for seq_id, (seq, reached) in list(self._suspects.items()):
            if not seq.is_finished and len(seq.token_ids) <= reached:
                continue
            del self._suspects[seq_id]
            if self._suspects and seq in sched.running:
                sched.running.remove(seq)
                sched._release(seq)
                seq.num_computed, seq.status = 0, Status.WAITING
                seq.num_preemptions += 1
                at = sum(1 for s in sched.waiting if s.seq_id in self._suspects)
                sched.waiting.insert(at, seq)
                parked = True
        if not self._suspects:
            self._end_isolation()
        if not parked or (self._prev is None and self._older is None):
            return []
        updated = []
        for step in (self._older, self._prev):  # a failure of the next step then cannot be blamed on the parked one
            if step is not None:
                if step.needs_sampling:
                    self.runner.sample_split(step)
                updated += self._read(step)
        self._older = self._prev = None
        self._flush_transfers()
        return updated

    def _end_isolation(self) -> None:
        self.scheduler.max_num_seqs = self._saved_max_num_seqs
        self._suspects = self._saved_max_num_seqs = None


def _top_lists(result: StepResult) -> tuple[list | None, list | None]:
    """A step's top logprobs and their ids as Python lists (waits for them; None where no row asked): a row's
    entries are then plain ints and floats."""
    _, _, top_lp, top_ids = result.fetch()
    return (None, None) if top_lp is None else (top_lp.tolist(), top_ids.tolist())


def _bucket_name(key: tuple) -> str:
    """A step program's key as the logs name it: `decode:ROWS`, `mixed:TOKENS` (`+plp`: prompt logprobs),
    `decode:ROWSxSTEPSsteps:PLAN` (multi-step)."""
    decode, num_tokens, num_rows, *rest = key
    if len(rest) > 1:  # a multi-step decode program: (False, steps, sampler plan)
        return f"decode:{num_rows}x{rest[1]}steps:{rest[2].name}"
    return (f"decode:{num_rows}" if decode else f"mixed:{num_tokens}x{num_rows}") + ("+plp" if rest else "")


class EngineFailure(RuntimeError):
    """The engine cannot go on (its device state is gone, or its steps keep failing): restart the process."""

