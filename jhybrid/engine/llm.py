"""The offline API, shaped as vLLM's: `jhybrid.LLM(model).generate(prompts, SamplingParams(...))`, `.chat(...)`
and `.stream(...)`, and `jhybrid.generate(model, prompts)`, a one-call wrapper over `LLM`.

    llm = jhybrid.LLM("dir", gpu_memory_utilization=0.8, max_model_len=4096)
    outs = llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": [1, 2, 3]}], [SamplingParams(n=2), sp])
    outs[0].outputs[1].text, outs[0].outputs[1].cumulative_logprob, outs[1].outputs[0].stop_reason
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from jhybrid.engine.engine_config import EngineConfig, engine_config, offline_defaults
from jhybrid.engine.llm_engine import LLMEngine
from jhybrid.engine.outputs import CompletionOutput, Logprob, RequestOutput, _Decoder, completion_output, prompt_logprobs
from jhybrid.engine.progress import Progress
from jhybrid.engine.prompts import continue_final, conversations, parse_prompts, template_message
from jhybrid.engine.sampling import SamplingParams
from jhybrid.engine.vllm_options import translate
from jhybrid.model_loader import LoadedModel, load

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "generate"]


class LLM:
    """A model loaded for offline batched generation.

    Args:
      model: an HF or converted checkpoint directory (or a `LoadedModel`); also as `model=`.
      config: the engine options, an `EngineConfig` (default: its defaults).
      **options: `EngineConfig` fields that replace `config`'s, e.g.
        `LLM(path, dtype="float32", max_num_seqs=64, max_model_len=4096, gpu_memory_utilization=0.8)`. Each field's
        `help` metadata says what it does (`jhybrid serve --help` prints them all); `num_scheduler_steps` not given
        is 8 on a GPU, 1 elsewhere (`engine_config.offline_defaults`). vLLM's other constructor
        options are taken as `jhybrid.engine.vllm_options` says: translated (`dtype="auto"`,
        `num_gpu_blocks_override`), logged where they change nothing here (`enforce_eager`, `swap_space`, ...), or
        refused naming the option where they would change the output (`quantization`, `tokenizer`, ...).
    """

    def __init__(self, model: str | os.PathLike | LoadedModel | None = None, config: EngineConfig | None = None, /,
                 **options: Any):
        if model is None:
            if "model" not in options:
                raise TypeError("LLM() needs a model: a checkpoint directory or a LoadedModel")
            model = options.pop("model")
        config = engine_config(config, **translate(model, options))
        steps_by_default = config.num_scheduler_steps is None
        # offline: multi-step decode on a GPU unless num_scheduler_steps is given (`offline_defaults`)
        config = offline_defaults(config, jax.default_backend())
        self.model_dir = None if isinstance(model, LoadedModel) else os.fspath(model)
        self.model = load(model, config.dtype, host=config.tensor_parallel_size > 1,
                          quantization=config.quantization, tensor_parallel_size=config.tensor_parallel_size)
        self.engine = LLMEngine(self.model, config)
        # the default's multi-step programs compile on a thread of their own when first wanted, plain steps running
        # meanwhile: a batch that shrinks through several row buckets pays no compile for them on its way
        self.engine.runner.burst_background = steps_by_default
        self._ids = itertools.count()
        self._chat_template: Any = None  # the checkpoint's, loaded on the first chat()

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def get_tokenizer(self):
        return self.model.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no `SamplingParams`: the checkpoint's generation_config.json
        sampling defaults (as vLLM's), else `SamplingParams()`'s."""
        return self.engine.default_sampling_params

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Any = True,
        lora_request: Any = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt together (continuous batching); returns one `RequestOutput` per prompt, in
        prompt order.

        Args:
          prompts: a string, a list of token ids, a vLLM prompt dict (`{"prompt": str}`,
            `{"prompt_token_ids": [...]}`), or a list of these.
          sampling_params: one `SamplingParams` for every prompt, or a list of one per prompt (None: the defaults).
            With `n` / `best_of`, each of a prompt's `best_of` candidates is an engine request of its own (seeded
            `seed + i` when the params have a seed); `outputs` holds `n` of them: all of them in order when
            `best_of == n`, else the n of highest cumulative log-probability, highest first.
          use_tqdm: show a progress bar over the prompts (or a tqdm-like class to make it with).
          lora_request, priority: vLLM's; only None (or priority 0) is supported.
        """
        if lora_request is not None:
            raise ValueError("lora_request is not supported by jhybrid (no LoRA adapters)")
        if priority is not None and any(priority):
            raise ValueError("priority is not supported by jhybrid (first come, first served)")
        return self._run(parse_prompts(prompts), sampling_params, use_tqdm)

    def chat(
        self,
        messages: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Any = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generates a reply to one conversation (a list of `{"role", "content"}` messages) or to each of a list
        of them: each is rendered with the chat template (the checkpoint's: `chat_template.jinja` or
        tokenizer_config.json's; or `chat_template`, a jinja template or a file), tokenized without added special
        tokens (the template has them), and generated as `generate` does. `RequestOutput.prompt` is the rendered
        text. `tools` and `chat_template_kwargs` are passed to the template. Raises ValueError when there is no
        chat template or the template rejects a conversation."""
        from jhybrid.server.chat_template import ChatTemplateError

        if lora_request is not None or mm_processor_kwargs is not None:
            raise ValueError(f"{'lora_request' if lora_request is not None else 'mm_processor_kwargs'} is not "
                             "supported by jhybrid")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got "
                             f"{chat_template_content_format!r}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible: set "
                             "add_generation_prompt=False to continue the final message")
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer: this checkpoint has none")
        template = self._template(chat_template)
        kwargs = dict(chat_template_kwargs or {}, **({"tools": tools} if tools is not None else {}))
        prompts = []
        for i, conversation in enumerate(conversations(messages)):
            msgs = [template_message(m, chat_template_content_format) for m in conversation]
            try:
                text = template.render(msgs, add_generation_prompt=add_generation_prompt, **kwargs)
            except ChatTemplateError as e:
                raise ValueError(f"conversation {i}: {e}") from None
            if continue_final_message:
                text = continue_final(text, msgs)
            prompts.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(prompts, sampling_params, use_tqdm)

    def _template(self, override: str | None):
        from jhybrid.server.chat_template import ChatTemplate, load_chat_template

        if override is not None:
            if self.model_dir is not None:  # with the checkpoint's special tokens (bos_token, ...)
                return load_chat_template(self.model_dir, override)
            if os.path.isfile(override):
                with open(override) as f:
                    return ChatTemplate(f.read())
            return ChatTemplate(override)
        if self._chat_template is None and self.model_dir is not None:
            self._chat_template = load_chat_template(self.model_dir)
        if self._chat_template is None:
            where = f"the checkpoint {self.model_dir}" if self.model_dir else "a model given as a LoadedModel"
            raise ValueError(f"{where} has no chat template (neither chat_template.jinja nor tokenizer_config.json's "
                             "chat_template): pass chat_template= (a jinja template or a file), or use generate()")
        return self._chat_template

    def _run(self, prompts: list[tuple[str | None, str | Sequence[int]]], sampling_params, use_tqdm) -> list[RequestOutput]:
        """Runs every prompt's candidates to the end; the outputs in prompt order."""
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
        groups = []  # per prompt: (request id, its params, its candidates' sequences)
        try:
            for (_, prompt), sp in zip(prompts, params):
                sp = sp or self.get_default_sampling_params()
                request_id = str(next(self._ids))
                best_of, seqs = sp.best_of or sp.n, []
                groups.append((request_id, sp, seqs))
                for k in range(best_of):
                    seqs.append(self.engine.add_request(request_id if best_of == 1 else f"{request_id}.{k}", prompt,
                                                        _candidate(sp, k, best_of)))
            with Progress(use_tqdm, [seqs for _, _, seqs in groups]) as bar:
                while self.engine.has_unfinished():
                    self.engine.step()
                    bar.advance()
        except BaseException:
            for _, _, seqs in groups:
                for seq in seqs:
                    self.engine.abort(seq.request_id)
            self._drain()
            self._release(groups)
            raise
        decode = _Decoder(self.tokenizer)
        outputs = [self._output(request_id, text, sp, seqs, decode)
                   for (text, _), (request_id, sp, seqs) in zip(prompts, groups)]
        self._release(groups)
        return outputs

    def _output(self, request_id: str, text: str | None, sp: SamplingParams, seqs, decode) -> RequestOutput:
        eos = self.engine.eos_token_ids
        candidates = [completion_output(seq, k, eos, decode) for k, seq in enumerate(seqs)]
        if len(candidates) > sp.n:  # best_of > n: the n most likely (failed ones last), ties in index order
            candidates = sorted(candidates, key=lambda c: (c.finish_reason == "error", -c.cumulative_logprob))[: sp.n]
        first = seqs[0]
        return RequestOutput(
            request_id=request_id, prompt=text, prompt_token_ids=list(first.prompt_ids),
            prompt_logprobs=prompt_logprobs(first.prompt_logprobs, first.prompt_ids, sp.prompt_logprobs or 0, decode),
            outputs=candidates, finished=all(seq.is_finished for seq in seqs), num_cached_tokens=first.num_cached_tokens)

    def _release(self, groups) -> None:
        for _, _, seqs in groups:
            for seq in seqs:
                self.engine.release(seq.request_id)

    def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yields text deltas as they are decoded. Text that might start a stop string is held back until it
        is clear that it does not; the stop string itself is never yielded. One completion: `n` and `best_of` must be 1."""
        parsed = parse_prompts(prompt)
        if len(parsed) != 1:
            raise ValueError(f"stream() takes one prompt, got {len(parsed)}: use generate() for several")
        prompt = parsed[0][1]
        params = sampling_params or self.get_default_sampling_params()
        if params.n > 1 or (params.best_of or 1) > 1:
            raise ValueError(f"stream() yields one completion; got n={params.n}, best_of={params.best_of}: use "
                             "generate() for several")
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


def _candidate(sp: SamplingParams, k: int, best_of: int) -> SamplingParams:
    """The params of candidate `k` of `best_of`: one sequence, seeded `seed + k` (as vLLM and the server seed
    them) so that candidates differ and a seeded request is reproducible; the first alone computes the prompt's
    log-probabilities (they are the same for all)."""
    if best_of == 1:
        return sp
    seed = None if sp.seed is None else (sp.seed + k) % 2**32
    return dataclasses.replace(sp, n=1, best_of=None, seed=seed, prompt_logprobs=sp.prompt_logprobs if k == 0 else None)


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
