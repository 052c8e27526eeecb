"""Starting a server: `serve(...)` (what `jhybrid serve` runs) and `BackgroundServer` (tests, benchmarks)."""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from typing import Any

from jhybrid.server.app import ServerConfig, create_app
from jhybrid.server.async_engine import AsyncEngine
from jhybrid.server.chat_template import load_chat_template

log = logging.getLogger("jhybrid.server")


def build_engine(model: str, *, dtype: str | None = None, served_model_name: str | None = None,
                 **engine_kwargs: Any) -> AsyncEngine:
    """Loads `model` and wraps an `LLMEngine` over it in a (not yet started) `AsyncEngine`.
    `engine_kwargs` are `LLMEngine`'s: max_num_seqs, max_model_len, block_size, num_kv_blocks, ..."""
    from jhybrid.engine.generate import load
    from jhybrid.engine.llm_engine import LLMEngine

    engine = LLMEngine(load(model, dtype, host=engine_kwargs.get("tensor_parallel_size", 1) > 1), **engine_kwargs)
    return AsyncEngine(engine, model_name=served_model_name or model)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, chat_template: str | None = None, max_body_bytes: int = 1 << 20,
          log_level: str = "info", dtype: str | None = None, **engine_kwargs: Any) -> None:
    """Loads the model and serves it until interrupted (binds to loopback unless `host` says otherwise)."""
    import uvicorn

    name = served_model_name or model
    template = load_chat_template(model, chat_template)
    config = ServerConfig(model_names=(name,), api_key=api_key, chat_template=template, max_body_bytes=max_body_bytes)
    engine = build_engine(model, dtype=dtype, served_model_name=name, **engine_kwargs)
    if not is_loopback(host) and not api_key:
        log.warning("serving on %s without an API key: anyone who can reach this port can use the model", host)
    if template is None:
        log.warning("%s has no chat template: /v1/chat/completions will answer 400", model)
    app = create_app(engine.start(), config)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()


class BackgroundServer:
    """Runs an app with uvicorn on a daemon thread, on a port the OS picks by default:

        with BackgroundServer(app) as server:
            httpx.get(server.url + "/health")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2,
                                                    backlog=4096))
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

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["BackgroundServer", "build_engine", "is_loopback", "serve"]
