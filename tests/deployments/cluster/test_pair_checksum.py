"""A KV pair whose transfer arrives corrupted, from the wire to what an operator sees, without Ray: a real
gloo channel between two threads of this process carries a probe, one good transfer and one whose
header is corrupted in flight (fault injected on the sender's channel). The receiver refuses it with a
`ProtocolError`, which the decode side's pair book counts as cause `checksum` (what `KVImporter.pull`
does with a failed pull; tests/kv_transfer/test_gloo_ray.py checks that glue between Ray actors). The
same book then shows the failure in the `pdserve_kv_pair_failures_total` series (prometheus_client
exposition), in the router's state after the decode worker's report (/health's `router.kv_pairs`), and
in `pdserve status` (JSON and the map), read over HTTP."""

from __future__ import annotations

import http.server
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import Parts  # tests/deployments/cluster/conftest.py (at import: later the name is another's)
from deployments import metrics
from deployments.cli import main
from deployments.cluster.introspect import router_stats
from deployments.cluster.messages import DecodeReport
from kv_transfer import KVTransferError, ProtocolError
from kv_transfer.endpoints import KVReceiver, KVSender
from kv_transfer.gloo import GlooTransport
from kv_transfer.handle import KVLayout
from kv_transfer.lease import LeaseTable
from kv_transfer.pair_stats import FailureCause, PairBook, PostedProbe, probe_send
from kv_transfer.protocol import HEADER_LEN

SRC, DST = "p0", "d0"  # the prefill (exporting) and decode (importing) workers of `Parts`


def _corrupt_headers(channel) -> list[int]:
    """Make `channel` flip one field of every KV header it sends (after its checksum was computed), as
    a bad NIC or a foreign writer on the port would; returns the list the flips are counted in."""
    real, flipped = channel.isend, []

    def isend(tensor: torch.Tensor, tag: int = 0):
        if tag == 0 and tensor.dtype == torch.int64 and tensor.numel() == HEADER_LEN:
            tensor = tensor.clone()
            tensor[5] += 1  # num_tokens
            flipped.append(1)
        return real(tensor, tag)
    channel.isend = isend
    return flipped


def _serve_json(doc: dict) -> http.server.HTTPServer:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = json.dumps(doc).encode()
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_corrupted_header_counts_as_checksum_in_the_book_metrics_health_and_status(monkeypatch, capsys):
    monkeypatch.setattr(metrics, "_ray_up", lambda: False)  # this process's series: prometheus_client's
    metrics.use_local_registry()
    torch.manual_seed(0)
    src = torch.randn(12, 2, 2, 4, 2, 8)  # [blocks, layers, K/V, block size, kv heads, head dim]
    dst = torch.zeros_like(src)
    free_dst = list(range(12))
    leases = LeaseTable(SRC, KVLayout.of(src), lambda rid: None)
    tp, td = GlooTransport("127.0.0.1", timeout_s=10), GlooTransport("127.0.0.1", timeout_s=10)
    td.connect(SRC, tp.listen(DST))
    sender = KVSender(tp, src, leases, timeout_s=3)  # the corrupted push waits this long for an ack
    receiver = KVReceiver(td, dst, lambda n: [free_dst.pop(0) for _ in range(-(-n // 4))],
                          free_dst.extend, timeout_s=10)
    book = PairBook(DST, metrics.KVPairMetrics())
    try:
        with ThreadPoolExecutor(1) as pool:
            ch = td.channel(SRC)
            with ch.lock:  # the probe a new channel gets (KVImporter._probe)
                posted = PostedProbe(ch, dst, 1 << 20)
                sending = pool.submit(probe_send, tp.channel(DST), src, 1 << 20, 10)
                book.opened(SRC, "gloo", posted.wait(10))
            sending.result(10)

            def pull(rid: str) -> list[int]:
                handle = leases.grant(rid, [1, 2, 3], num_tokens=10, first_token=7)
                pushes = []
                try:
                    got = receiver.receive(handle, lambda: pushes.append(pool.submit(sender.push, handle, DST)))
                except KVTransferError as exc:  # KVImporter.pull books every failed pull by its cause
                    assert book.failed(SRC, exc) is FailureCause.CHECKSUM
                    with pytest.raises(KVTransferError):  # the sender's ack never comes: it fails too
                        pushes[0].result(30)
                    raise
                pushes[0].result(10)
                book.transferred(SRC, handle.nbytes, 0.01)
                return got

            got = pull("good")
            assert torch.equal(dst[got], src[[1, 2, 3]])
            flipped = _corrupt_headers(tp.channel(DST))
            with pytest.raises(ProtocolError, match="corrupted"):
                pull("corrupted")
            assert flipped == [1]
    finally:
        tp.close()
        td.close()
    assert len(free_dst) == 12 - 3 and len(leases) == 0  # the failed pull's blocks are back on both sides

    # the book
    pair = book.snapshot()[SRC]
    assert pair["failures"] == {"checksum": 1} and pair["last_failure"] == "ProtocolError (checksum)"
    assert pair["num_transfers"] == 1 and pair["transport"] == "gloo" and pair["probe_gbps"] > 0

    # the metrics series
    from prometheus_client.parser import text_string_to_metric_families

    text = metrics.render_local()[0].decode()
    failures = {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name == "ray_pdserve_kv_pair_failures_total"}
    assert failures[(("cause", "checksum"), ("dst", DST), ("src", SRC), ("transport", "gloo"))] == 1

    # the router's state, from the decode worker's report, as /health shows it
    parts = Parts((SRC, DST), prefix_aware_routing=False)
    parts.placement.reported(DecodeReport(DST, 100, 100, 0, 0, kv_pairs=book.snapshot()))
    doc = json.loads(json.dumps({"status": "ok", "model": "m", "router": router_stats(parts.state, parts.pools)}))
    assert doc["router"]["kv_pairs"] == [pair]

    # pdserve status, over HTTP
    server = _serve_json(doc)
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        capsys.readouterr()
        assert main(["status", "--url", url, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)["router"]["kv_pairs"]
        assert [p["failures"] for p in shown] == [{"checksum": 1}]
        assert main(["status", "--url", url]) == 0
        text = capsys.readouterr().out
    finally:
        server.shutdown()
    row = next(line for line in text.splitlines() if f"{SRC} -> {DST}" in line)
    assert "gloo" in row and row.rstrip().endswith("checksum 1"), row
