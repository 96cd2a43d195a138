"""The tool gateway's HTTP client as the rollout worker uses it, against servers that misbehave: a
proxy's pages, more calls than connections, a kept-alive connection closed as a call is sent."""

from __future__ import annotations

import asyncio
import json

from services.tools.client import GatewayClient
from services.tools.settings import ToolsSettings
from tests.servers import serve
from tests.test_tools_gateway import SEARCH


async def test_the_client_reads_what_is_not_the_gateways_answer_as_a_failure():
    """A proxy's page instead of the gateway's JSON: a 404 that is not FastAPI's, a 200 that is not
    a tool result, a 502. Each becomes a failed tool call the agent can read, never an exception;
    only the 404 is the call's own fault (the trajectory goes on)."""
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    proxy = FastAPI()
    answers = {"/a/call": (404, "no route"), "/b/call": (200, "<html>hi</html>"), "/c/call": (502, "bad")}
    for path, (status, body) in answers.items():
        proxy.add_api_route(path, lambda s=status, b=body: PlainTextResponse(b, s), methods=["POST"])
    with serve(proxy) as base:
        for prefix, unreachable, says in (
            ("a", False, "HTTP 404"),
            ("b", True, "unreadable"),
            ("c", True, "502"),
        ):
            client = GatewayClient(f"{base}/{prefix}")
            reply = await client.call(*SEARCH, {"q": "x"})
            await client.aclose()
            assert not reply.ok and reply.unreachable is unreachable and says in reply.text, reply


async def test_a_call_waiting_for_a_connection_is_not_timed_out_for_it():
    """More calls in flight than connections, each answered within the timeout: every one is answered.
    With the timeout over the whole call (the wait for a connection included), the last ones were
    reported as an unreachable gateway, which fails a trajectory."""
    from fastapi import FastAPI

    slow = FastAPI()

    @slow.post("/call")
    async def call():
        await asyncio.sleep(0.3)
        return {"ok": True, "text": "found", "cached": False, "latency_s": 0.3}

    with serve(slow) as base:
        # five calls queue on one connection for 1.5 s, past the timeout; each is answered well inside it
        client = GatewayClient(base, timeout_s=1.0, connections=1)
        replies = await asyncio.gather(*(client.call(*SEARCH, {"q": str(i)}) for i in range(5)))
        await client.aclose()
        stuck = GatewayClient(base, timeout_s=0.1)  # an answer slower than the timeout still times out
        late = await stuck.call(*SEARCH, {"q": "x"})
        await stuck.aclose()
    assert [r.ok for r in replies] == [True] * 5
    assert not late.ok and late.unreachable and "TimeoutError" in late.text


async def _closing_gateway(answered: list[int]):
    """A gateway that answers the first request on each connection and keeps it alive, then
    closes it when the next request arrives, unanswered: what a client meets when it sends on an
    idle connection at the moment the other side closes it."""
    reply = json.dumps({"ok": True, "text": "found", "cached": False, "latency_s": 0.0}).encode()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for request in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(
                next(
                    line.split(b":")[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
            )
            await reader.readexactly(length)
            if request:
                break
            answered.append(1)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(reply), reply)
            )
            await writer.drain()
        writer.close()

    return await asyncio.start_server(connection, "127.0.0.1", 0)


async def test_a_connection_found_closed_is_tried_once_more_not_reported_unreachable():
    """A call sent on a kept-alive connection that the gateway closes is sent again on a fresh one:
    an "unreachable" reply fails the whole trajectory (it happened in a run, between two calls
    8 s apart, with aiohttp keeping connections 15 s and uvicorn 5 s)."""
    answered: list[int] = []
    server = await _closing_gateway(answered)
    port = server.sockets[0].getsockname()[1]
    client = GatewayClient(f"http://127.0.0.1:{port}", connections=1)
    try:
        replies = [await client.call(*SEARCH, {"q": str(i)}) for i in range(3)]
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
    assert [(r.ok, r.unreachable) for r in replies] == [(True, False)] * 3
    assert len(answered) == 3  # each call answered once, the second and third on a fresh connection


def test_the_gateway_keeps_idle_connections_longer_than_its_clients():
    from services.tools.client import KEEP_ALIVE_S

    assert ToolsSettings.model_fields["keep_alive_s"].default > KEEP_ALIVE_S


async def test_a_call_without_a_place_does_not_send_the_field():
    """A gateway older than ``call_index`` refuses the field even as null (its body model forbids
    unknown fields), and every call would fail: the field is sent only with a place."""
    bodies = []

    async def post(body, *, again=True):
        bodies.append(json.loads(body))
        return 200, json.dumps({"ok": True, "text": "t", "cached": False}).encode()

    client = GatewayClient("http://127.0.0.1:9")
    client._post = post
    await client.call(*SEARCH, {"q": "x"}, trajectory_id="t")
    await client.call(*SEARCH, {"q": "x"}, trajectory_id="t", call_index=0)
    assert "call_index" not in bodies[0] and bodies[1]["call_index"] == 0
    await client.aclose()
