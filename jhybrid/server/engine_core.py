"""The engine side of a served engine: `EngineLoop` owns an `LLMEngine`, takes requests and aborts from its inbox,
steps while there is work, and emits what each iteration changed as `Outputs` (the requests' `Delta`s, the
admission counters and, now and then, the gauges).

It runs where the engine is: on a thread of the server process, or alone in the engine process
(`engine_process.py`), where it has a GIL of its own. `AsyncEngine` (the server's side) feeds the inbox and
turns `Outputs` into stream events and metrics; everything that crosses between them is plain, picklable data.

- The inbox: adds, and control commands (abort, abort_all, stop) under one condition. Each iteration takes every
  control command and at most `ADDS_PER_ITERATION` adds, so a backlog of adds never holds up steps or aborts;
  an abort of a request still in the inbox drops it there (it ends with finish_reason "abort", no token).
- Text that could be the start of a stop string is held back (as `LLM.stream` does): the engine trims the stop
  string at finish, so a held-back prefix is either released later or never sent.
- A step that raises fails the request behind it (`LLMEngine.safe_step`); the others go on. When the engine
  itself cannot continue, `run` raises and the owner fails every open request.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from jhybrid.engine.sampling import SamplingParams

log = logging.getLogger("jhybrid.server")

ADDS_PER_ITERATION = 64  # adds the loop takes between two steps
GAUGE_PERIOD = 0.05  # seconds between two gauge snapshots while stepping


@dataclasses.dataclass(frozen=True)
class Delta:
    """What one request gained in one engine iteration. The last delta of a request has `finish_reason` set:
    "stop" | "length" | "abort" | "error" (then `error` says why) and `cumulative_logprob`, the sum of its
    tokens' log-probabilities under the model. `token_logprobs`: the log-probability of each of `token_ids`;
    `logprobs`: their top-k {token id: logprob} when the request asked (`SamplingParams.logprobs`);
    `prompt_logprobs`: on a request's first delta, per prompt position, when it asked (`prompt_logprobs`).
    `num_cached_tokens` (the last delta, with prefix caching on): prompt tokens reused from the prefix cache."""

    text: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    error: str | None = None
    cumulative_logprob: float | None = None
    token_logprobs: tuple[float, ...] = ()
    logprobs: tuple[dict[int, float], ...] | None = None
    prompt_logprobs: tuple[dict[int, float] | None, ...] | None = None
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class Add:
    """A request for the loop: `num_tokens` prompt tokens (0 for a text prompt, tokenized by the engine)."""

    request_id: Any
    prompt: list[int] | str
    params: SamplingParams
    num_tokens: int


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What one iteration of the loop changed.

    items: `(request_id, Delta)` of every request that gained text or tokens, or finished.
    admitted: `(request_id, prompt tokens)` of the requests added to the engine this iteration.
    taken: adds taken from the inbox since the loop started, `(requests, prompt tokens)`.
    waiting: the scheduler's waiting queue after the iteration, `(requests, prompt tokens not yet prefilled)`.
    gauges: `engine_gauges(engine)` at most every GAUGE_PERIOD seconds, else None.
    sent_at: `time.monotonic()` when the loop emitted it (CLOCK_MONOTONIC is one clock for every process of the
    machine, so the server process can time the hop from the engine process: `jhybrid:output_delivery_seconds`).
    """

    items: list[tuple[Any, Delta]]
    admitted: list[tuple[Any, int]]
    taken: tuple[int, int]
    waiting: tuple[int, int]
    gauges: dict[str, float] | None = None
    sent_at: float = 0.0


def engine_gauges(engine) -> dict[str, float]:
    """The engine's state as numbers, for the metrics (`EngineMetrics.set_engine_gauges`)."""
    sched = engine.scheduler
    stats = engine.stats() if hasattr(engine, "stats") else {}
    return {**stats, "running": len(sched.running), "waiting": len(sched.waiting),
            "preempted": sum(1 for s in sched.waiting if s.num_preemptions), "num_preemptions": engine.num_preemptions,
            "blocks_used": engine.blocks.num_used, "blocks_total": engine.blocks.capacity - 1,
            "slots_used": engine.slots.num_used, "slots_total": engine.slots.capacity - 1}


