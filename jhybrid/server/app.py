"""The OpenAI-compatible FastAPI app over an `AsyncEngine`.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream with `"stream": true`), GET /v1/models,
GET /health, GET /metrics, GET /version. Every /v1 route checks the API key when one is set.

A request is checked in this order, each failure an OpenAI-style error that touches nothing else:
API key (401) -> body size (413) -> JSON and field types / ranges (400, naming the field) -> model name
(404) -> chat template present (400) -> prompt tokens: empty, out of vocabulary, longer than the context,
or prompt + max_tokens beyond it (400). Only then does it reach the engine. Each choice (prompt x n) is one
engine request; a client that disconnects aborts all of its requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jhybrid.engine.sampling import SamplingParams
from jhybrid.server.async_engine import AsyncEngine, EngineDeadError
from jhybrid.server.chat_template import ChatTemplate, ChatTemplateError
from jhybrid.server.http import (ClientDisconnected, EventStream, HTTPMetricsMiddleware, check_api_key, error_response,
                                 read_body, sse, unless_disconnected)
from jhybrid.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, validation_error

ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/version"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """What the app serves. `model_names[0]` is the name responses carry; requests may use any of them."""

    model_names: tuple[str, ...]
    api_key: str | None = None
    chat_template: ChatTemplate | None = None
    max_body_bytes: int = 1 << 20
    default_completion_tokens: int = 16  # OpenAI's default for /v1/completions; chat defaults to the room left

    def __post_init__(self):
        if not self.model_names:
            raise ValueError("ServerConfig needs at least one model name")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes=}")


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The app; it starts `engine` on startup if it is not running. Stopping the engine is the caller's job."""
    from jhybrid import __version__

    async def lifespan(app):
        engine.start()
        yield

    app = FastAPI(title="jhybrid", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(HTTPMetricsMiddleware, counter=engine.metrics.http, routes=ROUTES)
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
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_api_key(request, config.api_key)
        req = _parse(CompletionRequest, await read_body(request, config.max_body_bytes))
        return await serving.completions(request, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_api_key(request, config.api_key)
        req = _parse(ChatCompletionRequest, await read_body(request, config.max_body_bytes))
        return await serving.chat(request, req)

    return app


def _parse(model, body: bytes):
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


class _Choices:
    """The engine requests of one HTTP request: choice i's deltas arrive as (i, Delta) on one queue."""

    def __init__(self, engine: AsyncEngine, base_id: str, prompts: list[list[int]], params: list[SamplingParams]):
        self.engine, self.sink = engine, asyncio.Queue()
        self.ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        self.open = set(range(len(prompts)))
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                engine.submit(self.ids[i], ids, p, self.sink, tag=i)
        except EngineDeadError as e:
            self.close()
            raise APIError(503, str(e)) from None

    async def __aiter__(self):
        while self.open:
            i, delta = await self.sink.get()
            if delta.finished:
                self.open.discard(i)
            yield i, delta

    def close(self) -> None:
        """Aborts the requests still open (a no-op for finished ones)."""
        for i in self.open:
            self.engine.abort(self.ids[i])
        self.open = set()


class _Serving:
    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine, self.config = engine, config
        self.started = time.time()

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

    def _params(self, req, max_tokens: int, choice: int) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p,
                seed=None if req.seed is None else (req.seed + choice) % 2**32, stop=req.stop_list,
                stop_token_ids=req.stop_token_ids or (), ignore_eos=req.ignore_eos,
                skip_special_tokens=req.skip_special_tokens,
            )
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_value") from None

    def _encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        if self.engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
        return self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    # ----------------------------------------------------------------- endpoints
    async def completions(self, request: Request, req: CompletionRequest):
        model = self._model_name(req.model)
        p = req.prompt
        prompts = [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)
        ids_list = [self._encode(x) if isinstance(x, str) else list(x) for x in prompts]
        for ids in ids_list:
            self._check_ids(ids, "prompt")
        max_tokens = [self._max_tokens(req.max_tokens, len(ids), self.config.default_completion_tokens) for ids in ids_list]
        echo = [(x if isinstance(x, str) else self._decode(x)) if req.echo else "" for x in prompts]
        return await self._generate(request, req, model, "cmpl", ids_list, max_tokens, echo, chat=False)

    async def chat(self, request: Request, req: ChatCompletionRequest):
        model = self._model_name(req.model)
        template = self.config.chat_template
        if template is None:
            raise APIError(400, f"the model `{model}` has no chat template (neither tokenizer_config.json's "
                           "chat_template nor chat_template.jinja): use /v1/completions, or start the server with "
                           "--chat-template FILE", param="messages", code="no_chat_template")
        try:
            text = template.render([m.for_template() for m in req.messages],
                                   add_generation_prompt=req.add_generation_prompt, **(req.chat_template_kwargs or {}))
        except ChatTemplateError as e:
            raise APIError(400, f"messages: {e}", param="messages", code="invalid_value") from None
        ids = self._encode(text, add_special_tokens=False)
        self._check_ids(ids, "messages")
        max_tokens = self._max_tokens(req.max_new_tokens, len(ids), None)
        return await self._generate(request, req, model, "chatcmpl", [ids], [max_tokens], [""], chat=True)

    def _decode(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids) if self.engine.tokenizer is not None else ""

    async def _generate(self, request, req, model, prefix, ids_list, max_tokens, echo, *, chat: bool):
        n = req.n
        prompts = [ids for ids in ids_list for _ in range(n)]
        params = [self._params(req, max_tokens[k // n], k % n) for k in range(len(prompts))]
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        head = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": model}
        num_prompt_tokens = sum(len(ids) for ids in ids_list)
        choices = _Choices(self.engine, response_id, prompts, params)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(self._stream(choices, head, echo, n, num_prompt_tokens, include_usage, chat),
                               on_close=choices.close)
        try:
            texts, finals = await unless_disconnected(request, self._collect(choices))
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            choices.close()
        for final in finals:
            if final.finish_reason == "error":
                status = 503 if not self.engine.is_alive else 400
                raise APIError(status, final.error or "the request failed")
        out = []
        for k, (text, final) in enumerate(zip(texts, finals)):
            if chat:
                out.append({"index": k, "message": {"role": "assistant", "content": text}, "logprobs": None,
                            "finish_reason": final.finish_reason})
            else:
                out.append({"index": k, "text": echo[k // n] + text, "logprobs": None, "finish_reason": final.finish_reason})
        num_completion = sum(f.num_output_tokens for f in finals)
        body = {**head, "object": "chat.completion" if chat else "text_completion", "choices": out,
                "usage": _usage(num_prompt_tokens, num_completion)}
        return JSONResponse(body)

    @staticmethod
    async def _collect(choices: _Choices) -> tuple[list[str], list[Any]]:
        texts, finals = [""] * len(choices.ids), [None] * len(choices.ids)
        async for i, delta in choices:
            texts[i] += delta.text
            if delta.finished:
                finals[i] = delta
        return texts, finals

    async def _stream(self, choices: _Choices, head, echo, n, num_prompt_tokens, include_usage, chat):
        usage_field = {"usage": None} if include_usage else {}

        def chunk(i: int, text: str | None, finish: str | None = None, role: bool = False):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text or "", "logprobs": None, "finish_reason": finish}
            return sse({**head, "choices": [choice], **usage_field})

        num_completion = 0
        try:
            for i in range(len(choices.ids)):
                if chat:
                    yield chunk(i, None, role=True)
                elif echo[i // n]:
                    yield chunk(i, echo[i // n])
            async for i, delta in choices:
                if delta.finish_reason == "error":
                    status = 503 if not self.engine.is_alive else 400
                    yield sse(APIError(status, delta.error or "the request failed").body())
                    break
                if delta.text:
                    yield chunk(i, delta.text)
                if delta.finished:
                    num_completion += delta.num_output_tokens
                    yield chunk(i, None, delta.finish_reason)
            else:
                if include_usage:
                    yield sse({**head, "choices": [], "usage": _usage(num_prompt_tokens, num_completion)})
            yield "data: [DONE]\n\n"
        finally:
            choices.close()


def _usage(num_prompt: int, num_completion: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion}
