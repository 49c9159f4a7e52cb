"""Streams read to the end by the official openai client are counted and logged as served:
the client closes its connection the moment it reads `data: [DONE]`, so `strata serve` does
its bookkeeping for a stream (the outcome counter, the access line's token counts) before
that event goes out. Against the shared `strata serve` (tests/support/shared_server.py)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re

from strata.server.access_log import AccessRecord
from strata.server.config import ServerConfig
from strata.server.sse import DONE, DoneSplitter
from strata.server.proxy import ServeApp
from strata.server.supervisor import Supervisor
from support import shared_server
from support.server_proc import metric, openai_client, wait_until
from support.shared_server import AUTH, KEY, MODEL

server = shared_server.module_fixture(__name__)

STREAMS = 8
ACCESS = re.compile(r"^strata serve: POST /v1/chat/completions 200 in=(\S+) out=(\S+) \d+ ms$")


def _outcomes(server) -> dict[str, float]:
    return {o: metric(server.url, f'strata_server_requests_total{{outcome="{o}"}}', AUTH)
            for o in ("ok", "client_gone")}


def test_streams_read_by_the_openai_client_are_counted_ok_with_their_usage(server):
    client = openai_client(server, KEY)
    before = _outcomes(server)
    start = len(server.lines)
    for _ in range(STREAMS):
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, temperature=0, stream=True)
        chunks = list(stream)  # read to [DONE]; the client then closes the response at once
        assert chunks and chunks[-1].choices[0].finish_reason is not None
    after = _outcomes(server)  # counted before [DONE] went out: no wait needed
    assert after["client_gone"] == before["client_gone"], (before, after)
    assert after["ok"] - before["ok"] == STREAMS, (before, after)

    def logged() -> list[re.Match]:  # (a line is written once its handler has returned)
        return [m for line in server.lines[start:] if (m := ACCESS.match(line))]
    assert wait_until(lambda: len(logged()) == STREAMS, 30), server.lines[start:]
    counts = [(m[1], m[2]) for m in logged()]
    assert all(i.isdigit() and o.isdigit() and int(o) >= 1 for i, o in counts), counts


def test_the_done_event_is_held_back_wherever_the_reads_cut_it():
    events = b'data: {"choices":[]}\n\n' * 3
    trailer = b": strata-usage 3 4\n\n"
    body = events + DONE + trailer
    rng = random.Random(7)
    for _ in range(500):
        cuts = sorted(rng.sample(range(1, len(body)), rng.randint(0, 6)))
        split = DoneSplitter()
        sent = b"".join(split.feed(body[i:j]) for i, j in zip([0, *cuts], [*cuts, len(body)]))
        assert split.done
        assert sent + split.held == events + DONE, cuts
        assert sent.startswith(events) or events.startswith(sent), cuts
        assert split.after == trailer, cuts


class _Upstream:
    """An engine's stream whose end comes late (a busy engine): its events, [DONE] and the
    usage trailer in one write, then the end of the body only when `end` is set."""

    def __init__(self, body: bytes):
        self.body, self.end = body, asyncio.Event()

    async def aiter_raw(self):
        yield self.body
        await self.end.wait()


def test_a_client_that_leaves_right_after_done_is_counted_ok_with_its_usage():
    """What Starlette does when the client closes after [DONE]: it cancels the task that is
    reading the next chunk of the relay. The stream was served in full: it counts as ok, and
    the access record has the trailer's counts."""

    async def scenario() -> tuple[float, float, AccessRecord]:
        sup = Supervisor(ServerConfig())
        proxy = ServeApp(sup)
        upstream = _Upstream(b'data: {"choices":[]}\n\n' + DONE + b": strata-usage 5 2\n\n")
        rec = AccessRecord()

        async def cleanup():
            pass
        relay = proxy._relay(upstream, None, None, cleanup, rec)
        got = b""
        read_done = asyncio.Event()

        async def consume():
            nonlocal got
            async for chunk in relay:
                got += chunk
                if got.endswith(DONE):
                    read_done.set()
        task = asyncio.ensure_future(consume())
        await asyncio.wait_for(read_done.wait(), 10)
        await asyncio.sleep(0)  # the consumer is back in the relay, waiting for the upstream's end
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        samples = {s.labels["outcome"]: s.value for m in sup.metrics.requests.collect() for s in m.samples
                   if s.name.endswith("_total")}
        return samples.get("ok", 0.0), samples.get("client_gone", 0.0), rec

    ok, gone, rec = asyncio.run(scenario())
    assert (ok, gone) == (1.0, 0.0)
    assert (rec.prompt_tokens, rec.completion_tokens) == (5, 2)
