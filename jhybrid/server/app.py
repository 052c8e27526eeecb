"""The OpenAI-compatible FastAPI app over an `AsyncEngine`.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream with `"stream": true`), GET /v1/models,
GET /health, GET /metrics, GET /version. Every /v1 route checks the API key when one is set.

A request is checked in this order, each failure an OpenAI-style error that touches nothing else:
API key (401) -> `Content-Type: application/json` (415) -> body size (413) and read timeout (408) -> JSON
and field types / ranges (400, naming the field; fields that would change the output and are not
implemented, 400) -> model name (404) -> chat template present (400) -> prompt tokens: empty, out of
vocabulary, longer than the context, or prompt + max_tokens beyond it (400) -> sequences per request
(prompts x best_of, 400) -> the engine's waiting queue (503 with Retry-After when full or shutting down).
Each candidate (prompt x best_of, best_of defaulting to n) is one engine request; with best_of > n the n
candidates of highest cumulative log-probability are returned. Log-probabilities as OpenAI and vLLM return them
(`jhybrid.server.logprobs`): completions `logprobs: k` (with `echo`, the prompt's too, computed by the engine as
`prompt_logprobs`; `max_tokens: 0` with echo generates one token and shows none), chat `logprobs` + `top_logprobs`,
streamed per chunk and not. Sampling controls (penalties, min_p, min_tokens, bad_words, allowed_token_ids,
include_stop_str_in_output, ...) go to the engine in each candidate's SamplingParams; fields a request leaves out
take `ServerConfig.generation_defaults` (the checkpoint's generation_config.json, as vLLM's `--generation-config
auto`). Tools (`tools`, `tool_choice`, `parallel_tool_calls`; `jhybrid.server.tools`): the tools reach the chat
template; with tool_choice "auto" the server's parser (`ServerConfig.tool_call_parser`, `tool_parsers.py`) turns the
calls the model writes into `message.tool_calls` (streamed as `delta.tool_calls`) and finish_reason "tool_calls";
"required" and a named function are enforced by structured output. A client that disconnects aborts all of its
requests. An unexpected exception while handling a request answers 500 for that request alone.
CORS is off unless `allowed_origins` names origins.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jhybrid.engine import sampling
from jhybrid.engine.sampling import SamplingParams, bad_words_token_ids
from jhybrid.engine.slot_tables import ban_rows
from jhybrid.server.async_engine import Delta, AsyncEngine, EngineDeadError, EngineDrainingError, EngineOverloadedError
from jhybrid.server.chat_template import ChatTemplate, ChatTemplateError
from jhybrid.server.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from jhybrid.server.http import (ClientDisconnected, EventStream, HTTPMetricsMiddleware, check_api_key, error_response,
                                 read_body, require_json, sse, unless_disconnected)
from jhybrid.server.tool_parsers import PARSERS, collect
from jhybrid.server.tools import ToolPlan, template_tools, tool_plan
from jhybrid.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    validation_error,
)

log = logging.getLogger("jhybrid.server")

ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/version",
                    "/tokenize", "/detokenize"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """What the app serves. `model_names[0]` is the name responses carry; requests may use any of them."""

    model_names: tuple[str, ...]
    api_key: str | None = None
    chat_template: ChatTemplate | None = None
    max_body_bytes: int = 1 << 20
    default_completion_tokens: int = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
    max_seqs_per_request: int = 128  # engine requests one HTTP request may create (prompts x best_of); OpenAI's n <= 128
    body_timeout: float | None = 30.0  # seconds for the whole request body to arrive (408 after)
    allowed_origins: tuple[str, ...] = ()  # CORS: origins whose pages may call the API ("*": any); none by default
    # SamplingParams defaults for fields a request leaves out (`jhybrid.model_loader.generation_defaults`: the
    # checkpoint's generation_config.json, as vLLM's `--generation-config auto`); None: the engine's
    # `generation_defaults` if it has them, else none
    generation_defaults: Mapping[str, Any] | None = None
    # tool calling (vLLM's flags): tool_choice "auto" needs `enable_auto_tool_choice` and a parser, one of
    # `tool_parsers.PARSERS` (hermes, qwen3_coder, minimax)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self):
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"unknown tool call parser {self.tool_call_parser=}; known: {', '.join(sorted(PARSERS))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser NAME: "
                             f"{', '.join(sorted(PARSERS))})")
        if not self.model_names:
            raise ValueError("ServerConfig needs at least one model name")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes=}")
        if self.max_seqs_per_request < 1:
            raise ValueError(f"max_seqs_per_request must be positive, got {self.max_seqs_per_request=}")
        if self.body_timeout is not None and not self.body_timeout > 0:
            raise ValueError(f"body_timeout must be positive (or None), got {self.body_timeout=}")


LOOP_LAG_PERIOD = 0.005


async def _watch_loop_lag(histogram, period: float = LOOP_LAG_PERIOD) -> None:
    """Observes how late the event loop wakes a timer set `period` ahead: while the loop runs something else
    (parsing a burst of requests, tokenizing, a long callback) no stream gets its tokens, and this shows for how
    long. 200 wake-ups a second cost the loop well under 1% of a core."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + period
        await asyncio.sleep(period)
        histogram.observe(max(0.0, loop.time() - due))


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The app; it starts `engine` on startup if it is not running. Stopping the engine is the caller's job."""
    from jhybrid import __version__

    async def lifespan(app):
        engine.start()
        monitor = asyncio.create_task(_watch_loop_lag(engine.metrics.loop_lag))
        try:
            yield
        finally:
            monitor.cancel()

    app = FastAPI(title="jhybrid", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(HTTPMetricsMiddleware, counter=engine.metrics.http, routes=ROUTES)
    if config.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, e: Exception):  # this request fails; the server goes on
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(APIError(500, f"the server failed on this request: {type(e).__name__}: {e}",
                                       code="internal_error"))

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        code = "not_found" if e.status_code == 404 else None
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code))

    @app.exception_handler(RequestValidationError)
    async def fastapi_validation_error(request: Request, e: RequestValidationError):
        return error_response(APIError(400, f"invalid request: {e.errors()[0].get('msg')}"))

    serving = _Serving(engine, config)

    @app.get("/health")
    async def health():
        if not engine.is_alive:
            return error_response(APIError(503, f"the engine is not running: {engine.failure!r}"))
        if not engine.accepting:
            return error_response(APIError(503, "the server is shutting down", code="shutting_down"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        engine.refresh_gauges()
        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request, config.api_key)
        created = int(serving.started)
        cards = [{"id": name, "object": "model", "created": created, "owned_by": "jhybrid",
                  "max_model_len": engine.max_model_len} for name in config.model_names]
        return {"object": "list", "data": cards}

    async def body_of(request: Request, model):
        check_api_key(request, config.api_key)
        require_json(request)
        return _parse(model, await read_body(request, config.max_body_bytes, config.body_timeout))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.completions(request, await body_of(request, CompletionRequest))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.chat(request, await body_of(request, ChatCompletionRequest))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return serving.tokenize(await body_of(request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return serving.detokenize(await body_of(request, DetokenizeRequest))

    return app


def _parse(model, body: bytes):
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None
    if hasattr(req, "check_supported"):
        req.check_supported()
    return req


class _Choices:
    """The engine requests of one HTTP request: choice i's deltas arrive as (i, Delta) on one queue."""

    def __init__(self, engine: AsyncEngine, base_id: str, prompts: list[list[int]], params: list[SamplingParams]):
        self.engine, self.sink = engine, asyncio.Queue()
        self.ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        self.open = set()
        try:
            engine.submit_batch([(self.ids[i], ids, p, i) for i, (ids, p) in enumerate(zip(prompts, params))], self.sink)
        except EngineOverloadedError as e:
            raise APIError(503, str(e), code="server_overloaded", headers={"Retry-After": str(e.retry_after)}) from None
        except EngineDrainingError as e:
            raise APIError(503, str(e), code="shutting_down", headers={"Retry-After": "5", "Connection": "close"}) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead") from None
        self.open = set(range(len(prompts)))

    async def __aiter__(self):
        """Yields (choice index, delta). Deltas that queued up while the consumer was busy (writing to a slow
        client, or this event loop behind the engine) come merged, one per choice, so a loaded server writes
        fewer, larger events instead of falling further behind."""
        while self.open:
            items = [await self.sink.get()]
            while not self.sink.empty():
                items.append(self.sink.get_nowait())
            for i, delta in _merge_deltas(items):
                if delta.finished:
                    self.open.discard(i)
                yield i, delta

    def close(self) -> None:
        """Aborts the requests still open (a no-op for finished ones)."""
        for i in self.open:
            self.engine.abort(self.ids[i])
        self.open = set()


def _merge_deltas(items: list[tuple[int, Delta]]) -> list[tuple[int, Delta]]:
    """Consecutive deltas of one choice as one (text, token ids and their logprobs joined, the prompt's logprobs
    from the first, the rest from the later one), in the order their choices first appear."""
    merged: dict[int, Delta] = {}
    for i, delta in items:
        before = merged.get(i)
        merged[i] = delta if before is None else dataclasses.replace(
            delta, text=before.text + delta.text, token_ids=before.token_ids + delta.token_ids,
            token_logprobs=before.token_logprobs + delta.token_logprobs,
            logprobs=None if delta.logprobs is None else (before.logprobs or ()) + delta.logprobs,
            prompt_logprobs=before.prompt_logprobs if before.prompt_logprobs is not None else delta.prompt_logprobs)
    return list(merged.items())


@dataclasses.dataclass
class _Output:
    """What one engine request returned, gathered from its deltas."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    token_logprobs: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    prompt_logprobs: tuple | None = None
    final: Delta | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.token_logprobs += delta.token_logprobs
        self.logprobs += delta.logprobs or ()
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.final = delta


def _entries(token_ids, token_logprobs, tops) -> list[dict[int, float]]:
    """Generated tokens' {token id: logprob}: the token first, then its top ones."""
    tops = tops or [{}] * len(token_ids)
    return [{t: lp, **{a: v for a, v in top.items() if a != t}} for t, lp, top in zip(token_ids, token_logprobs, tops)]


def _engine_generation_defaults(engine: AsyncEngine) -> dict[str, Any]:
    """The sampling defaults of the model behind `engine`: its front end's `generation_defaults` where it has them,
    else the LLMEngine's (an engine on a thread), else read from the checkpoint an engine process runs."""
    backend = getattr(engine, "backend", None)
    for source in (engine, backend, getattr(backend, "engine", None)):
        defaults = getattr(source, "generation_defaults", None)
        if isinstance(defaults, Mapping):
            return dict(defaults)
    model = getattr(getattr(backend, "spec", None), "model", None)
    if isinstance(model, str) and os.path.isdir(model):
        from jhybrid.model_loader import generation_defaults

        return generation_defaults(model)
    return {}


class _Serving:
    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.started = time.time()
        defaults = config.generation_defaults
        self.generation_defaults: dict[str, Any] = dict(defaults if defaults is not None else
                                                        _engine_generation_defaults(engine))
        if self.generation_defaults:
            log.info("sampling defaults for fields a request leaves out (the checkpoint's generation_config.json): %s",
                     ", ".join(f"{k}={v}" for k, v in self.generation_defaults.items()))

    # ----------------------------------------------------------------- checks shared by both endpoints
    def _model_name(self, requested: str | None) -> str:
        if requested is not None and requested not in self.config.model_names:
            served = ", ".join(f"`{n}`" for n in self.config.model_names)
            raise APIError(404, f"the model `{requested}` does not exist; this server serves {served}",
                           param="model", code="model_not_found")
        return self.config.model_names[0]

    def _check_ids(self, ids: list[int], param: str) -> None:
        vocab, context = self.engine.vocab_size, self.engine.max_model_len
        if not ids:
            raise APIError(400, f"{param}: the prompt is empty (0 tokens)", param=param, code="invalid_value")
        if min(ids) < 0 or max(ids) >= vocab:
            raise APIError(400, f"{param}: token ids must lie in [0, {vocab}), got {min(ids)}..{max(ids)}",
                           param=param, code="invalid_value")
        if len(ids) >= context:
            raise APIError(400, f"{param}: this model's maximum context length is {context} tokens, but the prompt "
                           f"has {len(ids)} tokens", param=param, code="context_length_exceeded")

    def _max_tokens(self, requested: int | None, num_prompt: int, default: int | None) -> int:
        room = self.engine.max_model_len - num_prompt
        if requested is None:
            return min(default or room, room)
        if requested > room:
            raise APIError(400, f"max_tokens: this model's maximum context length is {self.engine.max_model_len} tokens, "
                           f"but {num_prompt + requested} were requested ({num_prompt} in the prompt, {requested} for "
                           "the completion); lower max_tokens or shorten the prompt", param="max_tokens",
                           code="context_length_exceeded")
        return requested

    def _token_fields(self, req) -> tuple[dict[int, float] | None, tuple[int, ...]]:
        """`logit_bias` with int keys and `stop_token_ids`, both checked against the vocabulary."""
        vocab = self.engine.vocab_size
        bias = {int(k): float(v) for k, v in req.logit_bias.items()} if req.logit_bias else None
        if bias:
            limit = getattr(sampling, "MAX_LOGIT_BIAS", 300)
            if len(bias) > limit:
                raise APIError(400, f"logit_bias: {len(bias)} entries; at most {limit} are supported",
                               param="logit_bias", code="invalid_value")
            if max(bias) >= vocab:
                raise APIError(400, f"logit_bias: token id {max(bias)} is outside the vocabulary [0, {vocab})",
                               param="logit_bias", code="invalid_value")
        stop_ids = tuple(req.stop_token_ids or ())
        if stop_ids and not all(0 <= t < vocab for t in stop_ids):
            bad = next(t for t in stop_ids if not 0 <= t < vocab)
            raise APIError(400, f"stop_token_ids: token id {bad} is outside the vocabulary [0, {vocab})",
                           param="stop_token_ids", code="invalid_value")
        return bias, stop_ids

    def _sampling_fields(self, req, chat: bool, structured=None) -> dict[str, Any]:
        """The request's SamplingParams fields but max_tokens and seed; a field the request leaves out takes the
        checkpoint's generation_config.json default (`generation_defaults`), else the engine's."""
        bias, stop_ids = self._token_fields(req)
        defaults = self.generation_defaults
        fields: dict[str, Any] = {}
        for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
            value = getattr(req, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                fields[name] = value
        top_k = fields.pop("top_k", 0) or 0
        fields["top_k"] = 0 if top_k >= self.engine.vocab_size else top_k
        if bias:
            fields["logit_bias"] = bias
        if chat and req.logprobs:
            fields["logprobs"] = req.top_logprobs or 0
        elif not chat and req.logprobs is not None:
            fields["logprobs"] = req.logprobs
            if req.echo:
                fields["prompt_logprobs"] = req.logprobs
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name) is not None:
                fields[name] = getattr(req, name)
        if req.allowed_token_ids is not None:
            vocab = self.engine.vocab_size
            if bad := [t for t in req.allowed_token_ids if t >= vocab]:
                raise APIError(400, f"allowed_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})",
                               param="allowed_token_ids", code="invalid_value")
            fields["allowed_token_ids"] = tuple(req.allowed_token_ids)
        if req.bad_words:
            fields["bad_words"] = tuple(req.bad_words)
        if structured is not None:
            fields["structured_outputs"] = structured
        fields.update(stop=req.stop_list, stop_token_ids=stop_ids, ignore_eos=req.ignore_eos,
                      skip_special_tokens=req.skip_special_tokens, min_tokens=req.min_tokens,
                      include_stop_str_in_output=req.include_stop_str_in_output)
        return fields

    def _check_bans(self, params: SamplingParams) -> None:
        """400 for bad words that do not fit the engine's ban table (too many tokens, too many of them)."""
        if not params.bad_words:
            return
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "bad_words: this model has no tokenizer to turn them into tokens", param="bad_words",
                           code="invalid_value")
        try:
            ban_rows(params, bad_words_token_ids(tokenizer, params.bad_words), (), self.engine.vocab_size)
        except ValueError as e:
            raise APIError(400, str(e), param="bad_words", code="invalid_value") from None

    def _params(self, fields: dict[str, Any], req, max_tokens: int, choice: int) -> SamplingParams:
        max_tokens = max(max_tokens, 1)  # 0 (echo alone): one token is generated and dropped, as vLLM does
        try:
            return SamplingParams(max_tokens=max_tokens, seed=None if req.seed is None else (req.seed + choice) % 2**32,
                                  **fields)
        except (TypeError, ValueError) as e:
            field = str(e).split(" ", 1)[0]
            raise APIError(400, str(e), param=field if field in fields or field == "max_tokens" else None,
                           code="invalid_value") from None

    def _encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if self.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        try:
            return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except Exception as e:  # noqa: BLE001 - fails this request only
            log.exception("the tokenizer failed")
            raise APIError(500, f"the tokenizer failed on this prompt: {type(e).__name__}: {e}",
                           code="tokenizer_error") from None

    # ----------------------------------------------------------------- endpoints
    def tokenize(self, req: TokenizeRequest) -> dict:
        self._model_name(req.model)
        ids = self._encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": None}

    def detokenize(self, req: DetokenizeRequest) -> dict:
        self._model_name(req.model)
        if self.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="tokens")
        vocab = self.engine.vocab_size
        if req.tokens and not all(0 <= t < vocab for t in req.tokens):
            bad = next(t for t in req.tokens if not 0 <= t < vocab)
            raise APIError(400, f"tokens: token id {bad} is outside the vocabulary [0, {vocab})", param="tokens",
                           code="invalid_value")
        return {"prompt": self._decode(req.tokens)}

    async def completions(self, request: Request, req: CompletionRequest):
        model = self._model_name(req.model)
        p = req.prompt
        prompts = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        ids_list = [self._encode(x) if isinstance(x, str) else list(x) for x in prompts]
        for ids in ids_list:
            self._check_ids(ids, "prompt")
        default = self.config.default_completion_tokens
        if (gen := self.generation_defaults.get("max_tokens")) is not None:
            default = min(default, gen) if default else gen
        max_tokens = [self._max_tokens(req.max_tokens, len(ids), default) for ids in ids_list]
        echo = [(x if isinstance(x, str) else self._decode(x)) if req.echo else "" for x in prompts]
        return await self._generate(request, req, model, "cmpl", ids_list, max_tokens, echo, chat=False)

    async def chat(self, request: Request, req: ChatCompletionRequest):
        model = self._model_name(req.model)
        template = self.config.chat_template
        if template is None:
            raise APIError(400, f"the model `{model}` has no chat template (neither tokenizer_config.json's "
                           "chat_template nor chat_template.jinja): use /v1/completions, or start the server with "
                           "--chat-template FILE", param="messages", code="no_chat_template")
        kwargs = dict(req.chat_template_kwargs or {})
        if "tools" in kwargs:
            raise APIError(400, "chat_template_kwargs: send the tools as the request's `tools`, not as a template "
                           "variable", param="chat_template_kwargs", code="invalid_value")
        plan = tool_plan(req, enable_auto=self.config.enable_auto_tool_choice, parser=self.config.tool_call_parser)
        try:
            text = template.render([m.for_template() for m in req.messages], tools=template_tools(req),
                                   add_generation_prompt=req.add_generation_prompt, **kwargs)
        except ChatTemplateError as e:
            raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from None
        ids = self._encode(text, add_special_tokens=False)
        self._check_ids(ids, "messages")
        max_tokens = self._max_tokens(req.max_new_tokens, len(ids), self.generation_defaults.get("max_tokens"))
        return await self._generate(request, req, model, "chatcmpl", [ids], [max_tokens], [""], chat=True, tools=plan)

    def _decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids) if self.engine.tokenizer is not None else ""

    def _count(self, req, ids_list: list[list[int]]) -> int:
        """Candidates per prompt (best_of, default n), after the per-request limits."""
        n, best_of = req.n, req.best_of if req.best_of is not None else req.n
        if best_of < n:
            raise APIError(400, f"best_of: must be >= n, got best_of={best_of} and n={n}", param="best_of",
                           code="invalid_value")
        if req.stream and best_of > n:
            raise APIError(400, f"best_of: best_of > n (best_of={best_of}, n={n}) cannot be streamed: the best "
                           "candidates are known only at the end", param="best_of", code="invalid_value")
        num_seqs, limit = len(ids_list) * best_of, self.config.max_seqs_per_request
        if num_seqs > min(limit, self.engine.max_waiting_requests):
            param = "prompt" if len(ids_list) > 1 else ("best_of" if req.best_of is not None else "n")
            raise APIError(400, f"{param}: this request asks for {num_seqs} sequences ({len(ids_list)} prompts x "
                           f"{'best_of' if req.best_of is not None else 'n'}={best_of}); the server's limit is "
                           f"{min(limit, self.engine.max_waiting_requests)} per request", param=param,
                           code="too_many_sequences")
        num_tokens = best_of * sum(len(ids) for ids in ids_list)
        if num_tokens > self.engine.max_queued_tokens:
            raise APIError(400, f"prompt: this request queues {num_tokens} prompt tokens; the server's limit is "
                           f"{self.engine.max_queued_tokens}", param="prompt", code="too_many_tokens")
        return best_of

    async def _constraint(self, req, tools: ToolPlan | None):
        """The request's StructuredOutputsParams (None: free text): the tool plan's schema or the request's
        constraint. Built on a worker thread: the first one imports xgrammar (and torch, ~17 s on a 2-core CPU)
        and each checks its grammar with the library, which must not hold up the event loop's other requests."""
        field = "tools" if tools is not None and tools.schema is not None else req.structured_output_field()
        if field is None:
            return None
        if self.engine.tokenizer is None:
            raise APIError(400, "structured output needs the model's tokenizer; this model has none", param=field,
                           code="invalid_value")
        from jhybrid.engine.structured_output import StructuredOutputsParams

        try:
            if field != "tools":
                return await asyncio.to_thread(req.structured_outputs_params)
            return await asyncio.to_thread(StructuredOutputsParams, json=tools.schema)
        except ImportError as e:  # xgrammar is an extra
            field = "tool_choice" if field == "tools" else field
            raise APIError(400, f"{field}: {e}", param=field, code="unsupported_parameter") from None
        except ValueError as e:
            raise APIError(400, f"tools: a function's parameters are not a usable JSON schema ({e})", param="tools",
                           code="invalid_value") from None

    async def _generate(self, request, req, model, prefix, ids_list, max_tokens, echo, *, chat: bool,
                        tools: ToolPlan | None = None):
        n, best_of = req.n, self._count(req, ids_list)
        prompts = [ids for ids in ids_list for _ in range(best_of)]
        fields = self._sampling_fields(req, chat, await self._constraint(req, tools))
        params = [self._params(fields, req, max_tokens[k // best_of], k % best_of) for k in range(len(prompts))]
        self._check_bans(params[0])
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        head = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model}
        num_prompt_tokens = sum(len(ids) for ids in ids_list)
        view = _View(self, req, chat, prompts, echo=[echo[k // best_of] for k in range(len(prompts))],
                     drop=[max_tokens[k // best_of] == 0 for k in range(len(prompts))], tools=tools)
        choices = _Choices(self.engine, response_id, prompts, params)
        if req.stream:  # best_of == n here
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(self._stream(choices, head, view, num_prompt_tokens, include_usage),
                               on_close=choices.close)
        try:
            outputs = await unless_disconnected(request, self._collect(choices))
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            choices.close()
        for out in outputs:
            if out.final.finish_reason == "error":
                raise self._failed(out.final)
        num_completion = sum(0 if view.drop[k] else out.final.num_output_tokens for k, out in enumerate(outputs))
        keep = []  # per prompt, the n candidates of highest cumulative logprob (all n when best_of == n)
        for p in range(len(ids_list)):
            group = list(range(p * best_of, (p + 1) * best_of))
            if best_of > n:
                group = sorted(group, key=lambda k: -outputs[k].final.cumulative_logprob)[:n]
            keep += group
        body = {**head, "object": "chat.completion" if chat else "text_completion",
                "choices": [view.choice(i, k, outputs[k]) for i, k in enumerate(keep)],
                "usage": _usage(num_prompt_tokens, num_completion,
                                _cached([outputs[p * best_of].final for p in range(len(ids_list))]))}
        return JSONResponse(body)

    def _failed(self, final) -> APIError:
        """The error of a request the engine failed (a server fault: the request was valid)."""
        if not self.engine.is_alive:
            return APIError(503, final.error or "the engine stopped", code="engine_dead")
        return APIError(500, final.error or "the request failed", code="engine_error")

    @staticmethod
    async def _collect(choices: _Choices) -> list[_Output]:
        outputs = [_Output() for _ in choices.ids]
        async for i, delta in choices:
            outputs[i].add(delta)
        return outputs

    async def _stream(self, choices: _Choices, head, view: _View, num_prompt_tokens, include_usage):
        usage_field = {"usage": None} if include_usage else {}

        def event(choice: dict):
            return sse({**head, "choices": [choice], **usage_field})

        num_completion = 0
        started = [False] * len(choices.ids)
        finals: list[Delta | None] = [None] * len(choices.ids)
        try:
            for i in range(len(choices.ids)):
                if view.chat:
                    yield event({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None})
                elif view.echo[i] and not view.wants_logprobs:
                    yield event(view.chunk(i, view.echo[i]))
            async for i, delta in choices:
                if delta.finish_reason == "error":
                    yield sse(self._failed(delta).body())
                    break
                if not started[i]:
                    started[i] = True
                    if not view.chat and view.echo[i] and view.wants_logprobs:  # the prompt's logprobs came now
                        yield event(view.chunk(i, view.echo[i], view.prompt_logprobs(i, delta.prompt_logprobs)))
                if view.tools is not None:
                    for choice in view.tool_chunks(i, delta):
                        yield event(choice)
                elif not view.drop[i] and (delta.text or (view.wants_logprobs and delta.token_ids)):
                    yield event(view.chunk(i, delta.text, view.delta_logprobs(i, delta)))
                if delta.finished:
                    finals[i] = delta
                    num_completion += 0 if view.drop[i] else delta.num_output_tokens
                    yield event(view.chunk(i, None, finish=view.finish_reason(i, delta.finish_reason)))
            else:
                if include_usage:
                    yield sse({**head, "choices": [], "usage": _usage(num_prompt_tokens, num_completion,
                                                                      _cached(finals))})
            yield "data: [DONE]\n\n"
        finally:
            choices.close()


class _View:
    """How one HTTP request's engine requests read as OpenAI choices: text, echo, and logprobs in the endpoint's
    shape (`jhybrid.server.logprobs`). `drop[k]`: `max_tokens` 0 with echo (the generated token is not shown)."""

    def __init__(self, serving: _Serving, req, chat: bool, prompts: list[list[int]], echo: list[str], drop: list[bool],
                 tools: ToolPlan | None = None):
        self.req, self.chat, self.prompts, self.echo, self.drop = req, chat, prompts, echo, drop
        self.tools = tools  # chat with tool calls to read: a parser per choice
        self.parsers = [tools.new_stream() for _ in prompts] if tools is not None else []
        self.texts = TokenTexts(serving.engine.tokenizer)
        self.wants_logprobs = bool(req.logprobs) if chat else req.logprobs is not None
        self.ids = [list(p) for p in prompts]  # streaming: prompt + tokens sent so far, per choice
        self.offsets = [0] * len(prompts)  # streaming: text_offset of the next token, per choice

    def choice(self, i: int, k: int, out: _Output) -> dict:
        """Choice `i` of a whole response, from engine request `k`'s output."""
        reason = out.final.finish_reason
        ids, text = self.prompts[k], "" if self.drop[k] else out.text
        generated = [] if self.drop[k] else out.token_ids
        logprobs = None
        if self.wants_logprobs and self.chat:
            logprobs = {"content": chat_logprobs(self.texts, ids + generated, len(ids), out.token_logprobs,
                                                 out.logprobs, self.req.top_logprobs or 0)}
        elif self.wants_logprobs:
            entries = _entries(generated, out.token_logprobs, out.logprobs)
            start = len(ids)
            if self.req.echo:
                entries = list(self._prompt_entries(k, out.prompt_logprobs)) + entries
                start = 0
            logprobs = completion_logprobs(self.texts, ids + generated, start, entries)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tools is not None:
                parser = self.parsers[k]
                content, calls = collect(parser.feed(text) + parser.finish())
                message["content"] = content
                if calls:
                    message["tool_calls"] = calls
                reason = self.finish_reason(k, reason)
            return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason}
        return {"index": i, "text": self.echo[k] + text, "logprobs": logprobs, "finish_reason": reason}

    def _prompt_entries(self, k: int, prompt_logprobs) -> tuple:
        return prompt_logprobs if prompt_logprobs is not None else (None,) * len(self.prompts[k])

    def chunk(self, i: int, text: str | None, logprobs: dict | None = None, finish: str | None = None) -> dict:
        """A stream chunk of choice `i` (streamed choices are the engine requests: best_of == n)."""
        if self.chat:
            delta = {"content": text} if text or logprobs is not None else {}
            return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {"index": i, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def finish_reason(self, k: int, reason: str) -> str:
        """"tool_calls" for a request that stopped after making calls (length and abort stay as they are)."""
        if self.tools is not None and reason == "stop" and self.parsers[k].num_calls:
            return "tool_calls"
        return reason

    def tool_chunks(self, i: int, delta: Delta) -> list[dict]:
        """Stream chunks of choice `i` for an engine delta read by its tool-call parser: text and tool-call deltas
        (text that may begin a call held back), the delta's logprobs on the first (or alone, when all is held)."""
        parser = self.parsers[i]
        parts = parser.feed(delta.text) if delta.text else []
        if delta.finished:
            parts += parser.finish()
        logprobs = self.delta_logprobs(i, delta)
        if logprobs is not None and delta.token_ids and not parts:
            parts = [{}]
        chunks = []
        for part in parts:
            chunks.append({"index": i, "delta": part, "logprobs": logprobs, "finish_reason": None})
            logprobs = None
        return chunks

    def prompt_logprobs(self, i: int, prompt_logprobs) -> dict:
        """Streamed echo: the prompt's tokens and logprobs (completions)."""
        out = completion_logprobs(self.texts, self.prompts[i], 0, self._prompt_entries(i, prompt_logprobs))
        self.offsets[i] = out["text_offset"][-1] + len(out["tokens"][-1]) if out["tokens"] else 0
        return out

    def delta_logprobs(self, i: int, delta: Delta) -> dict | None:
        """A streamed delta's tokens in the endpoint's logprobs shape (None when the request did not ask)."""
        start = len(self.ids[i])
        self.ids[i] += delta.token_ids
        if not self.wants_logprobs:
            return None
        if self.chat:
            return {"content": chat_logprobs(self.texts, self.ids[i], start, delta.token_logprobs, delta.logprobs,
                                             self.req.top_logprobs or 0)}
        entries = _entries(delta.token_ids, delta.token_logprobs, delta.logprobs)
        out = completion_logprobs(self.texts, self.ids[i], start, entries, self.offsets[i])
        if out["tokens"]:
            self.offsets[i] = out["text_offset"][-1] + len(out["tokens"][-1])
        return out


def _usage(num_prompt: int, num_completion: int, num_cached: int | None = None) -> dict:
    """OpenAI's usage; with prefix caching on, `prompt_tokens_details.cached_tokens` (vLLM's field)."""
    out = {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion}
    if num_cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": num_cached}
    return out


def _cached(finals) -> int | None:
    """Prompt tokens reused from the prefix cache, summed over one candidate of each prompt (None: cache off)."""
    counts = [d.num_cached_tokens for d in finals if d is not None and d.num_cached_tokens is not None]
    return sum(counts) if counts else None
