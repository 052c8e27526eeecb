"""The engine thread: one thread owns the (not thread-safe) `LLMEngine`; asyncio handlers talk to it by queue.

    engine = AsyncEngine(LLMEngine(model, ...), model_name="tiny")
    engine.start()
    async for delta in engine.generate("req-1", prompt_ids, SamplingParams(max_tokens=8)):
        print(delta.text, end="")
    engine.shutdown()

- Requests enter through a thread-safe `queue.Queue` of commands (add / abort / stop). The thread drains it
  between steps, steps while the engine has work, and blocks on it when idle (no busy loop).
- After each step it computes every updated request's `Delta` (new text and token ids) and hands them to
  the requests' asyncio queues with one `loop.call_soon_threadsafe` per event loop per step.
- Text that could be the start of a stop string is held back (as `LLM.stream` does): the engine trims the
  stop string at finish, so a held-back prefix is either released later or never sent.
- A consumer that stops early (client disconnected, task cancelled) sends an abort; the engine frees the
  request's KV blocks and state slot on its next iteration and the request ends with finish_reason "abort".
- If a step raises, every open request gets a final delta with `error` set, and `is_alive` turns False.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from jhybrid.engine.llm_engine import LLMEngine
from jhybrid.engine.sampling import SamplingParams
from jhybrid.server.metrics import EngineMetrics

log = logging.getLogger("jhybrid.server")


class EngineDeadError(RuntimeError):
    """The engine thread is not running (never started, shut down, or a step failed)."""


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one request gained in one engine step. The last delta of a request has `finish_reason` set:
    "stop" | "length" | "abort" | "error" (then `error` says why)."""

    text: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request."""

    seq: Any
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    tag: Any
    arrival: float
    holdback: int  # chars that might start a stop string
    num_sent_chars: int = 0
    num_sent_ids: int = 0
    last_token_time: float | None = None


class AsyncEngine:
    """Runs `engine` on a dedicated thread; `submit` / `generate` / `abort` may be called from any thread."""

    def __init__(self, engine: LLMEngine, *, model_name: str = "model", metrics: EngineMetrics | None = None):
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics or EngineMetrics(model_name)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[Any, _Tracked] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # orders submit() against shutdown
        self._closed = False
        self.failure: BaseException | None = None
        self.metrics.observe_engine(engine)

    # ----------------------------------------------------------------- facts the server validates against
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model.cfg.vocab_size

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> "AsyncEngine":
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="jhybrid-engine", daemon=True)
                self._thread.start()
        return self

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Aborts whatever runs, stops the thread and waits for it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    # ----------------------------------------------------------------- requests (any thread)
    def submit(self, request_id: Any, prompt: list[int] | str, params: SamplingParams, sink: asyncio.Queue, *,
               tag: Any = None, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Queues a request; its deltas arrive in `sink` as `(tag, Delta)`, on `loop` (default: the running one)."""
        loop = loop or asyncio.get_running_loop()
        with self._lock:
            if not self.is_alive:
                raise EngineDeadError(f"the engine is not running{f': {self.failure!r}' if self.failure else ''}")
            self._commands.put(("add", request_id, prompt, params, sink, loop, tag, time.monotonic()))

    def abort(self, request_id: Any) -> None:
        """Aborts a request (a no-op when it has finished); its blocks and slot are freed on the engine thread."""
        self._commands.put(("abort", request_id))

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

    # ----------------------------------------------------------------- the engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if not self._drain(block=not engine.has_unfinished()):
                    break
                if engine.has_unfinished():
                    self._publish(engine.step())
                self.metrics.observe_engine(engine)
        except BaseException as e:  # a failed step: fail every open request, stop serving
            log.exception("engine step failed; the engine thread stops")
            self.failure = e
            self._fail_all(f"the engine failed: {e!r}")
        finally:
            with self._lock:
                self._closed = True
            self._fail_queued()

    def _drain(self, block: bool) -> bool:
        """Handles queued commands (waiting for one when `block`); False on stop."""
        try:
            cmd = self._commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            if cmd[0] == "stop":
                for request_id in list(self._live):
                    self.engine.abort(request_id)
                self._publish([t.seq for t in self._live.values()])
                return False
            if cmd[0] == "add":
                self._add(*cmd[1:])
            else:
                self._abort(cmd[1])
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, request_id, prompt, params, sink, loop, tag, arrival) -> None:
        if request_id in self._live:
            delta = Delta("", (), 0, 0, "error", f"request id {request_id!r} is already running")
            return self._deliver(loop, [(sink, tag, delta)])
        try:
            seq = self.engine.add_request(request_id, prompt, params)
        except Exception as e:  # a bad request must not take the engine thread down
            return self._deliver(loop, [(sink, tag, Delta("", (), 0, 0, "error", str(e)))])
        holdback = max((len(s) for s in params.stop), default=1) - 1
        self._live[request_id] = _Tracked(seq, sink, loop, tag, arrival, holdback)
        if not seq.is_finished:
            self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
        self._publish([seq] if seq.is_finished else [])

    def _abort(self, request_id) -> None:
        tracked = self._live.get(request_id)
        if tracked is not None:
            self.engine.abort(request_id)
            self._publish([tracked.seq])

    def _publish(self, seqs) -> None:
        """Computes and delivers the deltas of `seqs`; forgets the finished ones."""
        now = time.monotonic()
        out: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for seq in seqs:
            t = self._live.get(seq.request_id)
            if t is None or t.seq is not seq:
                continue
            delta = self._delta(t, now)
            if delta is None:
                continue
            out[t.loop].append((t.sink, t.tag, delta))
            if delta.finished:
                del self._live[seq.request_id]
                self.engine.release(seq.request_id)
        for loop, items in out.items():
            self._deliver(loop, items)

    def _delta(self, t: _Tracked, now: float) -> Delta | None:
        seq, m = t.seq, self.metrics
        output_ids = seq.output_ids
        new_ids = tuple(output_ids[t.num_sent_ids :])
        t.num_sent_ids = len(output_ids)
        end = len(seq.text) if seq.is_finished else len(seq.text) - t.holdback
        text = seq.text[t.num_sent_chars : end] if end > t.num_sent_chars else ""
        t.num_sent_chars = max(t.num_sent_chars, end)
        if new_ids:
            if t.last_token_time is None:
                m.ttft.observe(now - t.arrival)
            else:
                for _ in new_ids:
                    m.itl.observe((now - t.last_token_time) / len(new_ids))
            t.last_token_time = now
            m.generation_tokens.inc(len(new_ids))
        if seq.is_finished:
            reason = seq.finish_reason
            m.finished.get(reason, m.finished["error"]).inc()
            if reason in ("stop", "length"):
                m.e2e.observe(now - t.arrival)
            return Delta(text, new_ids, len(seq.prompt_ids), len(output_ids), reason, seq.error)
        if not new_ids and not text:
            return None
        return Delta(text, new_ids, len(seq.prompt_ids), len(output_ids))

    @staticmethod
    def _deliver(loop: asyncio.AbstractEventLoop, items: list) -> None:
        def put_all():
            for sink, tag, delta in items:
                sink.put_nowait((tag, delta))

        try:
            loop.call_soon_threadsafe(put_all)
        except RuntimeError:  # that event loop is closed: nobody is listening
            pass

    def _fail_all(self, message: str) -> None:
        for request_id, t in list(self._live.items()):
            self._deliver(t.loop, [(t.sink, t.tag, Delta("", (), len(t.seq.prompt_ids), len(t.seq.output_ids), "error", message))])
        self._live.clear()

    def _fail_queued(self) -> None:
        """Answers adds that arrived after the loop ended, so no consumer waits forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, request_id, _, _, sink, loop, tag, _ = cmd
                self._deliver(loop, [(sink, tag, Delta("", (), 0, 0, "error", "the engine stopped"))])
