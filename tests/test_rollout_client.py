"""The rollout client against a server that closes idle keep-alive connections (CPU only, no model).

uvicorn and `vllm serve` close a connection that has been idle for 5 s. A client that reuses
it at that moment reads a connection reset: CI saw `/collective_rpc: ReadError: Connection
reset by peer` after a 5 s generation. The fake server below makes the race certain: it answers
the first request on a connection and closes the connection on the second.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
import time

import pytest

from qerl_lib.rollout import client


class _ClosesOnSecondRequest(socketserver.BaseRequestHandler):
    def handle(self):
        served = 0
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                chunk = self.request.recv(65536)
                if not chunk:
                    return
                buf += chunk
            head, buf = buf.split(b"\r\n\r\n", 1)
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            while len(buf) < length:
                buf += self.request.recv(65536)
            buf = buf[length:]
            if served == 1:  # the server's idle timer fired just as the client sent
                self.request.shutdown(socket.SHUT_RDWR)
                return
            body = json.dumps({"results": [{"ok": True}]}).encode()
            self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\nConnection: keep-alive\r\n\r\n%s" % (len(body), body))
            served += 1


@pytest.fixture
def closing_server():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _ClosesOnSecondRequest)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_idle_connection_is_not_reused_past_the_keepalive_expiry(closing_server):
    engine = client.RemoteEngine(closing_server)
    try:
        assert engine.rpc("qerl_info") == {"ok": True}
        time.sleep(client.KEEPALIVE_EXPIRY_S + 0.5)  # the client idles, e.g. while a generation runs
        assert engine.rpc("qerl_info") == {"ok": True}
    finally:
        engine.close()


def test_the_fake_server_does_reset_a_reused_connection(closing_server):
    """The test above can fail: a connection reused within the expiry meets the reset."""
    engine = client.RemoteEngine(closing_server)
    try:
        engine.rpc("qerl_info")
        with pytest.raises(client.RolloutServerError, match="is not answering"):
            engine.rpc("qerl_info")
    finally:
        engine.close()


def test_the_client_expires_idle_connections_before_the_servers_5_s():
    assert 0 < client.KEEPALIVE_EXPIRY_S < 5.0
