"""An engine on Ray Serve replicas, with ``AsyncEngine``'s shape, for ``OpenAIServing`` in the Ray ingress.

    engine = RemoteEngine(replicas_handle, limits, metrics)
    handle = await engine.submit([("r-0", ids, params)], affinity="9f2c...")  # ServerBusy / EngineStopped
    async for index, chunk in handle:      # StreamChunk per token, streamed from the replica as it decodes
        ...
    handle.close()                          # cancels the replica's stream: its requests are aborted there

A submission is one streaming call of ``QuillReplica.generate``; the replica answers first with
who it is (or why it refused: queue full, engine stopped), then with ``(index, chunk)`` items.
When the replica dies before any token reached the client, the call is made once more (the
router sends it to a live replica); after that the request ends with ``EngineStopped``, which
the ingress answers with a 503 (or an error event, when a stream has begun).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from quill.engine.core import PromptLimits
from quill.errors import GenerationError
from quill.serving.engine import EngineStopped, ServerBusy
from quill.serving.metrics import ServerMetrics

log = logging.getLogger("quill.serving")


class ReplicaFailed(EngineStopped):
    """The replica running a request died or became unreachable."""


def _replica_lost(e: BaseException) -> bool:
    """Errors that mean the replica (not the request) is gone."""
    from ray.exceptions import ActorUnavailableError, RayActorError
    from ray.serve.exceptions import ReplicaUnavailableError
    return isinstance(e, (RayActorError, ActorUnavailableError, ReplicaUnavailableError))


class ReplicaMetrics:
    """Per-replica counters of the ingress, in the server's registry."""

    def __init__(self, metrics: ServerMetrics):
        r = metrics.registry
        self.server = metrics
        self.requests = Counter("quill_replica_requests", "Submissions served, by replica", ["replica"], registry=r)
        self.info = Gauge("quill_replica_info", "Replicas seen by this ingress (1 per replica)",
                          ["replica", "pid", "node"], registry=r)
        self.retries = Counter("quill_replica_retries", "Submissions sent again after their replica died",
                               registry=r)
        self.failures = Counter("quill_replica_failures", "Submissions ended by a replica that died", registry=r)

    def served(self, who: dict) -> None:
        self.requests.labels(who["replica"]).inc()
        self.info.labels(who["replica"], str(who["pid"]), who["node"]).set(1)


@dataclass
class RemoteEngine:
    """``OpenAIServing``'s engine over a Ray Serve deployment handle to ``QuillReplica``."""

    replicas: object  # ray.serve.handle.DeploymentHandle
    limits: PromptLimits
    metrics: ReplicaMetrics
    retries: int = 1  # calls made again when a replica dies before the first token

    def check(self, ids, label: str, params=None) -> list[int]:
        if params is not None:
            self.limits.check_params(params)
        return self.limits.check(ids, label)

    async def submit(self, requests: list, affinity: str | None = None, streamed: bool = True) -> "RemoteHandle":
        """``streamed=False``: the caller answers only once all is done, so the chunks are gathered first
        and a replica that dies on the way costs a retry from scratch, not the request."""
        handle = RemoteHandle(self, list(requests), affinity, streamed)
        await handle.start()
        return handle


@dataclass
class _Sub:
    """What ``OpenAIServing`` reads back from a handle (``echo`` needs the prompt ids)."""

    requests: list


