"""Ray Serve's replica choice for quill: keep a conversation where its prefix cache is, unless that replica is busy.

The ingress gives every call an ``affinity`` key (the chat's opening messages, a completion's
first tokens, or the client's ``user`` field).  Each key has a home replica chosen by
rendezvous hashing (the replica whose hash with the key is highest), so every ingress agrees
on it without shared state and, when replicas come and go, only the keys of those replicas
move.  The home replica gets the call unless its queue is longer than the shortest queue by
more than ``imbalance`` requests; then (and for calls without a key) the least-loaded replica
does.  A full replica is passed over by Ray's own machinery (the next rank is tried).

    RequestRouterConfig(request_router_class="quill.serving.router:AffinityRouter",
                        request_router_kwargs={"imbalance": 4})
"""

from __future__ import annotations

import hashlib

from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)


def rendezvous_order(key: str, replica_ids: list[str]) -> list[str]:
    """``replica_ids`` from the key's home to its last choice (highest-random-weight hashing)."""
    def weight(rid: str) -> bytes:
        return hashlib.blake2b(f"{key}|{rid}".encode(), digest_size=8).digest()
    return sorted(replica_ids, key=weight, reverse=True)


class AffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Home replica by rendezvous hashing of the call's ``affinity`` key, least-loaded otherwise."""

    def initialize_state(self, imbalance: int = 4, **kwargs) -> None:
        if isinstance(imbalance, bool) or not isinstance(imbalance, int) or imbalance < 0:
            raise ValueError(f"AffinityRouter imbalance: expected an integer >= 0, found {imbalance!r}")
        self.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = pending_request.kwargs.get("affinity") if pending_request is not None else None
        if not key or len(candidate_replicas) < 2:
            return [candidate_replicas]  # Ray takes the one with the shortest queue
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = [by_id[rid] for rid in rendezvous_order(key, list(by_id))]
        lengths = await self._queue_lengths(order)
        home = lengths.get(order[0].replica_id)
        known = [n for n in lengths.values() if n is not None]
        if home is not None and known and home - min(known) > self.imbalance:
            return [candidate_replicas]
        return [order[:1], order[1:]]

    async def _queue_lengths(self, replicas: list[RunningReplica]) -> dict:
        """Queue length per replica id: from Ray's cache where fresh, probed otherwise (None: no answer)."""
        out, stale = {}, []
        for r in replicas:
            n = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if n is None:
                stale.append(r)
            else:
                out[r.replica_id] = n
        if stale:
            for r, n in await self._probe_queue_lens(stale, 0):
                out[r.replica_id] = n
        return out
