"""The api's engine client over real ZMQ sockets, without the other processes."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from minisgl.server.engine_client import EngineClient
from minisgl.server.ipc import IpcPaths, Ready, StatsReply, outbox
from minisgl.server.metrics import Metrics


def test_ready_only_once_scheduler_and_detokenizer_report():
    async def scenario() -> None:
        ipc = IpcPaths.new()
        client = EngineClient(ipc, Metrics("m"))
        router = asyncio.create_task(client.run())
        push = outbox(zmq.Context.instance(), ipc.api)
        push.send_pyobj(Ready("scheduler", {"max_seq_len": 64}))
        await asyncio.sleep(0.2)
        assert not client.ready.is_set()  # the detokenizer may still be loading: not ready yet
        push.send_pyobj(Ready("detokenizer"))
        await asyncio.wait_for(client.ready.wait(), 5)
        assert client.info["max_seq_len"] == 64
        router.cancel()

    asyncio.run(scenario())


def test_stats_reply_reaches_its_waiter():
    async def scenario() -> None:
        ipc = IpcPaths.new()
        client = EngineClient(ipc, Metrics("m"))
        router = asyncio.create_task(client.run())
        scheduler = zmq.asyncio.Context.instance().socket(zmq.PULL)
        scheduler.bind(ipc.scheduler)
        push = outbox(zmq.Context.instance(), ipc.api)

        async def answer() -> None:
            ask = await scheduler.recv_pyobj()
            push.send_pyobj(StatsReply(ask.ask_id + 1000, {"wrong": True}))  # someone else's reply is ignored
            push.send_pyobj(StatsReply(ask.ask_id, {"free_pages": 7}))

        responder = asyncio.create_task(answer())
        assert await client.stats(timeout=5) == {"free_pages": 7}
        await responder
        router.cancel()

    asyncio.run(scenario())
