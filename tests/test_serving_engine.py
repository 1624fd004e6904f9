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
