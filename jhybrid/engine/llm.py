"""The offline API: `jhybrid.LLM(model).generate(prompts, SamplingParams(...))` and `.stream(...)`, and
`jhybrid.generate(model, prompts)`, a one-call wrapper over `LLM`."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

from jhybrid.engine.engine_config import EngineConfig, engine_config
from jhybrid.engine.llm_engine import LLMEngine
from jhybrid.engine.sampling import SamplingParams
from jhybrid.model_loader import LoadedModel, load


@dataclasses.dataclass
class RequestOutput:
    request_id: Any
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None = None  # per generated position: top-k {token id: logprob}
    # per prompt position (`SamplingParams.prompt_logprobs`): None at 0, then {prompt token and top-k: logprob}
    prompt_logprobs: list[dict[int, float] | None] | None = None
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
        prompt_logprobs=list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None,
        error=seq.error,
        num_preemptions=seq.num_preemptions,
    )


class LLM:
    """A model loaded for offline batched generation.

    Args:
      model: an HF or converted checkpoint directory (or a `LoadedModel`).
      config: the engine options, an `EngineConfig` (default: its defaults).
      **options: `EngineConfig` fields that replace `config`'s, e.g.
        `LLM(path, dtype="float32", max_num_seqs=64, max_model_len=4096)`. Each field's `help` metadata says
        what it does (`jhybrid serve --help` prints them all).
    """

    def __init__(self, model: str | os.PathLike | LoadedModel, config: EngineConfig | None = None, /, **options: Any):
        config = engine_config(config, **options)
        self.model = load(model, config.dtype, host=config.tensor_parallel_size > 1)
        self.engine = LLMEngine(self.model, config)
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


def _bucket(n: int, minimum: int = 16) -> int:
    """`n` rounded up to a power of two, at least `minimum`."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def generate(
    model: str | os.PathLike | LoadedModel,
    prompts: Sequence[str | Sequence[int]],
    *,
    max_tokens: int = 16,
    temperature: float = 0.0,
    dtype: str | None = None,
    seed: int = 0,
    ignore_eos: bool = False,
    max_num_batched_tokens: int | None = None,
):
    """Generates a continuation of each prompt (a string, or a list of token ids): a thin wrapper over
    `jhybrid.LLM`. Greedy when `temperature == 0`. Stops at `max_tokens` or at an EOS id of the checkpoint
    (config / generation_config.json) unless `ignore_eos`. Raises ValueError if any prompt is invalid.
    """
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos, seed=seed)
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]  # one prompt given bare
    m = load(model, dtype)
    lengths = [len(p) if not isinstance(p, str) else (len(m.tokenizer.encode(p)) if m.tokenizer else 1) for p in prompts]
    context = m.cfg.max_position_embeddings
    needed = max(lengths, default=1) + max_tokens
    if needed > context:
        raise ValueError(f"prompt ({max(lengths)} tokens) + max_tokens ({max_tokens}) exceeds the model's context ({context})")
    max_model_len = min(context, _bucket(needed, minimum=64))
    llm = LLM(m, dtype=None, max_num_seqs=min(16, max(1, len(prompts))), max_model_len=max_model_len, seed=seed,
              max_num_batched_tokens=max_num_batched_tokens)
    outputs = llm.generate(list(prompts), params)
    for i, out in enumerate(outputs):
        if out.error:
            raise ValueError(f"prompt {i}: {out.error}")
    return outputs
