"""The server's engine: one thread steps the engine core, asyncio handlers submit, stream and abort.

    engine = AsyncEngine(llm, max_waiting=256)
    engine.start()
    handle = engine.submit([("r-0", ids, params)])   # ServerBusy / EngineStopped before anything is queued
    try:
        async for index, chunk in handle:            # StreamChunk per token, the last has finish_reason
            ...
    finally:
        handle.close()                               # aborts what is unfinished
    engine.shutdown()

The core is single-threaded, so every call into it happens on the engine thread: handlers
post commands (add, abort) to an inbox and receive chunks on an asyncio queue.  The
thread blocks on the inbox when there is nothing to step.  A handler that stops
listening (its client went away, its task was cancelled) aborts its requests, which
frees their KV blocks on the next turn of the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from quill.engine.core import EngineStats
from quill.engine.output import StreamChunk
from quill.engine.sampling import SamplingParams
from quill.errors import GenerationError, QuillError

log = logging.getLogger("quill.serving")


class ServerBusy(QuillError):
    """The waiting queue is full: the request was not queued (answer 503 with Retry-After)."""


class EngineStopped(QuillError):
    """The engine is shutting down or its thread has died; no request is accepted."""


@dataclass(eq=False)
class _Submission:
    """One handler's requests (``n`` choices or several prompts) and where their chunks go."""

    requests: list[tuple[str, list[int], SamplingParams]]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float = field(default_factory=time.monotonic)
    last_token: dict[str, float] = field(default_factory=dict)


class RequestHandle:
    """The chunks of one submission: ``async for index, chunk in handle``; ``close()`` aborts the rest."""

    def __init__(self, engine: "AsyncEngine", sub: _Submission):
        self.engine, self.sub = engine, sub
        self.index = {rid: i for i, (rid, _, _) in enumerate(sub.requests)}
        self.pending = set(self.index)
        self.closed = False

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> tuple[int, StreamChunk]:
        if not self.pending:
            self.close()
            raise StopAsyncIteration
        rid, item = await self.sub.queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finish_reason is not None:
            self.pending.discard(rid)
        return self.index[rid], item

    def close(self) -> None:
        """Abort every unfinished request of the submission (idempotent; frees their KV blocks)."""
        if self.closed:
            return
        self.closed = True
        self.engine.active -= len(self.index)
        for rid in self.pending:
            self.engine._post("abort", rid)


