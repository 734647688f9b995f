"""The engine behind the server: one background thread steps the `Engine`; async callers submit
requests and receive their events, so that concurrent requests share every model forward
(continuous batching: requests join and leave between steps).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from clover.engine.engine import Engine, Event, GenerationResult
from clover.engine.sampling import InvalidParameter, SamplingParams
from clover.engine.structured import GrammarError, GrammarState


class QueueFull(RuntimeError):
    """More requests are queued than the server accepts."""


class ShuttingDown(RuntimeError):
    """The server stopped before this request finished (its stream gets this as a final event)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    finished: bool = False


@dataclass
class Stats:
    """Running totals of the engine thread (exported on /metrics; per-request figures go to the observers)."""

    requests: int = 0
    rejected: int = 0
    aborted: int = 0
    steps: int = 0


@dataclass
class RequestRecord:
    """The timeline of one finished request (perf_counter seconds), handed to the observers."""

    submitted: float
    first_token: float | None = None
    last_token: float | None = None
    token_gaps: list[float] = field(default_factory=list)  # per token after the first: the gap since the
    # previous event, shared evenly by the tokens that event carried (a block arrives at once)
    finished: float = 0.0
    result: GenerationResult | None = None


class Observer(Protocol):
    def request_finished(self, record: RequestRecord) -> None: ...
    def request_ended(self, reason: str) -> None: ...   # ended without a result: "abort" or "error"


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting: int = 64) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.stats = Stats()
        self.observers: list[Observer] = []      # told about every finished request (the server's metrics)
        self._records: dict[str, RequestRecord] = {}
        self._lock = threading.Lock()
        self._submit: list[tuple[str, list[int], SamplingParams, GrammarState | None]] = []
        self._abort: list[str] = []
        self._calls: list[tuple[Callable[[Engine], Any], asyncio.Future]] = []
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="clover-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Let in-flight requests finish for up to `timeout` seconds, then cancel the rest."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        with self._lock:
            self._abort.extend(self._streams)
            cut = [s for s in self._streams.values() if not s.finished]
            self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        with self._lock:   # calls that came after the thread's last round get an answer too
            calls, self._calls = self._calls, []
        for _, future in calls:
            try:
                future.get_loop().call_soon_threadsafe(
                    lambda f=future: f.done() or f.set_exception(ShuttingDown("the server is shutting down")))
            except RuntimeError:
                pass
        for stream in cut:   # a final event for every stream cut short, rather than a silent hang-up
            stream.finished = True
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, ShuttingDown(
                    f"the server shut down after {timeout:.0f} s of grace, before this request finished"))
            except RuntimeError:  # the caller's event loop is gone
                pass

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    @property
    def queue_depth(self) -> int:
        """Requests accepted but not yet running (scoring calls included)."""
        return len(self._submit) + len(self.engine.waiting) + len(self._calls)

    def _let_in(self, admit: bool = True) -> None:
        """ShuttingDown once the server stops, else (with `admit`) `_admit` (the caller holds the lock)."""
        if self._stop:
            raise ShuttingDown("the server is shutting down")
        if admit:
            self._admit()

    def _admit(self) -> None:
        """QueueFull when the queue holds max_waiting requests (the caller holds the lock). Requests that free
        batch slots will take at the next step are not waiting: a burst fills the batch and then the queue."""
        free = max(0, self.engine.max_batch_size - self.engine.num_running)
        if self.queue_depth - free >= self.max_waiting:
            self.stats.rejected += 1
            raise QueueFull(f"the server queue is full ({self.max_waiting} waiting requests); retry later")

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[Event]:
        """Events of one request; leaving the iteration early (a disconnected client) aborts it."""
        grammar = None
        if params.constraint is not None:   # its grammar compiled here, not on the engine thread (the batch
            with self._lock:                # would wait for it), once the request would be let in
                self._let_in()
            try:
                grammar = await asyncio.to_thread(self.engine.prepare_grammar, params.constraint)
            except GrammarError as exc:   # (one that matches no text: found only by building it)
                if params.constraint.origin is None:
                    raise
                raise InvalidParameter(params.constraint.origin, str(exc)) from None
        rid = f"r{next(self._ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._let_in()
            self._streams[rid] = stream
            self._records[rid] = RequestRecord(submitted=time.perf_counter())
            self._submit.append((rid, list(prompt_ids), params, grammar))
            self.stats.requests += 1
        self._wake.set()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                with self._lock:
                    self._abort.append(rid)
                    self.stats.aborted += 1
                self._wake.set()

    async def call(self, fn: Callable[[Engine], Any], admit: bool = True) -> Any:
        """Run `fn(engine)` on the engine thread between two steps (the model is never used by two threads
        at once) and return its result; its exception is raised here. Used for prompt scoring: a call waits
        in the queue as a request does (`admit`: refused with QueueFull when it is full; a request's later
        calls pass), one runs per round, and one whose caller has gone (cancelled) is skipped."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._let_in(admit)
            self._calls.append((fn, future))
        self._wake.set()
        return await future

    def _run_calls(self) -> None:
        """The oldest call whose caller still waits (one per round: generation steps go on between them)."""
        with self._lock:
            live = [c for c in self._calls if not c[1].cancelled()]   # (a read of a flag another thread sets)
            calls, self._calls = live[:1], live[1:]
        for fn, future in calls:
            try:
                with torch.inference_mode():
                    outcome, ok = fn(self.engine), True
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                outcome, ok = exc, False
            setter = future.set_result if ok else future.set_exception

            def settle(future: asyncio.Future = future, setter: Callable = setter, outcome: Any = outcome) -> None:
                if not future.done():   # the caller may have gone (cancelled)
                    setter(outcome)

            try:
                future.get_loop().call_soon_threadsafe(settle)
            except RuntimeError:  # the caller's event loop is gone
                pass

    def _deliver(self, rid: str, item: Event | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(rid)
            if stream is None:
                return
            if isinstance(item, BaseException) or item.finished:
                stream.finished = True
                self._streams.pop(rid, None)
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is gone
            pass

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running (/health says so)."""
        return self._thread.is_alive()

    def _fail_all(self, exc: BaseException) -> None:
        """A bug on the engine thread: fail every request in flight with it rather than hang them."""
        self._records.clear()
        self.engine.clear()   # (not request by request: an abort may be what failed)
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self._deliver(rid, RuntimeError(f"engine failure: {exc}"))

    def _run(self) -> None:
        while True:
            try:
                if self._round():
                    return
            except Exception as exc:  # noqa: BLE001 - a bug between steps must not end the thread (every request would hang)
                self._fail_all(exc)

    def _round(self) -> bool:
        """One round of the engine thread: aborts, new requests, calls, then a step. True: stopped."""
        with self._lock:
            submit, self._submit = self._submit, []
            abort, self._abort = self._abort, []
        for rid in abort:
            if self.engine.abort(rid):
                for observer in self.observers:
                    observer.request_ended("abort")
            self._records.pop(rid, None)
            with self._lock:
                self._streams.pop(rid, None)
        for rid, ids, params, grammar in submit:
            with self._lock:
                live = rid in self._streams
            if not live:
                continue  # aborted before it started
            try:
                self.engine.add_request(ids, params, request_id=rid, grammar=grammar)
            except ValueError as exc:
                self._records.pop(rid, None)
                self._deliver(rid, exc)
        self._run_calls()
        if self._stop and not self.engine.has_unfinished():
            return True
        if not self.engine.has_unfinished():
            if self._calls:   # (the next call at once)
                return False
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            return False
        with torch.inference_mode():
            events = self.engine.step()   # (an exception, a bug, fails the requests in flight: `_run`)
        self.stats.steps += 1
        now = time.perf_counter()
        for ev in events:
            record = self._records.get(ev.request_id)
            if ev.error is not None:  # this request failed alone; the others go on
                self._records.pop(ev.request_id, None)
                for observer in self.observers:
                    observer.request_ended("error")
                failure = ValueError if ev.invalid else RuntimeError   # the request's fault (400) or ours
                self._deliver(ev.request_id, failure(f"generation failed: {ev.error}"))
                continue
            if record is not None and ev.token_ids:
                if record.first_token is None:
                    record.first_token = now
                    record.token_gaps += [0.0] * (len(ev.token_ids) - 1)  # arrived with the first
                else:
                    record.token_gaps += [(now - record.last_token) / len(ev.token_ids)] * len(ev.token_ids)
                record.last_token = now
            if ev.finished and ev.result is not None and record is not None:
                record.finished, record.result = now, ev.result
                for observer in self.observers:
                    observer.request_finished(record)
            if ev.finished:
                self._records.pop(ev.request_id, None)
            self._deliver(ev.request_id, ev)
        return False
