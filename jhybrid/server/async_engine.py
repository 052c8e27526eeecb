"""`AsyncEngine`: the server's side of a served engine. asyncio handlers submit requests and read their deltas;
the engine runs in an `EngineLoop` (`engine_core.py`) on a thread of this process, or in a process of its own
(`engine_process.py`, what `jhybrid serve` runs: the engine's host work and the HTTP server then do not share a
GIL).

    engine = AsyncEngine(LLMEngine(model, ...), model_name="tiny")   # the loop on a thread
    engine.start()
    async for delta in engine.generate("req-1", prompt_ids, SamplingParams(max_tokens=8)):
        print(delta.text, end="")
    engine.shutdown()

- Admission limits (`submit_batch`, all or nothing): at most `max_waiting_requests` requests waiting (in the
  loop's inbox or the scheduler's waiting queue) and `max_queued_tokens` prompt tokens not yet prefilled; beyond
  them it raises EngineOverloadedError (the server answers 503 with Retry-After).
- Each iteration of the loop hands its `Outputs` here: the deltas go to the requests' asyncio queues with one
  `loop.call_soon_threadsafe` per event loop per iteration, and the request metrics (TTFT, ITL, end to end,
  tokens, finish reasons) are observed as the deltas arrive, so they are what the server saw.
- A consumer that stops early (client disconnected, task cancelled) sends an abort; the engine frees the
  request's KV blocks and state slot on its next iteration and the request ends with finish_reason "abort".
- A step that raises fails the request behind it (finish_reason "error"); the others go on. When the engine
  cannot continue (EngineFailure, a bug of the loop, the engine process dying) every open request gets a final
  delta with `error` set, `is_alive` turns False and `on_fatal` is called (the server then exits non-zero so that
  a supervisor restarts it).
- Shutting down gracefully: `stop_accepting()`, `await wait_idle(timeout)`, `abort_all()` (each open request
  then ends with finish_reason "abort"), `shutdown()`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from typing import Any

from jhybrid.engine.sampling import SamplingParams
from jhybrid.server.engine_core import ADDS_PER_ITERATION, Add, Delta, EngineLoop, Outputs, engine_gauges
from jhybrid.server.metrics import EngineMetrics

log = logging.getLogger("jhybrid.server")


class EngineDeadError(RuntimeError):
    """The engine is not running (never started, shut down, or it failed)."""


class EngineDrainingError(EngineDeadError):
    """The server is shutting down: running requests finish, new ones are refused."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (requests or prompt tokens); `retry_after` is a hint in seconds."""

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message)
        self.retry_after = retry_after


@dataclasses.dataclass
class _Open:
    """A submitted request whose final delta is not yet delivered."""

    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    tag: Any
    arrival: float
    num_tokens: int
    last_token_time: float | None = None
    num_output_tokens: int = 0


