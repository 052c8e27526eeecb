"""Starting a server: `serve(...)` (what `jhybrid serve` runs) and `BackgroundServer` (tests, benchmarks).

Both run a `GracefulServer`: on SIGTERM / SIGINT (or `request_shutdown()`) it stops accepting (listening
sockets closed, /health 503, new requests 503), lets open requests finish for up to `shutdown_timeout`
seconds, then aborts the rest (each stream gets a final event with finish_reason "abort" and `[DONE]`) and
exits 0. A second SIGINT aborts at once. When the engine cannot continue it exits with status 1, so that a
supervisor restarts it. Request headers must arrive within `header_timeout` seconds (408).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import uvicorn

from jhybrid.engine.engine_config import EngineConfig, engine_config
from jhybrid.engine.heap import freeze_startup_heap
from jhybrid.server.app import ServerConfig, create_app
from jhybrid.server.async_engine import AsyncEngine
from jhybrid.server.chat_template import load_chat_template
from jhybrid.server.http import header_timeout_protocol

log = logging.getLogger("jhybrid.server")


def build_engine(model: str, config: EngineConfig | None = None, /, *, served_model_name: str | None = None,
                 max_waiting_requests: int = 1024, max_queued_tokens: int = 1 << 20, engine_process: bool = False,
                 compilation_cache_dir: str | None = None, setup: str | None = None, log_level: str = "info",
                 **options: Any) -> AsyncEngine:
    """Loads `model` and wraps an `LLMEngine` over it in a (not yet started) `AsyncEngine`. `config` holds the
    engine options and `options` replace its fields (`EngineConfig`: dtype, max_num_seqs, max_model_len, ...);
    without a `config`, `dtype` defaults to None (the checkpoint's), as in `jhybrid serve`.

    `engine_process`: run the engine in a process of its own (`engine_process.py`; what `jhybrid serve` does),
    which is ready (programs compiled when `warmup`) when this returns; else on a thread of this process, where
    `.engine` is the LLMEngine. `compilation_cache_dir`: JAX's persistent compilation cache (None: leave JAX's
    setting). `setup`: "module:function" called with the LLMEngine where it runs, before it serves (tests inject
    faults with it)."""
    from jhybrid.server.engine_process import EngineProcess, EngineSpec, build_llm_engine, run_setup

    if config is None:
        options.setdefault("dtype", None)
    config = engine_config(config, **options)
    name = served_model_name or model
    limits = dict(model_name=name, max_waiting_requests=max_waiting_requests, max_queued_tokens=max_queued_tokens)
    if engine_process:
        from jhybrid.tokenizer import load_tokenizer

        spec = EngineSpec(model, config, compilation_cache_dir=compilation_cache_dir, log_level=log_level, setup=setup)
        return AsyncEngine(backend=EngineProcess(spec, load_tokenizer(model)), **limits)
    engine = build_llm_engine(model, config, compilation_cache_dir=compilation_cache_dir)
    run_setup(setup, engine)
    return AsyncEngine(engine, **limits)


class GracefulServer(uvicorn.Server):
    """uvicorn's server, draining the engine on shutdown (see the module docstring); `exit_code` after `run()`."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float = 30.0):
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        engine.on_fatal = self._fatal

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        freeze_startup_heap("HTTP server")  # the server's stack, the tokenizer (and a threaded engine): jhybrid/engine/heap.py

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn records the signal and raises it again once stopped (the process then dies by it); a drained
        # server exits 0 instead
        log.info("received %s", signal.Signals(sig).name)
        self.request_shutdown()

    def request_shutdown(self) -> None:
        """Starts the drain (any thread); called again, it aborts the open requests at once."""
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain is not None:
            log.warning("aborting every open request now")
            self.engine.abort_all()
            return
        log.info("shutting down: %d requests open; they have %g s to finish", self.engine.num_open_requests,
                 self.shutdown_timeout)
        self.engine.stop_accepting()
        self.should_exit = True  # uvicorn closes its listening sockets and waits for the open connections
        self._drain = asyncio.ensure_future(self._drain_engine())

    async def _drain_engine(self) -> None:
        if not await self.engine.wait_idle(self.shutdown_timeout):
            log.warning("aborting %d requests still open after %g s", self.engine.num_open_requests,
                        self.shutdown_timeout)
            self.engine.abort_all()

    def _fatal(self, error: BaseException) -> None:  # the engine thread
        self.exit_code = 1
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(setattr, self, "should_exit", True)
        else:
            self.should_exit = True


