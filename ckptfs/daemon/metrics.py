"""Prometheus metrics of a mount (``ckptfs mount --metrics-port P``), with prometheus_client.

One collector reads the daemon's live figures at scrape time (``figures``: a dict the daemon
builds on its trio loop, see ``Daemon._figures``); nothing here counts events itself. The
endpoint is one thread serving one request at a time (wsgiref), each bounded by a socket
timeout: a slow or hostile client cannot pile up threads in a root daemon. Imported only when
metrics are asked for.

``ckptfs_training_at_risk_seconds``: 0 while everything committed on the mount is in the store;
otherwise the seconds since the last moment it was (the job's state a node loss would roll back
to). See docs/admin.md ("Metrics").
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ckptfs.errors import MountError

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0  # a scrape must send its request and take its answer within this


class FiguresCollector:
    """Turns the daemon's figures dict into metric families at each scrape."""

    def __init__(self, figures: Callable[[], dict | None]):
        self.figures = figures

    def describe(self) -> list:  # (no scrape at registration)
        return []

    def collect(self) -> Iterator[Metric]:
        f = self.figures()
        if f is None:  # starting or stopping: no figures to give
            return

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def histogram(name: str, doc: str, snap) -> HistogramMetricFamily:
            buckets, _, total = snap
            return HistogramMetricFamily(
                name, doc, buckets=[(_le(b), c) for b, c in buckets], sum_value=total
            )

        yield counter("ckptfs_written_bytes", "Bytes applications wrote to the mount.", f["written_bytes"])
        yield counter(
            "ckptfs_committed_bytes",
            "Bytes of files committed (closed after writing), "
            "including those resumed from the journal at mount.",
            f["committed_bytes"],
        )
        yield counter(
            "ckptfs_uploaded_bytes",
            "Bytes of files uploaded to the store (their own size, compressed or not).",
            f["uploaded_bytes"],
        )
        yield counter(
            "ckptfs_stored_bytes",
            "Bytes the store received for file data (compressed size where --compress compressed them).",
            f["stored_bytes"],
        )
        yield counter(
            "ckptfs_fetched_bytes",
            "Bytes read into the cache (from the store or from peers).",
            f["fetched_bytes"],
        )
        yield counter("ckptfs_store_read_bytes", "Bytes the store sent for reads.", f["store_read_bytes"])
        yield counter(
            "ckptfs_peer_read_bytes",
            "Bytes of parts taken from peers (--cluster) that matched their checksums: not read from the store.",
            f["peer_read_bytes"],
        )
        yield counter(
            "ckptfs_peer_served_bytes", "Bytes this node sent to its peers.", f["peer_served_bytes"]
        )
        yield gauge("ckptfs_peers_live", "Other live members of this node's cluster.", f["peers_live"])
        yield counter(
            "ckptfs_replicated_bytes",
            "Bytes of this node's files that peers acknowledged holding (--replicas).",
            f["replicated_bytes"],
        )
        yield counter(
            "ckptfs_replica_local_commits",
            "Commits that returned without their replicas (--replica-timeout, or no live peer).",
            f["replica_local_commits"],
        )
        yield counter(
            "ckptfs_replica_holder_losses",
            "Replica streams to a holder that ended (lost, full or refusing): another was chosen.",
            f["replica_holder_losses"],
        )
        yield gauge(
            "ckptfs_replica_held_bytes",
            "Cache bytes this node holds as other nodes' replicas (part of the cache budget).",
            f["replica_held_bytes"],
        )
        yield counter(
            "ckptfs_replica_received_bytes",
            "Bytes of other nodes' replicas received.",
            f["replica_received_bytes"],
        )
        yield counter(
            "ckptfs_takeovers",
            "Lost nodes whose pending files this node published from the replicas it held.",
            f["takeovers"],
        )
        yield counter(
            "ckptfs_peer_asks_failed",
            "Asks of a peer that failed (unreachable, silent, broke off): the store served them.",
            f["peer_asks_failed"],
        )
        yield counter(
            "ckptfs_peer_mismatches",
            "Parts a peer sent that did not match their checksums.",
            f["peer_mismatches"],
        )
        yield counter(
            "ckptfs_peer_refused_clients",
            "Connections to the peer port refused: no member's certificate.",
            f["peer_refused_clients"],
        )
        yield counter("ckptfs_durable_files", "Files that became durable in the store.", f["durable_files"])
        yield gauge(
            "ckptfs_pending_files", "Files committed and not yet durable in the store.", f["pending_files"]
        )
        yield gauge(
            "ckptfs_pending_bytes", "Bytes of pending files not yet sent to the store.", f["pending_bytes"]
        )
        yield gauge(
            "ckptfs_upload_rate_bytes_per_second", "Upload rate over the last 10 s.", f["upload_rate"]
        )
        yield gauge(
            "ckptfs_oldest_pending_seconds",
            "Age of the oldest op not yet in the store (0 if none).",
            f["oldest_pending_s"],
        )
        yield gauge(
            "ckptfs_training_at_risk_seconds",
            "0 while everything committed is durable; otherwise seconds since the last moment it was.",
            f["at_risk_s"],
        )
        yield gauge(
            "ckptfs_markers_waiting",
            "Checkpoint markers held until the files they stand for (other nodes' too) are in the store.",
            f["markers_waiting"],
        )
        yield counter(
            "ckptfs_markers_dropped",
            "Held markers given up: replaced, their step deleted, or a newer step of their series whole.",
            f["markers_dropped"],
        )
        yield counter(
            "ckptfs_unrecorded_closes",
            "Closes that went on before the store took this node's writer record of their directory.",
            f["unrecorded_closes"],
        )
        used = GaugeMetricFamily("ckptfs_cache_used_bytes", "Cache bytes in use, per tier.", labels=["tier"])
        budget = GaugeMetricFamily("ckptfs_cache_budget_bytes", "Cache budget, per tier.", labels=["tier"])
        for tier in ("ram", "disk"):
            used.add_metric([tier], f["cache"][tier]["used"])
            budget.add_metric([tier], f["cache"][tier]["budget"])
        yield used
        yield budget
        yield gauge(
            "ckptfs_cache_clean_bytes", "Cached bytes already in the store (evictable).", f["clean_bytes"]
        )
        yield histogram(
            "ckptfs_upload_request_seconds",
            "Duration of each store call the uploader makes (parts, puts, completes; failed ones too).",
            f["upload_latency"],
        )
        yield histogram(
            "ckptfs_fetch_request_seconds", "Duration of each ranged GET that answered.", f["fetch_latency"]
        )
        yield histogram(
            "ckptfs_save_stall_seconds",
            "Open to committing close of each file written, as the daemon sees it.",
            f["save_stall"],
        )
        retries = CounterMetricFamily(
            "ckptfs_retries", "Store calls tried again after a failure.", labels=["op"]
        )
        for op, n in sorted(f["retries"].items()):
            retries.add_metric([op], n)
        yield retries
        errors = CounterMetricFamily(
            "ckptfs_errors",
            "Store trouble by kind: unreachable / server (S3 HTTP "
            "attempts), upload (failed uploader calls), read (reads failed with EIO), "
            "lookup (lookups the store did not answer).",
            labels=["kind"],
        )
        for kind in ("unreachable", "server", "upload", "read", "lookup"):
            errors.add_metric([kind], f["errors"].get(kind, 0))
        yield errors
        yield gauge(
            "ckptfs_store_up",
            "1 while the store answers, 0 while it fails or does not answer.",
            f["store_up"],
        )


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class _Handler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - (the base class's name)
        log.debug("metrics: %s", format % args)


class _Server(WSGIServer):
    request_queue_size = 8


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """The /metrics endpoint on ``addr``:``port`` (0: a free port, see ``port``), one thread."""

    def __init__(self, addr: str, port: int, figures: Callable[[], dict | None]):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(FiguresCollector(figures))
        server_class = _Server6 if ":" in addr else _Server
        try:
            self.server = make_server(
                addr, port, make_wsgi_app(registry), server_class=server_class, handler_class=_Handler
            )
        except (OSError, OverflowError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise MountError(
                f"cannot serve metrics on {addr}:{port} (--metrics-addr/--metrics-port): {why}"
            ) from None
        self.addr = addr
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="ckptfs-metrics",
            daemon=True,
        )

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        self.thread.start()
        log.info("metrics on %s", self.url)

    def close(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()
