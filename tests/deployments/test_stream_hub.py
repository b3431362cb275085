"""StreamHub and its wire: events put in offset order and deduplicated, from this process or over an
authenticated socket; a connection without the key gets nothing and changes nothing; nothing stays."""

from __future__ import annotations

import asyncio
import os
import socket
import threading

import pytest

from deployments.cluster.messages import StreamEvent
from deployments.frontend.hub_wire import HubAddress, HubClient, hub_client, send_frame
from deployments.frontend.stream_hub import LOST, StreamHub


async def _take(q: asyncio.Queue, n_tokens: int, timeout_s: float = 10.0) -> list[StreamEvent]:
    """Events from `q` until they hold `n_tokens` tokens or one is finished."""
    out: list[StreamEvent] = []
    while sum(len(e.token_ids) for e in out) < n_tokens and not (out and out[-1].finished):
        out.extend(await asyncio.wait_for(q.get(), timeout_s))
    return out


def test_events_in_offset_order_once_each_over_the_wire():
    hub = StreamHub(host="127.0.0.1")

    async def main():
        qa, qb = hub.open("a"), hub.open("b")
        client = hub_client()
        client.push(hub.address, [StreamEvent("a", 0, [1, 2]), StreamEvent("b", 0, [7])])
        # Arrives early: waits for offset 2; a duplicate of what the client has is cut.
        client.push(hub.address, [StreamEvent("a", 3, [4], finished=True, finish_reason="length")])
        client.push(hub.address, [StreamEvent("a", 1, [2, 3])])
        got = await _take(qa, 4)
        assert [t for e in got for t in e.token_ids] == [1, 2, 3, 4] and got[-1].finished
        assert [t for e in await _take(qb, 1) for t in e.token_ids] == [7]
        # A finished stream leaves the hub at once; the live one stays until closed.
        assert hub.delivered("a") is None and hub.num_streams() == 1
        got = await asyncio.to_thread(HubClient.delivered, hub.address, "b", 5.0)
        assert got == [7]
        # Which requests still have a client: "a" finished, "never" was not opened here.
        assert await asyncio.to_thread(HubClient.held, hub.address, ["a", "b", "never"], 5.0) == {"b"}
        hub.push([StreamEvent("gone", 0, [5])])  # a stream the hub does not hold: dropped
        hub.close("b")
        hub.push([StreamEvent("b", 1, [8])])
        assert hub.num_streams() == 0 and qb.empty()

    asyncio.run(main())
    hub.shutdown()


def test_a_connection_without_the_key_is_refused():
    hub = StreamHub(host="127.0.0.1")

    async def main():
        q = hub.open("r")
        wrong = HubAddress(hub.address.host, hub.address.port, os.urandom(32))
        with pytest.raises((ConnectionError, OSError)):
            await asyncio.to_thread(HubClient.delivered, wrong, "r", 5.0)
        # A raw client that skips the handshake and sends a frame: closed, nothing accepted.
        with socket.create_connection((hub.address.host, hub.address.port), timeout=5) as s:
            s.recv(32)
            s.sendall(b"\0" * 32)
            try:
                send_frame(s, ("push", [StreamEvent("r", 0, [1])]))
                assert s.recv(1) == b""  # the hub hung up
            except OSError:
                pass
        HubClient().push(wrong, [StreamEvent("r", 0, [9])])
        await asyncio.sleep(0.5)
        assert q.empty() and hub.delivered("r") == []

    asyncio.run(main())
    hub.shutdown()


def test_a_hub_that_is_gone_refuses_the_held_question():
    """A worker asking a hub whose replica is gone gets ConnectionRefusedError: its requests have no client."""
    hub = StreamHub(host="127.0.0.1")
    addr = hub.address
    hub.shutdown()
    with pytest.raises(ConnectionRefusedError):
        HubClient.held(addr, ["r"], 5.0)


def test_shutdown_ends_every_open_stream():
    hub = StreamHub(host="127.0.0.1")

    async def main():
        q = hub.open("r")
        threading.Timer(0.1, hub.shutdown).start()
        assert await asyncio.wait_for(q.get(), 5) is LOST
        assert hub.num_streams() == 0

    asyncio.run(main())