def _uvicorn_config(app, *, header_timeout: float, shutdown_timeout: float, **kwargs) -> uvicorn.Config:
    return uvicorn.Config(app, http=header_timeout_protocol(header_timeout), backlog=4096,
                          timeout_graceful_shutdown=int(shutdown_timeout) + 5, **kwargs)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, chat_template: str | None = None, max_body_bytes: int = 1 << 20,
          log_level: str = "info", max_seqs_per_request: int = 128, max_waiting_requests: int = 1024,
          max_queued_tokens: int = 1 << 20, shutdown_timeout: float = 30.0, header_timeout: float = 10.0,
          body_timeout: float = 30.0, allowed_origins: tuple[str, ...] = (), compilation_cache_dir: str | None = None,
          engine_process: bool = True, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
          engine_config: EngineConfig | None = None, **engine_options: Any) -> int:
    """Loads the model and serves it until SIGTERM / SIGINT (binds to loopback unless `host` says otherwise).
    `engine_config` and `engine_options` are the engine's options, as in `build_engine` (dtype, max_num_seqs,
    ...). `compilation_cache_dir`: JAX's persistent compilation cache (None: off); with `warmup=True` (the
    CLI's default) every step program is compiled, or loaded from that cache, before the server listens.
    `engine_process`: the engine runs in a process of its own (default; `engine_process.py` says why), else on
    a thread of the server process. `enable_auto_tool_choice`, `tool_call_parser`: tool calling (`ServerConfig`,
    `jhybrid.server.tools`). The environment variable JHYBRID_ENGINE_SETUP ("module:function") names a
    function called with the LLMEngine before it serves (the tests inject faults with it).
    Returns the exit status: 0 after a graceful shutdown, 1 when the engine could not continue."""
    # the thread that hands deltas to the event loop (the engine thread, or the engine process's receiver) should
    # take the GIL back within 1 ms rather than Python's default 5 ms, or a busy event loop delays every step
    sys.setswitchinterval(0.001)
    if engine_process:
        # this process only serves HTTP: should anything here touch JAX, it must not take an accelerator (JAX
        # would reserve most of its memory) from the engine process
        import jax

        jax.config.update("jax_platforms", "cpu")
    name = served_model_name or model
    template = load_chat_template(model, chat_template)
    config = ServerConfig(model_names=(name,), api_key=api_key, chat_template=template, max_body_bytes=max_body_bytes,
                          max_seqs_per_request=max_seqs_per_request, body_timeout=body_timeout,
                          allowed_origins=tuple(allowed_origins), enable_auto_tool_choice=enable_auto_tool_choice,
                          tool_call_parser=tool_call_parser)
    engine = build_engine(model, engine_config, served_model_name=name, max_waiting_requests=max_waiting_requests,
                          max_queued_tokens=max_queued_tokens, engine_process=engine_process,
                          compilation_cache_dir=compilation_cache_dir, log_level=log_level,
                          setup=os.environ.get("JHYBRID_ENGINE_SETUP"), **engine_options)
    if not is_loopback(host) and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach this port can use the model", host)
    if template is None:
        log.warning("%s has no chat template: /v1/chat/completions will answer 400", model)
    app = create_app(engine.start(), config)
    server = GracefulServer(_uvicorn_config(app, host=host, port=port, log_level=log_level, header_timeout=header_timeout,
                                            shutdown_timeout=shutdown_timeout), engine, shutdown_timeout)
    try:
        server.run()
    finally:
        engine.shutdown()
    stats = engine.stats()
    log.info("stopped (exit status %d): kv_blocks_used=%d state_slots_used=%d open_requests=%d engine_requests=%d",
             server.exit_code, stats.get("kv_blocks_used", -1), stats.get("state_slots_used", -1),
             engine.num_open_requests, stats.get("engine_requests", -1))
    return server.exit_code


class BackgroundServer:
    """Runs an app with uvicorn on a daemon thread, on a port the OS picks by default:

        with BackgroundServer(app) as server:
            httpx.get(server.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", *,
                 engine: AsyncEngine | None = None, shutdown_timeout: float = 2.0, header_timeout: float = 10.0):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        config = _uvicorn_config(app, log_level=log_level, header_timeout=header_timeout, shutdown_timeout=shutdown_timeout)
        if engine is None:  # no drain: stop() ends the server
            self.server = uvicorn.Server(config)
        else:  # request_shutdown() drains `engine` first (it stays running: several apps may share it)
            self.server = GracefulServer(config, engine, shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="jhybrid-http")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def request_shutdown(self) -> None:
        """The graceful shutdown SIGTERM starts (needs `engine`); `join()` waits for it."""
        self.server.request_shutdown()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["BackgroundServer", "GracefulServer", "build_engine", "is_loopback", "serve"]
