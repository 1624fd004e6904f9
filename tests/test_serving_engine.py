"""``AsyncEngine``, the server's engine, in process: how chunks reach the handlers on either driver
(the event loop's own task, or a thread), what an abort or a failure leaves behind.

The oracle for every token is ``LLM.generate`` on the same model.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import quill
from quill.serving.engine import AsyncEngine, EngineStopped

GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def llm():
    return quill.LLM()


class _Counting(AsyncEngine):
    """An ``AsyncEngine`` that records each hand-over to the event loop (per chunk: does it carry a token)."""

    def __init__(self, llm, stream_interval: int, on_loop: bool = False):
        super().__init__(llm, stream_interval=stream_interval, on_loop=on_loop)
        self.groups = []

    def _hand_over(self, sub, items):
        self.groups.append([chunk.token_id is not None for _, chunk in items])
        super()._hand_over(sub, items)


def _collect(engine, requests, streamed=True):
    async def main():
        if engine.on_loop:
            engine.start()
        handle = engine.submit(requests, streamed=streamed)
        try:
            return [item async for item in handle]
        finally:
            handle.close()
            if engine.on_loop:
                engine.shutdown()
                await engine._task

    if not engine.on_loop:
        engine.start()
    try:
        return asyncio.run(main())
    finally:
        engine.shutdown()


@pytest.mark.parametrize("interval,streamed,sizes", [
    (1, True, [1] * 10),
    (4, True, [1, 4, 4, 1]),  # the first token at once, then fours, the last with its finish
    (3, False, [10]),  # nothing before the end when the caller reads nothing before it
])
@pytest.mark.parametrize("on_loop", [False, True], ids=["thread", "loop"])
def test_stream_interval_groups_tokens_and_keeps_them_all(llm, interval, streamed, sizes, on_loop):
    ids = llm.tokenizer.encode("Once upon a time")
    params = quill.SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY)
    want = llm.generate([ids], params)[0]
    engine = _Counting(llm, interval, on_loop)
    out = _collect(engine, [("r-0", ids, params)], streamed)
    assert [c.token_id for _, c in out] == want.token_ids and "".join(c.text for _, c in out) == want.text
    assert [len(g) for g in engine.groups] == sizes
    assert out[-1][1].finish_reason == "length"


def test_held_tokens_of_an_aborted_request_are_dropped(llm):
    ids = llm.tokenizer.encode("Count to one hundred:")
    engine = _Counting(llm, 8)

    async def main():
        handle = engine.submit([("r-0", ids, quill.SamplingParams(max_tokens=500, ignore_eos=True))])
        got = [await handle.__anext__() for _ in range(3)]  # the first token, then a group of 8
        handle.close()  # aborts while the engine holds tokens: it frees the blocks, nothing more arrives
        deadline = time.monotonic() + 30
        while (engine.stats().num_running or engine._subs) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return got

    engine.start()
    try:
        got = asyncio.run(main())
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert len(got) == 3 and [len(g) for g in engine.groups][:2] == [1, 8]
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_blocks_used == 0  # (blocks the prefix cache keeps are not in use)


@pytest.mark.parametrize("on_loop", [False, True], ids=["thread", "loop"])
def test_an_engine_that_fails_tells_its_clients_and_refuses_more(llm, on_loop):
    class Failing(AsyncEngine):
        def _step(self):
            raise RuntimeError("a defect in the step")

    engine = Failing(llm, on_loop=on_loop)
    ids = llm.tokenizer.encode("Hello")

    async def main():
        if on_loop:
            engine.start()
        handle = engine.submit([("r-0", ids, quill.SamplingParams(max_tokens=4))])
        with pytest.raises(EngineStopped, match="RuntimeError: a defect in the step"):
            async for _ in handle:
                pass
        handle.close()
        assert not engine.alive
        with pytest.raises(EngineStopped, match="a defect in the step"):
            engine.submit([("r-1", ids, quill.SamplingParams(max_tokens=4))])

    if not on_loop:
        engine.start()
    asyncio.run(main())
    engine.shutdown()


# ---- faults stay with their request ----------------------------------------------------------------

@pytest.mark.parametrize("on_loop", [False, True], ids=["thread", "loop"])
def test_a_request_that_fails_ends_alone_and_the_engine_goes_on(llm, on_loop, monkeypatch):
    """Sampling raises for one request (an injected fault): its handler gets an "error" chunk, the
    request beside it gets its offline tokens, the engine stays alive and frees the blocks."""
    from quill.engine import core as core_module
    ids = llm.tokenizer.encode("Once upon a time")
    good = quill.SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY)
    bad = quill.SamplingParams(max_tokens=10, ignore_eos=True, **GREEDY)
    want = llm.generate([ids], good)[0]
    real = core_module.process_logits

    def process(logits, p, *args):
        if p is bad:
            raise RuntimeError("injected sampling fault")
        return real(logits, p, *args)

    monkeypatch.setattr(core_module, "process_logits", process)
    engine = AsyncEngine(llm, on_loop=on_loop)
    failed_before = llm.engine.stats().num_failed

    async def main():
        if on_loop:
            engine.start()
        handles = [engine.submit([("ok", ids, good)]), engine.submit([("bad", ids, bad)])]
        try:
            return [[c async for _, c in h] for h in handles], engine.alive
        finally:
            for h in handles:
                h.close()
            if on_loop:
                engine.shutdown()
                await engine._task

    if not on_loop:
        engine.start()
    try:
        (ok, failed), alive = asyncio.run(main())
    finally:
        engine.shutdown()
    assert alive and engine.error is None
    assert [c.token_id for c in ok] == want.token_ids and ok[-1].finish_reason == "length"
    assert [c.finish_reason for c in failed] == ["error"] and failed[0].error == "RuntimeError: injected sampling fault"
    s = engine.stats()
    assert s.kv_blocks_used == 0 and s.num_running == 0 and s.num_failed == failed_before + 1


def test_a_submission_that_can_never_fit_is_refused_as_invalid(llm):
    from quill.errors import GenerationError
    engine = AsyncEngine(llm, max_waiting=2)
    capacity = llm.engine.config.max_num_seqs + 2
    params = quill.SamplingParams(max_tokens=2)

    async def main():
        with pytest.raises(GenerationError, match=rf"{capacity + 1} requests in one call .* {capacity} "):
            engine.submit([(f"r-{i}", [1, 2], params) for i in range(capacity + 1)])

    engine.start()
    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_an_engine_that_fails_says_why(llm):
    class Failing(AsyncEngine):
        def _step(self):
            raise RuntimeError("a defect in the step")

    engine = Failing(llm)
    assert engine.down_reason == "the engine is not running"

    async def main():
        handle = engine.submit([("r-0", [1, 2, 3], quill.SamplingParams(max_tokens=4))])
        with pytest.raises(EngineStopped):
            async for _ in handle:
                pass
        handle.close()

    engine.start()
    assert engine.down_reason is None
    asyncio.run(main())
    engine.shutdown()
    assert engine.down_reason == "the engine failed: RuntimeError: a defect in the step"