class RemoteHandle:
    """One submission's chunks from its replica: ``async for index, chunk in handle``; ``close()`` cancels."""

    def __init__(self, engine: RemoteEngine, requests: list, affinity: str | None, streamed: bool = True):
        self.engine, self.affinity, self.streamed = engine, affinity, streamed
        self.sub = _Sub(requests)
        self.retries_left = engine.retries
        self.delivered = False  # a token reached the caller: the request can no longer be sent again
        self.replica: str | None = None
        self.closed = False
        self._stream = None
        self._buffer: deque | None = None  # streamed=False: every chunk, gathered before the first is given
        self._ready: deque = deque()  # the rest of the last item's chunks
        self._arrival = time.monotonic()
        self._last: dict[int, float] = {}

    async def start(self) -> None:
        """Send the submission and wait for a replica to take it (retrying once if one dies first)."""
        while True:
            self._last = {}
            self._ready.clear()
            self._stream = self.engine.replicas.options(stream=True).generate.remote(
                self.sub.requests, affinity=self.affinity, streamed=self.streamed)
            try:
                first = await self._stream.__anext__()
            except BaseException as e:
                if self._lost(e):
                    continue
                self.close()
                raise self._mapped(e) from None
            kind, payload = first
            if kind == "replica":
                self.replica = payload["replica"]
                self.engine.metrics.served(payload)
                return
            self.closed = True
            if kind == "invalid":  # a submission the replica can never hold (more requests than it takes)
                raise GenerationError(payload)
            raise ServerBusy(payload) if kind == "busy" else EngineStopped(payload)

    def _lost(self, e: BaseException) -> bool:
        """True when ``e`` is the replica's death and the call may be made again."""
        if not _replica_lost(e):
            return False
        if self.delivered or self.retries_left <= 0:
            return False
        self.retries_left -= 1
        self.engine.metrics.retries.inc()
        log.warning("replica %s died before its first token; sending the request again", self.replica)
        return True

    def _mapped(self, e: BaseException) -> BaseException:
        from ray.serve.exceptions import BackPressureError
        if isinstance(e, BackPressureError):
            return ServerBusy(f"every replica's queue is full; retry later ({e.message})")
        if _replica_lost(e):
            self.engine.metrics.failures.inc()
            return ReplicaFailed(f"the replica running this request ({self.replica or 'not yet known'}) stopped: "
                                 f"{type(e).__name__}; retry")
        return e

    def __aiter__(self) -> "RemoteHandle":
        return self

    def ready(self) -> bool:
        """Whether a chunk is here already, so the next ``__anext__`` returns without waiting."""
        return bool(self._ready)

    async def __anext__(self) -> tuple:
        if self.streamed:
            while (item := await self._next()) is None:
                pass
            return item
        if self._buffer is None:
            self._buffer = deque()
            try:
                while True:
                    item = await self._next()
                    if item is None:  # sent again: what the dead replica gave is void
                        self._buffer.clear()
                    else:
                        self._buffer.append(item)
            except StopAsyncIteration:
                pass
        if not self._buffer:
            raise StopAsyncIteration
        return self._buffer.popleft()

    async def _next(self) -> tuple | None:
        """The next ``(index, chunk)`` from the replica; None when the call was just sent again."""
        if self._ready:
            return self._ready.popleft()
        try:
            item = await self._stream.__anext__()
        except StopAsyncIteration:
            self.closed = True
            raise
        except BaseException as e:
            if self._lost(e):
                await self.start()
                return None
            self.close()
            raise self._mapped(e) from None
        if item[0] == "chunks":
            for index, chunk in item[1]:
                self._observe(index, chunk)
            self._ready.extend(item[1])
            return self._ready.popleft()
        self.close()
        raise GenerationError(item[1]) if item[0] == "invalid" else EngineStopped(item[1])

    def _observe(self, index: int, chunk) -> None:
        now = time.monotonic()
        m = self.engine.metrics.server
        if chunk.token_id is not None:
            self.delivered = self.delivered or self.streamed
            last = self._last.get(index)
            (m.ttft if last is None else m.itl).observe(now - (self._arrival if last is None else last))
            self._last[index] = now
        if chunk.finish_reason is not None:
            m.finished(chunk.finish_reason, now - self._arrival)

    def close(self) -> None:
        """Stop listening; the replica aborts whatever of the submission is unfinished (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self._stream is not None:
            self._stream.cancel()