class ThreadBackend:
    """The engine loop on a thread of this process (`AsyncEngine(engine)`); `engine` stays reachable (tests)."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model.cfg.vocab_size
        self.loop: EngineLoop | None = None
        self.thread: threading.Thread | None = None

    def start(self, frontend: "AsyncEngine") -> None:
        self.loop = EngineLoop(self.engine, frontend._on_outputs)
        self.thread = threading.Thread(target=self._run, args=(frontend,), name="jhybrid-engine", daemon=True)
        self.thread.start()

    def _run(self, frontend: "AsyncEngine") -> None:
        name_os_thread("jhybrid-engine")
        try:
            self.loop.run()
        except BaseException as e:  # noqa: BLE001 - EngineFailure, or a bug of the loop
            frontend._on_fatal(e)
        else:
            frontend._on_stopped()
        finally:
            self.engine.close()

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def add(self, adds: list[Add]) -> None:
        self.loop.add(adds)

    def abort(self, request_id: Any) -> None:
        self.loop.abort(request_id)

    def abort_all(self) -> None:
        self.loop.abort_all()

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.stop()

    def join(self, timeout: float | None) -> None:
        if self.thread is not None:
            self.thread.join(timeout)

    def stats(self) -> dict[str, float]:
        return {**self.engine.stats(), "engine_requests": len(self.engine.requests)}


class AsyncEngine:
    """Serves `engine` (an LLMEngine, run on a thread) or `backend` (e.g. an `EngineProcess`); `submit` /
    `generate` / `abort` may be called from any thread."""

    def __init__(self, engine=None, *, model_name: str = "model", metrics: EngineMetrics | None = None,
                 max_waiting_requests: int = 1024, max_queued_tokens: int = 1 << 20,
                 on_fatal: Callable[[BaseException], None] | None = None, backend=None):
        if max_waiting_requests < 1 or max_queued_tokens < 1:
            raise ValueError(f"need {max_waiting_requests=} >= 1 and {max_queued_tokens=} >= 1")
        if (engine is None) == (backend is None):
            raise ValueError("give an engine (run on a thread) or a backend, not both")
        self.backend = backend if backend is not None else ThreadBackend(engine)
        self.engine = getattr(self.backend, "engine", None)  # the LLMEngine when it runs in this process
        self.model_name = model_name
        self.metrics = metrics or EngineMetrics(model_name)
        self.max_waiting_requests, self.max_queued_tokens = max_waiting_requests, max_queued_tokens
        self.on_fatal = on_fatal
        self._lock = threading.Lock()  # guards everything below
        self._open: dict[Any, _Open] = {}
        self._sent = (0, 0)  # adds handed to the backend: (requests, prompt tokens)
        self._taken = (0, 0)  # ... of which the loop took, as of its last Outputs
        self._snapshot = (0, 0)  # the scheduler's waiting queue, as of the loop's last Outputs
        self._accepting = True
        self._started = False
        self._closed = False
        self.failure: BaseException | None = None
        # the gauges before the first step: start-up compilation, pool sizes
        self.metrics.set_engine_gauges(engine_gauges(self.engine) if self.engine is not None else self.backend.stats())

    # ----------------------------------------------------------------- facts the server validates against
    @property
    def tokenizer(self):
        return self.backend.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    @property
    def is_alive(self) -> bool:
        return self._started and not self._closed and self.backend.is_alive()

    @property
    def accepting(self) -> bool:
        """False once `stop_accepting()` was called (the server is shutting down)."""
        return self._accepting

    @property
    def num_open_requests(self) -> int:
        """Requests submitted and not yet answered with their final delta (queued, waiting or running)."""
        with self._lock:
            return len(self._open)

    def stats(self) -> dict[str, float]:
        """The engine's counters (`LLMEngine.stats()`; from an engine process, as last reported)."""
        return self.backend.stats()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> "AsyncEngine":
        with self._lock:
            if self._started or self._closed:
                return self
            self._started = True
        self.backend.start(self)
        return self

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Aborts whatever runs, stops the engine and waits for it."""
        with self._lock:
            if self._closed and not self.backend.is_alive():
                return
            self._closed = True
        self.backend.stop()
        self.backend.join(timeout)

    def stop_accepting(self) -> None:
        """New submits raise EngineDrainingError from now on; open requests go on."""
        with self._lock:
            self._accepting = False

    async def wait_idle(self, timeout: float | None) -> bool:
        """Waits until no request is open (True) or `timeout` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.num_open_requests and self.is_alive:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def abort_all(self) -> None:
        """Aborts every open request; each ends with finish_reason "abort"."""
        with self._lock:
            if not self._closed:
                self.backend.abort_all()

    # ----------------------------------------------------------------- requests (any thread)
    def submit(self, request_id: Any, prompt: list[int] | str, params: SamplingParams, sink: asyncio.Queue, *,
               tag: Any = None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Queues a request; its deltas arrive in `sink` as `(tag, Delta)`, on `loop` (default: the running one)."""
        self.submit_batch([(request_id, prompt, params, tag)], sink, loop=loop)

    def submit_batch(self, requests: list[tuple[Any, list[int] | str, SamplingParams, Any]], sink: asyncio.Queue, *,
                     loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Queues `(request_id, prompt, params, tag)`s, all or none: raises EngineDeadError (not running),
        EngineDrainingError (shutting down) or EngineOverloadedError (the waiting queue is full). A request id
        that is already open fails that request alone (a final delta with finish_reason "error")."""
        loop = loop or asyncio.get_running_loop()
        now = time.monotonic()
        adds = [Add(rid, prompt, params, len(prompt) if not isinstance(prompt, str) else 0)
                for rid, prompt, params, _ in requests]
        num_tokens = sum(a.num_tokens for a in adds)
        duplicates = []
        with self._lock:
            if not self.is_alive:
                raise EngineDeadError(f"the engine is not running{f': {self.failure!r}' if self.failure else ''}")
            if not self._accepting:
                raise EngineDrainingError("the server is shutting down and accepts no new requests")
            waiting, tokens = self._waiting_locked()
            if waiting + len(adds) > self.max_waiting_requests:
                raise EngineOverloadedError(f"the server is busy: {waiting} requests are waiting and this one adds "
                                            f"{len(adds)} (limit {self.max_waiting_requests}); retry later")
            if tokens + num_tokens > self.max_queued_tokens:
                raise EngineOverloadedError(f"the server is busy: {tokens} prompt tokens are waiting and this request "
                                            f"adds {num_tokens} (limit {self.max_queued_tokens}); retry later")
            fresh = []
            for add, (_, _, _, tag) in zip(adds, requests):
                if add.request_id in self._open:
                    duplicates.append((sink, tag, Delta("", (), add.num_tokens, 0, "error",
                                                        f"request id {add.request_id!r} is already running")))
                else:
                    self._open[add.request_id] = _Open(sink, loop, tag, now, add.num_tokens)
                    fresh.append(add)
            self._sent = (self._sent[0] + len(fresh), self._sent[1] + sum(a.num_tokens for a in fresh))
            self.backend.add(fresh)  # under the lock: an abort from another thread cannot overtake its add
        if duplicates:
            for *_, delta in duplicates:
                self.metrics.finished["error"].inc()
            _deliver(loop, duplicates)

    def abort(self, request_id: Any) -> None:
        """Aborts a request (a no-op when it has finished); its blocks and slot are freed on the engine's next
        iteration."""
        with self._lock:
            if request_id in self._open and not self._closed:
                self.backend.abort(request_id)

    async def generate(self, request_id: Any, prompt: list[int] | str, params: SamplingParams) -> AsyncIterator[Delta]:
        """Yields the request's deltas; the last one is finished. Leaving early aborts the request."""
        sink: asyncio.Queue = asyncio.Queue()
        self.submit(request_id, prompt, params, sink)
        finished = False
        try:
            while not finished:
                _, delta = await sink.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                self.abort(request_id)

    def _waiting_locked(self) -> tuple[int, int]:
        """(requests, prompt tokens) waiting: handed to the loop and not taken yet, or in the scheduler."""
        return (self._sent[0] - self._taken[0] + self._snapshot[0],
                self._sent[1] - self._taken[1] + self._snapshot[1])

    def refresh_gauges(self) -> None:
        """Sets the waiting gauge from the queue as it is now (any thread; /metrics calls it on each scrape)."""
        with self._lock:
            self.metrics.waiting.set(self._waiting_locked()[0])

    # ----------------------------------------------------------------- from the engine (its thread or receiver)
    def _on_outputs(self, out: Outputs) -> None:
        now = time.monotonic()
        m = self.metrics
        delivered: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        observed = []
        with self._lock:
            self._taken, self._snapshot = out.taken, out.waiting
            queued = self._sent[0] - self._taken[0]
            for request_id, delta in out.items:
                r = self._open.get(request_id)
                if r is None:
                    continue
                observed.append((r, delta, r.last_token_time))
                if delta.token_ids:
                    r.last_token_time = now
                r.num_output_tokens = delta.num_output_tokens
                if delta.finished:
                    del self._open[request_id]
                delivered[r.loop].append((r.sink, r.tag, delta))
        for _, num_tokens in out.admitted:
            m.prompt_tokens.inc(num_tokens)
        for r, delta, last in observed:
            if delta.token_ids:
                if last is None:
                    m.ttft.observe(now - r.arrival)
                else:
                    gap = (now - last) / len(delta.token_ids)
                    for _ in delta.token_ids:
                        m.itl.observe(gap)
                m.generation_tokens.inc(len(delta.token_ids))
            if delta.finished:
                m.finished.get(delta.finish_reason, m.finished["error"]).inc()
                if delta.finish_reason in ("stop", "length"):
                    m.e2e.observe(now - r.arrival)
        if out.gauges is not None:
            m.set_engine_gauges(out.gauges, num_queued=queued)
        if out.sent_at:
            m.delivery_pipe.observe(max(0.0, now - out.sent_at))
        for loop, items in delivered.items():
            _deliver(loop, items, since=now, queue_delay=m.delivery_queue)

    def _on_fatal(self, error: BaseException) -> None:
        """The engine cannot continue: every open request fails, `on_fatal` is called."""
        from jhybrid.engine.llm_engine import EngineFailure

        what = "the engine cannot continue" if isinstance(error, EngineFailure) else "the engine failed"
        log.critical("%s; failing every open request", what, exc_info=error)
        with self._lock:
            self.failure, self._closed = error, True  # is_alive is False before anyone hears of the failure
        self._finish_open("error", f"{what}: {error!r}")
        if self.on_fatal is not None:
            try:
                self.on_fatal(error)
            except Exception:  # noqa: BLE001
                log.exception("on_fatal callback failed")

    def _on_stopped(self) -> None:
        with self._lock:
            self._closed = True
        self._finish_open("abort", None)  # none should be left: stopping aborts every request

    def _finish_open(self, reason: str, error: str | None) -> None:
        with self._lock:
            open_, self._open = self._open, {}
        delivered: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for r in open_.values():
            self.metrics.finished[reason].inc()
            delivered[r.loop].append((r.sink, r.tag, Delta("", (), r.num_tokens, r.num_output_tokens, reason, error)))
        for loop, items in delivered.items():
            _deliver(loop, items)


def _deliver(loop: asyncio.AbstractEventLoop, items: list, *, since: float | None = None, queue_delay=None) -> None:
    """Hands `items` to their sinks on `loop`; `queue_delay` (a histogram) observes how long after `since` (monotonic)
    the loop got to it."""
    def put_all():
        if queue_delay is not None:
            queue_delay.observe(time.monotonic() - since)
        for sink, tag, delta in items:
            sink.put_nowait((tag, delta))

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # that event loop is closed: nobody is listening
        pass


def name_os_thread(name: str) -> None:
    """Names the calling thread for the OS too (Linux: `top -H`, /proc/PID/task/TID/comm), so a profile of
    the server tells the engine thread from the event loop and XLA's threads. Best effort."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


__all__ = ["ADDS_PER_ITERATION", "AsyncEngine", "Delta", "EngineDeadError", "EngineDrainingError",
           "EngineOverloadedError", "ThreadBackend"]
