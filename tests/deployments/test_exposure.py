"""gRPC is served only where HTTP is: Ray Serve's gRPC proxy listens on every interface (it takes no
host), so `pdserve serve` refuses `--grpc-port` beside an HTTP bound to one address, before Ray starts.
And `pdserve: ready` is said only once the door answered through the advertised address."""

from __future__ import annotations

from deployments.cli import main
from deployments.serve_cli import LaunchOptions, door_answer_error, grpc_bind_error


def test_grpc_is_off_by_default_and_allowed_only_with_a_wildcard_http_host():
    assert LaunchOptions().grpc_port == 0
    assert grpc_bind_error("127.0.0.1", 0) is None
    assert grpc_bind_error("0.0.0.0", 9000) is None and grpc_bind_error("::", 9000) is None
    for host in ("127.0.0.1", "localhost", "10.1.2.3"):
        why = grpc_bind_error(host, 9000)
        assert why is not None and "every interface" in why and host in why


def test_pdserve_serve_refuses_grpc_beside_a_loopback_http(capsys):
    assert main(["serve", "--grpc-port", "9000"]) == 2  # the default --http-host is 127.0.0.1
    err = capsys.readouterr().err
    assert "--grpc-port 9000 with --http-host 127.0.0.1" in err and "--grpc-port 0" in err


def test_pdserve_serve_refuses_a_port_in_use_before_ray_starts(capsys):
    """Else Serve's direct ingress moves to the next free port and the URL printed is not the one served."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err


def _http_server(status: int):
    """A server on a free loopback port answering every GET with `status`; (url, stop)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server.shutdown


def test_ready_needs_a_200_through_the_advertised_address():
    url, stop = _http_server(200)
    try:
        assert door_answer_error(url, timeout_s=10) is None
        # a wildcard bind address is probed on loopback
        assert door_answer_error(url.replace("127.0.0.1", "0.0.0.0"), timeout_s=10) is None
    finally:
        stop()


def test_a_door_that_never_answers_is_named_not_called_ready():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    why = door_answer_error(f"http://127.0.0.1:{port}", timeout_s=1.0, poll_s=0.2)
    assert why is not None and f"127.0.0.1:{port}/health" in why and "ConnectError" in why, why
    url, stop = _http_server(503)  # listening, but not healthy
    try:
        why = door_answer_error(url, timeout_s=1.0, poll_s=0.2)
        assert why is not None and "HTTP 503" in why, why
    finally:
        stop()
