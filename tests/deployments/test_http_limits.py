"""The HTTP limits in the Ray layouts (deployments/http_limits.py): Serve's proxy refuses the two it
cannot honour (`pdserve serve` before it starts Ray), and direct ingress's replica server is built with
all of them. The served behaviour through a Ray layout: tests/e2e/test_direct_ingress.py; the
single-process server's: tests/deployments/test_tenants.py."""

from __future__ import annotations

import pytest
import uvicorn

from deployments.config import ServeConfig, ServeConfigError


def test_the_proxy_refuses_the_limits_it_cannot_honour(capsys):
    from deployments.cli import main
    from deployments.http_limits import proxy_keepalive_s, proxy_limits_error
    from helpers import free_port

    assert proxy_limits_error(ServeConfig()) is None  # the defaults: documented as not applying there
    assert proxy_limits_error(ServeConfig(http_keepalive_timeout_s=2.5, http_body_timeout_s=3.0)) is None
    assert proxy_keepalive_s(ServeConfig(http_keepalive_timeout_s=2.5)) == 3  # Serve takes whole seconds
    why = proxy_limits_error(ServeConfig(http_header_timeout_s=3.0, http_limit_concurrency=None))
    assert "http_limit_concurrency=None" in why and "http_header_timeout_s=3.0" in why and "direct ingress" in why
    # `pdserve serve` refuses them before it starts Ray where Serve's proxy would serve HTTP
    for argv, named in ((["--no-direct-ingress", "--http-header-timeout-s", "3"], "http_header_timeout_s"),
                        (["--ingress-replicas", "2", "--http-limit-concurrency", "64"], "http_limit_concurrency")):
        assert main(["serve", "--layout", "colocated", "--port", str(free_port()), *argv]) == 2
        err = capsys.readouterr().err
        assert named in err and "Serve's HTTP proxy" in err, err


def test_direct_ingress_builds_its_server_with_the_limits(monkeypatch):
    """What an ingress replica does before Serve starts its direct-ingress server: Serve's own call
    (`start_asgi_http_server`: uvicorn.Config from its HTTPOptions) then carries pdserve's limits.
    The served behaviour: tests/e2e/test_direct_ingress.py."""
    from ray.serve._private import http_util

    from deployments.http_limits import apply_to_direct_ingress

    monkeypatch.setattr(http_util, "uvicorn", http_util.uvicorn)  # restored after the test
    cfg = ServeConfig(http_limit_concurrency=7, http_keepalive_timeout_s=1.5, http_header_timeout_s=2.5)
    apply_to_direct_ingress(cfg)
    apply_to_direct_ingress(cfg)  # twice (a replica restarted in the same process): still one layer
    config = http_util.uvicorn.Config(lambda: None, factory=True, timeout_keep_alive=90, lifespan="off",
                                      log_config=None)  # as Serve builds it (no logging set-up)
    assert config.limit_concurrency == 7 and config.timeout_keep_alive == 1.5
    assert issubclass(config.http, uvicorn.protocols.http.auto.AutoHTTPProtocol)
    assert config.http.__name__ == "HeadDeadline" and http_util.uvicorn.Server is uvicorn.Server
    monkeypatch.setattr(http_util, "uvicorn", object())  # a Ray laid out otherwise: refused, not ignored
    with pytest.raises(ServeConfigError, match="http_limit_concurrency, http_header_timeout_s"):
        apply_to_direct_ingress(cfg)
