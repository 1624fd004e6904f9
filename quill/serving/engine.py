"""The server's engine: the engine core stepped for asyncio handlers that submit, stream and abort.

    engine = AsyncEngine(llm, max_waiting=256, on_loop=True)
    engine.start()                                   # on_loop: inside the event loop (e.g. a lifespan)
    handle = engine.submit([("r-0", ids, params)])   # ServerBusy / EngineStopped before anything is queued
    try:
        async for index, chunk in handle:            # StreamChunk per token, the last has finish_reason
            ...
    finally:
        handle.close()                               # aborts what is unfinished
    engine.shutdown()

The core is single-threaded, so every call into it happens in one place: handlers post
commands (add, abort) to an inbox and receive chunks on an asyncio queue.  A handler that
stops listening (its client went away, its task was cancelled) aborts its requests, which
frees their KV blocks before the next step.  Two drivers:

* ``on_loop=True`` (``quill serve``): a task on the handlers' own event loop runs a step, then
  yields so the handlers send what it made and new requests come in, then steps again.  The
  loop is busy for the length of a step (a few ms in decode, up to one chunked-prefill step).
  Nothing crosses threads: a hand-over to another thread wakes it, and on a small host that
  wake-up took a step more than the loop's work itself (2-core Zen 5, default model: ~0.3 ms of
  a 3 ms token; single-client decode through the server 0.85-0.92x of ``LLM.generate`` with the
  thread, 0.92-0.98x on the loop).
* otherwise (a Ray Serve replica, whose methods must stay responsive): a thread of its own (or
  ``executor``'s) steps the core and blocks on the inbox when there is nothing to do.

Either way one step's chunks for one submission travel together, a request that is not
streamed gets its chunks only when it ends, and ``stream_interval`` N > 1 (vLLM's
``--stream-interval``) holds a streamed request's tokens until N have gathered (its first
token and its end always go at once).

Faults stay with their request: one that fails while it is added, stepped or detokenized ends
with a chunk of finish reason "error" (``StreamChunk.error`` says what; the traceback is logged)
and the engine goes on.  Only an error that cannot be pinned on one request stops the engine:
every handler then gets ``EngineStopped`` and ``down_reason`` says why.
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
from quill.engine.sequence import Timings
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
    streamed: bool = True  # False: the handler answers only at the end, so chunks wait for it
    arrival: float = field(default_factory=time.monotonic)
    last_token: dict[str, float] = field(default_factory=dict)
    held: dict[str, list] = field(default_factory=dict)  # request id -> chunks not handed over yet
    started: set[str] = field(default_factory=set)  # requests whose first chunk was handed over


class RequestHandle:
    """The chunks of one submission: ``async for index, chunk in handle``; ``close()`` aborts the rest."""

    def __init__(self, engine: "AsyncEngine", sub: _Submission):
        self.engine, self.sub = engine, sub
        self.index = {rid: i for i, (rid, _, _) in enumerate(sub.requests)}
        self.pending = set(self.index)
        self.closed = False

    def __aiter__(self) -> "RequestHandle":
        return self

    def ready(self) -> bool:
        """Whether a chunk is waiting, so the next ``__anext__`` returns without waiting."""
        return not self.sub.queue.empty()

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
    """Runs an ``LLM``'s engine core for asyncio callers, on their event loop or on a thread.

    ``max_waiting`` bounds the requests queued beyond the running batch (``max_num_seqs``);
    past it ``generate`` raises ``ServerBusy`` at once.  ``metrics`` (``ServerMetrics``) is
    told every token's latency and every finished request.  ``stream_interval``: tokens a
    streamed request gathers before they are handed over (1: each at once).  ``on_loop``: step on
    the event loop that calls ``start()`` instead of a thread (see the module).
    """

    def __init__(self, llm, max_waiting: int = 256, metrics=None, executor=None, stream_interval: int = 1,
                 on_loop: bool = False):
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise GenerationError(f"max_waiting: expected an integer >= 0, found {max_waiting!r}")
        if isinstance(stream_interval, bool) or not isinstance(stream_interval, int) or stream_interval < 1:
            raise GenerationError(f"stream_interval: expected an integer >= 1, found {stream_interval!r}")
        if on_loop and executor is not None:
            raise GenerationError("AsyncEngine: on_loop steps on the event loop's thread, so it takes no executor")
        self.stream_interval = stream_interval
        self.on_loop = on_loop
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
        # ``executor``: a one-thread executor that built ``llm``; None: a thread of our own.  (On the
        # loop, load the model on the loop's thread: ``quill serve`` loads it on the main thread.)
        self._executor = executor
        self._thread: threading.Thread | None = None
        self._future = None
        self._loop: asyncio.AbstractEventLoop | None = None  # on_loop: the loop, its thread, its task
        self._loop_thread: int | None = None
        self._task: asyncio.Task | None = None
        self._kick: asyncio.Event | None = None  # set when the inbox gets something
        self._done = threading.Event()  # on_loop: the task has ended
        self.error: BaseException | None = None

    # ---- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start stepping (``on_loop``: call it on the event loop the handlers run on)."""
        if self.on_loop:
            self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
            self._kick = asyncio.Event()
            self._kick.set()  # anything posted before the start
            self._task = self._loop.create_task(self._run_on_loop(), name="quill-engine")
            return
        if self._executor is not None:
            self._future = self._executor.submit(self._run)
            return
        self._thread = threading.Thread(target=self._run, name="quill-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever still runs and stop stepping (waits for that unless called on the loop itself)."""
        self._post("stop", None)
        if self._task is not None and threading.get_ident() != self._loop_thread:
            self._done.wait(timeout)
        if self._future is not None:
            concurrent.futures.wait([self._future], timeout)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def down_reason(self) -> str | None:
        """None while the engine takes requests; otherwise why not (for /health)."""
        if self.alive:
            return None
        if self.error is not None:
            return f"the engine failed: {type(self.error).__name__}: {self.error}"
        return "the engine is shutting down" if self._stopping else "the engine is not running"

    @property
    def alive(self) -> bool:
        if self._task is not None:
            running = not self._task.done()
        elif self._future is not None:
            running = not self._future.done()
        else:
            running = self._thread is not None and self._thread.is_alive()
        return running and not self._stopping

    def stats(self) -> EngineStats:
        """The core's counters as of the end of the last step (safe from any thread)."""
        return self._stats

    # ---- the asyncio side -------------------------------------------------------------------------
    def check(self, ids: Sequence[int], label: str, params: SamplingParams | None = None) -> list[int]:
        """Validate a prompt, and ``params``' token ids, against the model (GenerationError names what is
        wrong); safe on any thread."""
        return self.core.check_request(ids, label, params)

    def submit(self, requests: list[tuple[str, list[int], SamplingParams]],
               affinity: str | None = None, streamed: bool = True) -> "RequestHandle":
        """Queue ``requests`` (id, prompt ids, params) to run together; iterate the handle for their chunks.

        ``affinity`` is a hint for servers over several engines.  ``streamed=False``: the caller reads
        nothing before the end, so each request's chunks are handed over together when it ends.

        Raises ``ServerBusy`` when the queue is full, ``GenerationError`` when it could never hold the
        submission, and ``EngineStopped`` when the engine is not running, before anything is queued.  The
        caller must ``close()`` the handle (aborting what is unfinished)."""
        if not self.alive:
            raise EngineStopped("the engine is not running" + (f": {self.error}" if self.error else ""))
        loop = asyncio.get_running_loop()
        if self.on_loop and loop is not self._loop:
            raise GenerationError("AsyncEngine(on_loop=True): submit from the event loop it was started on")
        if len(requests) > self.capacity:  # retrying cannot help
            raise GenerationError(f"{len(requests)} requests in one call (n x prompts), more than this server "
                                  f"ever holds at once: {self.capacity} (max_num_seqs + max_waiting)")
        if self.active + len(requests) > self.capacity:
            raise ServerBusy(f"{self.active} requests are running or waiting (the server takes at most "
                             f"{self.capacity}); retry later")
        sub = _Submission(list(requests), loop, asyncio.Queue(), streamed)
        self.active += len(requests)
        self._post("add", sub)
        return RequestHandle(self, sub)

    # ---- the stepping side (the engine thread, or the loop's task) ------------------------------------
    def _post(self, kind: str, payload) -> None:
        if not self.on_loop:
            with self._wake:
                self._inbox.append((kind, payload))
                self._wake.notify()
            return
        if self._loop is None or threading.get_ident() == self._loop_thread:  # not started yet, or on the loop
            self._inbox.append((kind, payload))
            if self._kick is not None:
                self._kick.set()
            return
        try:
            self._loop.call_soon_threadsafe(self._post, kind, payload)
        except RuntimeError:  # the loop is closed: nothing runs any more
            pass

    def _take(self) -> list[tuple[str, object]]:
        with self._wake:
            while not self._inbox and not self.processor.has_work():
                self._wake.wait()
            items = list(self._inbox)
            self._inbox.clear()
        return items

    def _apply(self, items: list[tuple[str, object]]) -> bool:
        """Carry out posted commands; False once told to stop."""
        for kind, payload in items:
            if kind == "add":
                self._add(payload)
            elif kind == "abort":
                self._abort(payload)
            else:
                self._stop()
                return False
        return True

    def _run(self) -> None:
        try:
            while self._apply(self._take()):
                if self.processor.has_work():
                    self._step()
        except BaseException as e:  # a defect: say so to every waiting client instead of hanging them
            self._fail(e)

    async def _run_on_loop(self) -> None:
        try:
            while True:
                items = list(self._inbox)
                self._inbox.clear()
                if not self._apply(items):
                    return
                if self.processor.has_work():
                    self._step()
                    await asyncio.sleep(0)  # the handlers send what the step made; requests come in
                elif not self._inbox:
                    self._kick.clear()
                    await self._kick.wait()
        except asyncio.CancelledError:  # the loop is closing under us: end every request
            self._stop()
            raise
        except Exception as e:  # a defect: say so to every waiting client instead of hanging them
            self._fail(e)
        finally:
            self._done.set()

    def _fail(self, e: BaseException) -> None:
        log.exception("the engine failed")
        self.error = e
        try:
            self._end_all(f"the engine failed: {type(e).__name__}: {e}")
        except Exception:  # the core could not free what they hold; every client has its error already
            log.exception("aborting the requests of the failed engine failed too")

    def _add(self, sub: _Submission) -> None:
        added = []
        try:
            for rid, ids, params in sub.requests:
                self.processor.add(rid, None, ids, params)
                self._subs[rid] = sub
                added.append(rid)
        except QuillError as e:  # checked by the handler already; a race (e.g. a reused id) lands here
            self._refuse(sub, added, e)
        except Exception as e:  # a fault of this submission's own: it fails, the engine goes on
            rid = sub.requests[len(added)][0]
            log.exception("adding request %s failed; the other requests go on", rid)
            if self.metrics is not None:
                self.metrics.finished("error", time.monotonic() - sub.arrival)
            failed = StreamChunk("", None, None, "error", Timings(), error=f"{type(e).__name__}: {e}")
            self._refuse(sub, added, failed, rid)
        self._stats = self.core.stats()

    def _refuse(self, sub: _Submission, added: list[str], error, rid: str | None = None) -> None:
        """End a submission that could not be added whole: drop what was, hand ``error`` (an exception,
        or an "error" chunk of request ``rid``) to its handler."""
        for done in added:
            self.processor.abort(done)
            self._subs.pop(done, None)
        rid = rid or sub.requests[0][0]
        self._subs[rid] = sub
        self._deliver(rid, error)

    def _abort(self, rid: str) -> None:
        self.processor.abort(rid)
        sub = self._subs.pop(rid, None)
        if sub is not None:  # it was running: its handler left (e.g. the client disconnected)
            sub.held.pop(rid, None)
            if self.metrics is not None:
                self.metrics.finished("abort", time.monotonic() - sub.arrival)
        self._stats = self.core.stats()

    def _step(self) -> None:
        events = self.processor.step()
        now = time.monotonic()
        ready: dict[_Submission, list] = {}  # one hand-over per submission and step
        for state, chunk in events:
            sub = self._subs.get(state.rid)
            if sub is None:
                continue
            self._observe(sub, state.rid, chunk, now)
            held = sub.held.setdefault(state.rid, [])
            held.append(chunk)
            if chunk.finish_reason is None and (not sub.streamed or (
                    state.rid in sub.started and len(held) < self.stream_interval)):
                continue
            sub.started.add(state.rid)
            del sub.held[state.rid]
            if chunk.finish_reason is not None:
                self._subs.pop(state.rid, None)
            ready.setdefault(sub, []).extend((state.rid, c) for c in held)
        for sub, items in ready.items():
            self._hand_over(sub, items)
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

    def _deliver(self, rid: str, error) -> None:
        """End request ``rid`` with ``error`` (an exception, or a last chunk), after whatever chunks it holds."""
        sub = self._subs.pop(rid, None)
        if sub is not None:
            self._hand_over(sub, [(rid, c) for c in sub.held.pop(rid, [])] + [(rid, error)])

    def _hand_over(self, sub: _Submission, items: list) -> None:
        """Put ``items`` ((request id, chunk or error), in order) on the submission's queue: one wake-up."""
        if self.on_loop:
            _put_all(sub.queue, items)
            return
        try:
            sub.loop.call_soon_threadsafe(_put_all, sub.queue, items)
        except RuntimeError:  # the handler's event loop is closed: nobody listens any more
            for rid in {rid for rid, _ in items}:
                self.processor.abort(rid)

    def _stop(self) -> None:
        self._end_all("the server is shutting down")
        self._stats = self.core.stats()

    def _end_all(self, why: str) -> None:
        """Tell every request's handler ``EngineStopped(why)``, then abort them all in the core."""
        self._stopping = True
        rids = list(self._subs)
        for rid in rids:
            self._deliver(rid, EngineStopped(why))
        for rid in rids:
            self.processor.abort(rid)


def _put_all(queue: asyncio.Queue, items: list) -> None:
    for item in items:
        queue.put_nowait(item)