@dataclasses.dataclass
class _Tracked:
    seq: Any
    holdback: int  # chars that might start a stop string
    num_sent_chars: int = 0
    num_sent_ids: int = 0


class EngineLoop:
    """`run()` on one thread; `add` / `abort` / `abort_all` / `stop` from any thread. `emit(outputs)` is called
    on the loop's thread after every iteration."""

    def __init__(self, engine, emit: Callable[[Outputs], None]):
        self.engine = engine
        self.emit = emit
        self._cond = threading.Condition()  # guards the inbox
        self._adds: collections.deque[Add] = collections.deque()
        self._controls: collections.deque[tuple] = collections.deque()
        self._queued_ids: set = set()  # ids of adds in the inbox
        self._cancelled: set = set()  # ... of which aborted
        self._taken = (0, 0)
        self._live: dict[Any, _Tracked] = {}  # the loop's thread only
        self._last_gauges = 0.0

    # ----------------------------------------------------------------- the inbox (any thread)
    def add(self, adds: list[Add]) -> None:
        with self._cond:
            self._adds.extend(adds)
            self._queued_ids.update(a.request_id for a in adds)
            self._cond.notify()

    def abort(self, request_id: Any) -> None:
        """Aborts a request (a no-op when it has finished)."""
        with self._cond:
            if request_id in self._queued_ids:
                self._cancelled.add(request_id)
            else:
                self._controls.append(("abort", request_id))
            self._cond.notify()

    def abort_all(self) -> None:
        with self._cond:
            self._cancelled |= self._queued_ids
            self._controls.append(("abort_all",))
            self._cond.notify()

    def stop(self) -> None:
        """Aborts every request (queued ones too) and ends `run`."""
        with self._cond:
            self._cancelled |= self._queued_ids
            self._controls.append(("stop",))
            self._cond.notify()

    # ----------------------------------------------------------------- the loop
    def run(self) -> None:
        """Steps until `stop()`; raises when the engine cannot continue (the caller fails every open request)."""
        engine = self.engine
        while True:
            controls, adds, cancelled = self._take()
            items: list[tuple[Any, Delta]] = []
            admitted: list[tuple[Any, int]] = []
            stop = self._control(controls, items)
            for add in adds:
                if add.request_id in cancelled or stop:
                    items.append((add.request_id, Delta("", (), add.num_tokens, 0, "abort")))
                else:
                    self._add(add, items, admitted)
            if not stop and engine.has_unfinished():
                updated, failed = engine.safe_step()
                self._publish(updated + failed, items)
            self._emit(items, admitted, force_gauges=stop or not engine.has_unfinished())
            if stop:
                return

    def _take(self) -> tuple[list[tuple], list[Add], set]:
        """Waits for work; takes every control command and up to ADDS_PER_ITERATION adds."""
        with self._cond:
            while not self._controls and not self._adds and not self.engine.has_unfinished():
                self._cond.wait()
            controls = list(self._controls)
            self._controls.clear()
            stopping = any(c[0] == "stop" for c in controls)
            n = len(self._adds) if stopping else min(len(self._adds), ADDS_PER_ITERATION)
            adds = [self._adds.popleft() for _ in range(n)]
            cancelled = set()
            for a in adds:
                self._queued_ids.discard(a.request_id)
                if a.request_id in self._cancelled:
                    self._cancelled.discard(a.request_id)
                    cancelled.add(a.request_id)
            self._taken = (self._taken[0] + len(adds), self._taken[1] + sum(a.num_tokens for a in adds))
            return controls, adds, cancelled

    def _control(self, controls: list[tuple], items: list) -> bool:
        """Handles control commands; True on stop."""
        for cmd in controls:
            if cmd[0] in ("stop", "abort_all"):
                for request_id in list(self._live):
                    self.engine.abort(request_id)
                self._publish([t.seq for t in self._live.values()], items)
                if cmd[0] == "stop":
                    return True
            else:
                tracked = self._live.get(cmd[1])
                if tracked is not None:
                    self.engine.abort(cmd[1])
                    self._publish([tracked.seq], items)
        return False

    def _add(self, a: Add, items: list, admitted: list) -> None:
        if a.request_id in self._live:
            items.append((a.request_id, Delta("", (), a.num_tokens, 0, "error",
                                              f"request id {a.request_id!r} is already running")))
            return
        try:
            seq = self.engine.add_request(a.request_id, a.prompt, a.params)
        except Exception as e:  # noqa: BLE001 - a bad request (or a tokenizer that raises) fails that request alone
            log.warning("request %r could not be added: %r", a.request_id, e)
            items.append((a.request_id, Delta("", (), a.num_tokens, 0, "error", f"the request could not be added: {e}")))
            return
        holdback = max((len(s) for s in a.params.stop), default=1) - 1
        self._live[a.request_id] = _Tracked(seq, holdback)
        if not seq.is_finished:
            admitted.append((a.request_id, len(seq.prompt_ids)))
        else:
            self._publish([seq], items)

    def _publish(self, seqs, items: list) -> None:
        """Appends the deltas of `seqs` to `items`; forgets (and releases) the finished ones."""
        for seq in seqs:
            t = self._live.get(seq.request_id)
            if t is None or t.seq is not seq:
                continue
            delta = self._delta(t)
            if delta is None:
                continue
            items.append((seq.request_id, delta))
            if delta.finished:
                del self._live[seq.request_id]
                self.engine.release(seq.request_id)

    @staticmethod
    def _delta(t: _Tracked) -> Delta | None:
        seq = t.seq
        output_ids = seq.output_ids
        first = t.num_sent_ids
        new_ids = tuple(output_ids[first:])
        t.num_sent_ids = len(output_ids)
        end = len(seq.text) if seq.is_finished else len(seq.text) - t.holdback
        text = seq.text[t.num_sent_chars : end] if end > t.num_sent_chars else ""
        t.num_sent_chars = max(t.num_sent_chars, end)
        if not seq.is_finished and not new_ids and not text:
            return None
        token_logprobs = tuple(seq.token_logprobs[first : first + len(new_ids)])
        logprobs = tuple(seq.logprobs[first : first + len(new_ids)]) if seq.params.logprobs is not None else None
        prompt_logprobs = getattr(seq, "prompt_logprobs", None)
        if prompt_logprobs is not None and first == 0 and (new_ids or seq.is_finished):
            prompt_logprobs = tuple(prompt_logprobs)
        else:
            prompt_logprobs = None
        if seq.is_finished:
            return Delta(text, new_ids, len(seq.prompt_ids), len(output_ids), seq.finish_reason, seq.error,
                         float(sum(seq.token_logprobs)), token_logprobs, logprobs, prompt_logprobs,
                         getattr(seq, "num_cached_tokens", None))
        return Delta(text, new_ids, len(seq.prompt_ids), len(output_ids), None, None, None, token_logprobs, logprobs,
                     prompt_logprobs)

    def _emit(self, items: list, admitted: list, force_gauges: bool) -> None:
        sched = self.engine.scheduler
        waiting = (len(sched.waiting), sum(len(s.token_ids) - s.num_computed for s in sched.waiting))
        now = time.monotonic()
        gauges = None
        if force_gauges or now - self._last_gauges >= GAUGE_PERIOD:
            gauges, self._last_gauges = engine_gauges(self.engine), now
        self.emit(Outputs(items, admitted, self._taken, waiting, gauges, time.monotonic()))


__all__ = ["ADDS_PER_ITERATION", "Add", "Delta", "EngineLoop", "Outputs", "engine_gauges"]
