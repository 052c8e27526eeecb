"""The offline API: `jhybrid.LLM(model).generate(prompts, SamplingParams(...))` and `.stream(...)`."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

from jhybrid.engine.llm_engine import LLMEngine
from jhybrid.engine.sampling import SamplingParams


@dataclasses.dataclass
class RequestOutput:
    request_id: Any
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None = None  # per generated position: top-k {token id: logprob}
    error: str | None = None
    num_preemptions: int = 0


def _output(seq) -> RequestOutput:
    return RequestOutput(
        request_id=seq.request_id,
        prompt_token_ids=list(seq.prompt_ids),
        token_ids=list(seq.output_ids),
        text=seq.text if seq.detok is not None else None,
        finish_reason=seq.finish_reason,
        logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        error=seq.error,
        num_preemptions=seq.num_preemptions,
    )


class LLM:
    """A model loaded for offline batched generation.

    Args:
      model: an HF or converted checkpoint directory (or a `LoadedModel`).
      dtype: parameter and KV dtype ("bfloat16", "float32", "float16"; None: the checkpoint's).
      max_num_seqs: sequences running at once (state slots).
      max_model_len: longest sequence (prompt + output); default min(model's context, 4096).
      block_size: tokens per KV page.
      num_kv_blocks: KV pages; None lets the memory planner size the pool from `memory_fraction`.
      memory_fraction: share of free device memory for the KV pool and the state slots.
      seed: seeds requests that give none.
      max_num_batched_tokens: token budget of one step (chunked prefill splits longer prompts).
      tensor_parallel_size: devices to shard the model over (a "tp" mesh over the first N of
        `jax.devices()`; `jhybrid.parallel`); N must divide the head counts.
      host_kv_memory_gb: host memory (GiB) for the KV and state of preempted sequences; 0: no host tier.
      preemption_mode: "auto" (swap to the host tier when the cost model says it is cheaper than recomputing),
        "swap" (whenever the host tier has room) or "recompute"; without a host tier, always recompute.
      swap_bandwidth_gbps, prefill_tokens_per_s: the cost model's rates; None measures them at start.
      swap_transfer: where swapped-out data waits: "pageable" (default; the host tier's NumPy arrays) or
        "pinned" (JAX's page-locked pinned_host memory, as JAX arrays, until swapped back in).
      kv_offload: "off" (default), "cpu" or "copy": running sequences may keep their oldest KV blocks in the
        host tier (needs host_kv_memory_gb > 0) instead of being preempted; attention over them runs on the
        CPU ("cpu") or on the GPU over copies sent each step ("copy"). `offload_overlap` pipelines the CPU
        part with the GPU's work (two sub-batches); `offload_threads` CPU attention workers. Blocks are
        offloaded so that running sequences need not be preempted; `offload_admission` also offloads to
        admit waiting ones (off by default: slower than waiting on the H200, benchmarks/RESULTS.md).
      offload_policy: "cost" (default): offload only where the cost model prices the rest of the sequence's
        host attention below the preemption it avoids; "always": whenever a running sequence would
        otherwise be preempted (on the H200 that ran 13x slower than recomputing, benchmarks/RESULTS.md).
      max_prefill_tokens_with_decodes: prefill tokens a step that carries decode rows may take beside them
        (default None: up to `max_num_batched_tokens`). Smaller keeps running requests' inter-token latency
        lower while prompts arrive, at a price: on the H200 a mixed step costs about 10 ms however few its
        prefill tokens, so a cap of 256 cut throughput at 64 streams from 8.2k to 3.0k tokens/s
        (benchmarks/RESULTS.md).
      warmup: compile every step program the scheduler can produce at start, on several threads
        (`LLMEngine.warmup`; sampling settings are runtime arrays, so this is the whole set), instead of the
        first time each is needed; then no step compiles.
    """

    def __init__(self, model: str | os.PathLike | Any, *, dtype: str | None = "bfloat16", max_num_seqs: int = 16,
                 max_model_len: int | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 memory_fraction: float = 0.9, seed: int = 0, max_num_batched_tokens: int | None = None,
                 tensor_parallel_size: int = 1,
                 host_kv_memory_gb: float = 0.0, preemption_mode: str = "auto", swap_bandwidth_gbps: float | None = None,
                 prefill_tokens_per_s: float | None = None, swap_transfer: str = "pageable", kv_offload: str = "off",
                 offload_overlap: bool = True, offload_threads: int | None = None, offload_admission: bool = False,
                 offload_policy: str = "cost", max_prefill_tokens_with_decodes: int | None = None,
                 warmup: bool = False):
        from jhybrid.engine.generate import load

        self.model = load(model, dtype, host=tensor_parallel_size > 1)
        self.engine = LLMEngine(self.model, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                block_size=block_size, num_kv_blocks=num_kv_blocks, memory_fraction=memory_fraction,
                                seed=seed, max_num_batched_tokens=max_num_batched_tokens,
                                tensor_parallel_size=tensor_parallel_size,
                                host_kv_memory_gb=host_kv_memory_gb, preemption_mode=preemption_mode,
                                swap_bandwidth_gbps=swap_bandwidth_gbps, prefill_tokens_per_s=prefill_tokens_per_s,
                                swap_transfer=swap_transfer, kv_offload=kv_offload, offload_overlap=offload_overlap,
                                offload_threads=offload_threads, offload_admission=offload_admission,
                                offload_policy=offload_policy,
                                max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes, warmup=warmup)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt together (continuous batching); outputs come in prompt order."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        seqs = [self.engine.add_request(f"gen-{next(self._ids)}", p, sp or SamplingParams()) for p, sp in zip(prompts, params)]
        try:
            while self.engine.has_unfinished():
                self.engine.step()
        except BaseException:
            for seq in seqs:
                self.engine.abort(seq.request_id)
            self._drain()
            raise
        outputs = [_output(seq) for seq in seqs]
        for seq in seqs:
            self.engine.release(seq.request_id)
        return outputs

    def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas as they are decoded. Text that might start a stop string is held back until it
        is clear that it does not; the stop string itself is never yielded."""
        params = sampling_params or SamplingParams()
        seq = self.engine.add_request(f"stream-{next(self._ids)}", prompt, params)
        if seq.detok is None and not seq.is_finished:
            self.engine.abort(seq.request_id)
            raise ValueError("streaming text needs a tokenizer; use generate() for token ids")
        if seq.error:
            raise ValueError(seq.error)
        holdback = max((len(s) for s in params.stop), default=1) - 1
        sent = 0
        try:
            while not seq.is_finished:
                self.engine.step()
                safe = len(seq.text) - holdback if not seq.is_finished else len(seq.text)
                if safe > sent:
                    yield seq.text[sent:safe]
                    sent = safe
            if len(seq.text) > sent:
                yield seq.text[sent:]
        finally:
            if not seq.is_finished:
                self.engine.abort(seq.request_id)
            self._drain()
            self.engine.release(seq.request_id)

    def _drain(self) -> None:
        """Runs the engine until nothing is in flight (after aborts)."""
        while self.engine.has_unfinished() and not self.engine.scheduler.has_work():
            self.engine.step()
