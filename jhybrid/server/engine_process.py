"""The engine in a process of its own: what `jhybrid serve` runs by default.

One Python process cannot both step the engine and serve HTTP at full speed: the engine thread's host work
(scheduling, building and dispatching steps, reading tokens, detokenizing) and the event loop's (parsing
requests, writing server-sent events) share one GIL, and with 64 streams the pair needs more than the one core
the GIL lets them have (benchmarks/RESULTS.md). So, as vLLM's V1 engine core does, the engine runs alone in a
child process (spawned, so JAX starts clean there) with a GIL of its own; the server process keeps HTTP, the
tokenizer for validation, and the metrics. The child is a fresh interpreter (`python -c`, not multiprocessing's
spawn, which would import the user's main script again) talking over a socket pair.

    process = EngineProcess(EngineSpec("path/to/ckpt", EngineConfig(max_num_seqs=64)), tokenizer)  # ready
    engine = AsyncEngine(backend=process, model_name="tiny").start()

- The child gets the `EngineSpec` as its first message, loads the model, compiles (or loads from the cache) every step program when `warmup` is on, and
  only then reports ready; `EngineProcess(...)` blocks until it does, or raises EngineStartError with the
  child's error (a bad checkpoint, not enough memory, ...).
- Messages are pickled over one pipe. Server -> engine: `("add", [Add])`, `("abort", id)`, `("abort_all",)`,
  `("stop",)`. Engine -> server: `("ready", facts)`, `("out", Outputs)` after every iteration,
  `("stopped", stats)`, `("fatal", message)`.
- In the child a reader thread feeds the pipe into the `EngineLoop`'s inbox, so the server's writes never wait
  on a step. When the server process goes away (the pipe closes) the child stops; when the child dies, the
  server's receiver thread sees the pipe close and fails every open request (`AsyncEngine._on_fatal`).
- The child ignores SIGINT (a Ctrl-C in the terminal reaches the whole process group: the server drains, then
  stops the engine).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from jhybrid.engine.engine_config import EngineConfig

log = logging.getLogger("jhybrid.server")


class EngineStartError(RuntimeError):
    """The engine process failed before it was ready; the message carries its error."""


class EngineProcessError(RuntimeError):
    """The engine process stopped serving: it failed, or died."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds: `model` (a checkpoint directory) with `config`. `compilation_cache_dir`:
    JAX's persistent compilation cache there (None: off). `setup`: "module:function", called with the
    `LLMEngine` in the engine process before it reports ready (tests use it to inject faults)."""

    model: str
    config: EngineConfig
    compilation_cache_dir: str | None = None
    log_level: str = "INFO"
    setup: str | None = None


def _dumps(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


class EngineProcess:
    """The server's handle on the engine process: a backend of `AsyncEngine` (see the module docstring)."""

    engine = None  # the LLMEngine lives in the other process

    def __init__(self, spec: EngineSpec, tokenizer: Any, *, startup_timeout: float | None = None):
        self.spec, self.tokenizer = spec, tokenizer
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        env = dict(os.environ, JHYBRID_ENGINE_SYS_PATH=json.dumps([p for p in sys.path if p]))
        started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from jhybrid.server.engine_process import child_main; child_main()",
             str(theirs.fileno())], pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self._send_lock = threading.Lock()
        self._receiver: threading.Thread | None = None
        self._stats: dict[str, float] = {}
        try:
            self._send(spec)
            kind, facts = self._wait_ready(startup_timeout)
        except BaseException:
            self._kill()
            raise
        if kind != "ready":
            self._kill()
            last = facts.strip().splitlines()[-1] if facts.strip() else "unknown error"
            raise EngineStartError(f"the engine process failed to start: {last}\n{facts}")
        self.max_model_len, self.vocab_size = facts["max_model_len"], facts["vocab_size"]
        self._stats = facts["stats"]  # engine_gauges(): what the metrics show before the first request
        log.info("engine process %d ready in %.1f s", self.process.pid, time.monotonic() - started)

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def _wait_ready(self, timeout: float | None) -> tuple[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if self.process.poll() is not None:
                raise EngineStartError(f"the engine process exited with status {self.exitcode} before it "
                                       "was ready (its log is above)")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineStartError(f"the engine process was not ready within {timeout:g} s")
        try:
            return pickle.loads(self._conn.recv_bytes())
        except EOFError:
            self._wait(5)
            raise EngineStartError(f"the engine process exited with status {self.exitcode} before it was "
                                   "ready (its log is above)") from None

    # ----------------------------------------------------------------- the backend interface of AsyncEngine
    def start(self, frontend) -> None:
        self._receiver = threading.Thread(target=self._receive, args=(frontend,), name="jhybrid-engine-rx", daemon=True)
        self._receiver.start()

    def is_alive(self) -> bool:
        return self._receiver is not None and self._receiver.is_alive() and self.process.poll() is None

    def add(self, adds) -> None:
        self._send(("add", adds))

    def abort(self, request_id: Any) -> None:
        self._send(("abort", request_id))

    def abort_all(self) -> None:
        self._send(("abort_all",))

    def stop(self) -> None:
        try:
            self._send(("stop",))
        except (OSError, EOFError):  # already gone
            pass

    def join(self, timeout: float | None) -> None:
        if self._receiver is not None:
            self._receiver.join(timeout)
        self._wait(timeout)
        if self.process.poll() is None:
            log.warning("the engine process did not stop within %s s; killing it", timeout)
            self._kill()
        self._conn.close()

    def stats(self) -> dict[str, float]:
        """The engine's counters as it last reported them."""
        return dict(self._stats)

    # ----------------------------------------------------------------- internals
    def _send(self, message) -> None:
        data = _dumps(message)
        with self._send_lock:
            self._conn.send_bytes(data)

    def _receive(self, frontend) -> None:
        from jhybrid.server.async_engine import name_os_thread

        name_os_thread("jhybrid-engine-rx")
        try:
            while True:
                kind, payload = pickle.loads(self._conn.recv_bytes())
                if kind == "out":
                    if payload.gauges is not None:
                        self._stats = payload.gauges
                    frontend._on_outputs(payload)
                elif kind == "stopped":
                    self._stats = payload
                    frontend._on_stopped()
                    return
                elif kind == "fatal":
                    frontend._on_fatal(EngineProcessError(payload))
                    return
        except (EOFError, OSError):
            self._wait(2)
            frontend._on_fatal(EngineProcessError(
                f"the engine process died (exit status {self.exitcode}); its log is above"))
        except BaseException as e:  # noqa: BLE001 - a bug here must not leave requests waiting forever
            frontend._on_fatal(e)

    def _wait(self, timeout: float | None) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def _kill(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self._wait(5)
        if self.process.poll() is None:
            self.process.kill()
            self._wait(5)


# --------------------------------------------------------------------------------------------- the child
def child_main() -> None:
    """The engine process: `python -c "...; child_main()" FD`, FD its end of the socket pair."""
    # The server owns the engine's lifetime: it drains, then says "stop" (or its end of the socket closes). A
    # Ctrl-C, or a SIGTERM sent to the whole process group (systemd, a container's init, `kill -- -PGID`),
    # reaches this process too, and dying by it would fail the requests the server is still draining.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The step program's call runs on the runner's dispatch thread and returns into Python while this process's
    # engine loop builds and sends the last step's outputs: with Python's 5 ms switch interval the call may wait
    # that long for the GIL. JHYBRID_ENGINE_SWITCH_INTERVAL (seconds) sets this process's interval, to measure
    # that on the GPU (unmeasured yet; the server process's 1 ms, launch.py, was measured).
    if os.environ.get("JHYBRID_ENGINE_SWITCH_INTERVAL"):
        sys.setswitchinterval(float(os.environ["JHYBRID_ENGINE_SWITCH_INTERVAL"]))
    for path in reversed(json.loads(os.environ.pop("JHYBRID_ENGINE_SYS_PATH", "[]"))):
        if path not in sys.path:
            sys.path.insert(0, path)
    conn = Connection(int(sys.argv[1]))
    spec: EngineSpec = pickle.loads(conn.recv_bytes())
    logging.basicConfig(level=spec.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from jhybrid.server.async_engine import name_os_thread

    name_os_thread("jhybrid-engine")
    send_lock = threading.Lock()

    def send(message) -> None:
        data = _dumps(message)
        with send_lock:
            conn.send_bytes(data)

    try:
        engine = build_llm_engine(spec.model, spec.config, compilation_cache_dir=spec.compilation_cache_dir)
        run_setup(spec.setup, engine)
        from jhybrid.server.engine_core import engine_gauges

        facts = dict(max_model_len=engine.max_model_len, vocab_size=engine.model.cfg.vocab_size,
                     stats=engine_gauges(engine))
    except BaseException:  # noqa: BLE001 - reported to the server, which raises EngineStartError with it
        send(("failed", traceback.format_exc()))
        conn.close()
        os._exit(1)
    from jhybrid.server.engine_core import EngineLoop

    loop = EngineLoop(engine, lambda outputs: send(("out", outputs)))
    send(("ready", facts))
    threading.Thread(target=_read_commands, args=(conn, loop), name="jhybrid-engine-cmd", daemon=True).start()
    try:
        loop.run()
        send(("stopped", {**engine.stats(), "engine_requests": len(engine.requests)}))
    except BaseException as e:  # noqa: BLE001 - EngineFailure, a bug of the loop, or the server gone
        logging.getLogger("jhybrid.server").critical("the engine process cannot continue", exc_info=e)
        try:
            send(("fatal", f"{type(e).__name__}: {e}"))
        except (OSError, EOFError):
            pass
        conn.close()
        os._exit(1)
    conn.close()


def _read_commands(conn, loop) -> None:
    """The engine process's reader: the server's commands into the loop's inbox; stops the loop when the server
    goes away."""
    try:
        while True:
            kind, *args = pickle.loads(conn.recv_bytes())
            if kind == "add":
                loop.add(args[0])
            elif kind == "abort":
                loop.abort(args[0])
            elif kind == "abort_all":
                loop.abort_all()
            elif kind == "stop":
                loop.stop()
                return
    except (EOFError, OSError):
        logging.getLogger("jhybrid.server").warning("the server closed the engine's pipe; stopping the engine")
        loop.stop()


def run_setup(setup: str | None, engine) -> None:
    """Calls "module:function" `setup` with the LLMEngine, where it runs (a test hook: `EngineSpec.setup`, or
    `JHYBRID_ENGINE_SETUP` for `jhybrid serve`)."""
    if setup:
        module, _, function = setup.partition(":")
        getattr(importlib.import_module(module), function)(engine)


def build_llm_engine(model: str, config: EngineConfig, *, compilation_cache_dir: str | None = None):
    """Loads `model` and builds the `LLMEngine` (compiling its programs when `config.warmup`)."""
    from jhybrid.engine.llm_engine import LLMEngine
    from jhybrid.model_loader import load

    if compilation_cache_dir is not None:
        from jhybrid.engine.compilation import enable_compilation_cache

        enable_compilation_cache(compilation_cache_dir)
    loaded = load(model, config.dtype, host=config.tensor_parallel_size > 1, quantization=config.quantization,
                  tensor_parallel_size=config.tensor_parallel_size)
    return LLMEngine(loaded, config)


__all__ = ["EngineProcess", "EngineProcessError", "EngineSpec", "EngineStartError", "build_llm_engine", "run_setup"]