class AsyncEngine:
    """Runs an ``LLM``'s engine core on its own thread for asyncio callers.

    ``max_waiting`` bounds the requests queued beyond the running batch (``max_num_seqs``);
    past it ``generate`` raises ``ServerBusy`` at once.  ``metrics`` (``ServerMetrics``) is
    told every token's latency and every finished request.
    """

    def __init__(self, llm, max_waiting: int = 256, metrics=None, executor=None):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise GenerationError(f"max_waiting: expected an integer >= 0, found {max_waiting!r}")
        self.llm = llm
        self.processor = llm.processor
        self.core = llm.engine
        self.metrics = metrics
        self.capacity = self.core.config.max_num_seqs + max_waiting
        self.active = 0  # requests submitted and not finished (touched on the event loop only)
        self._inbox: deque[tuple[str, object]] = deque()
        self._wake = threading.Condition()
        self._subs: dict[str, _Submission] = {}  # request id -> its submission (engine thread only)
        self._stats = self.core.stats()
        self._stopping = False
        # The thread that loaded the model should step it too: the OpenMP runtime (libgomp) keeps a
        # worker pool per thread that starts parallel work, and with two pools on two CPUs it stops
        # spinning between ops, so every kernel call pays a futex wake-up (decode ~30% slower).
        # ``executor``: a one-thread executor that built ``llm``; None: a thread of our own.
        self._executor = executor
        self._thread: threading.Thread | None = None
        self._future = None
        self.error: BaseException | None = None

    # ---- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._executor is not None:
            self._future = self._executor.submit(self._run)
            return
        self._thread = threading.Thread(target=self._run, name="quill-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever still runs and stop the thread."""
        self._post("stop", None)
        if self._future is not None:
            concurrent.futures.wait([self._future], timeout)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        if self._future is not None:
            running = not self._future.done()
        else:
            running = self._thread is not None and self._thread.is_alive()
        return running and not self._stopping

    def stats(self) -> EngineStats:
        """The core's counters as of the end of the last step (safe from any thread)."""
        return self._stats

    # ---- the asyncio side -------------------------------------------------------------------------
    def check(self, ids: Sequence[int], label: str) -> list[int]:
        """Validate a prompt against the model (GenerationError names what is wrong)."""
        return self.core.check_request(ids, label)

    def submit(self, requests: list[tuple[str, list[int], SamplingParams]],
               affinity: str | None = None, streamed: bool = True) -> "RequestHandle":
        """Queue ``requests`` (id, prompt ids, params) to run together; iterate the handle for their chunks.

        ``affinity`` and ``streamed`` are hints for servers over several engines; one engine has no use for them.

        Raises ``ServerBusy`` when the queue is full and ``EngineStopped`` when the engine is not running,
        before anything is queued.  The caller must ``close()`` the handle (aborting what is unfinished)."""
        if not self.alive:
            raise EngineStopped("the engine is not running" + (f": {self.error}" if self.error else ""))
        if self.active + len(requests) > self.capacity:
            raise ServerBusy(f"{self.active} requests are running or waiting (the server takes at most "
                             f"{self.capacity}); retry later")
        sub = _Submission(list(requests), asyncio.get_running_loop(), asyncio.Queue())
        self.active += len(requests)
        self._post("add", sub)
        return RequestHandle(self, sub)

    # ---- the engine thread ------------------------------------------------------------------------
    def _post(self, kind: str, payload) -> None:
        with self._wake:
            self._inbox.append((kind, payload))
            self._wake.notify()

    def _take(self) -> list[tuple[str, object]]:
        with self._wake:
            while not self._inbox and not self.processor.has_work():
                self._wake.wait()
            items = list(self._inbox)
            self._inbox.clear()
        return items

    def _run(self) -> None:
        try:
            while True:
                for kind, payload in self._take():
                    if kind == "add":
                        self._add(payload)
                    elif kind == "abort":
                        self._abort(payload)
                    else:
                        self._stop()
                        return
                if self.processor.has_work():
                    self._step()
        except BaseException as e:  # a defect: say so to every waiting client instead of hanging them
            log.exception("the engine thread failed")
            self.error = e
            self._stopping = True
            for rid in list(self._subs):
                self._deliver(rid, EngineStopped(f"the engine failed: {type(e).__name__}: {e}"))

    def _add(self, sub: _Submission) -> None:
        added = []
        try:
            for rid, ids, params in sub.requests:
                self.processor.add(rid, None, ids, params)
                self._subs[rid] = sub
                added.append(rid)
        except QuillError as e:  # checked by the handler already; a race (e.g. a reused id) lands here
            for rid in added:
                self._abort(rid)
            self._subs[sub.requests[0][0]] = sub
            self._deliver(sub.requests[0][0], e)
            return
        self._stats = self.core.stats()

    def _abort(self, rid: str) -> None:
        self.processor.abort(rid)
        self._subs.pop(rid, None)
        self._stats = self.core.stats()

    def _step(self) -> None:
        events = self.processor.step()
        now = time.monotonic()
        for state, chunk in events:
            sub = self._subs.get(state.rid)
            if sub is None:
                continue
            self._observe(sub, state.rid, chunk, now)
            self._deliver(state.rid, chunk)
        self._stats = self.core.stats()

    def _observe(self, sub: _Submission, rid: str, chunk: StreamChunk, now: float) -> None:
        if self.metrics is None:
            return
        if chunk.token_id is not None:
            last = sub.last_token.get(rid)
            if last is None:
                self.metrics.ttft.observe(now - sub.arrival)
            else:
                self.metrics.itl.observe(now - last)
            sub.last_token[rid] = now
        if chunk.finish_reason is not None:
            self.metrics.finished(chunk.finish_reason, now - sub.arrival)

    def _deliver(self, rid: str, item) -> None:
        sub = self._subs.get(rid)
        if sub is None:
            return
        if isinstance(item, BaseException) or item.finish_reason is not None:
            self._subs.pop(rid, None)
        try:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, (rid, item))
        except RuntimeError:  # the handler's event loop is closed: nobody listens any more
            self.processor.abort(rid)

    def _stop(self) -> None:
        self._stopping = True
        for rid in list(self._subs):
            self._deliver(rid, EngineStopped("the server is shutting down"))
            self.processor.abort(rid)
        self._stats = self.core.stats()
