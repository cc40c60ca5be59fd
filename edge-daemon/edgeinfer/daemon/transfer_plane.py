"""The daemon's ZeroMQ side: KV transfer (serving prefills, asking peers for them) and
heartbeats. One context for all sockets; started once the engine is loaded.

Which parts run depends on the role: a ``prefill`` or ``both`` daemon binds the KV port and
prefills for decode daemons; a ``decode`` daemon asks its prefill peers; every daemon
publishes heartbeats for the routers.
"""

from __future__ import annotations

import logging
import random
import time

import zmq
import zmq.asyncio

from edgeinfer.daemon.config import DaemonConfig
from edgeinfer.daemon.engine.async_engine import AsyncEngine
from edgeinfer.daemon.heartbeat import HeartbeatPublisher
from edgeinfer.daemon.kv_events import KvEventLog
from edgeinfer.daemon.kv_transfer.decode_client import ClientCurve, RemotePrefillClient
from edgeinfer.daemon.kv_transfer.prefill_server import PrefillServer, ServerCurve
from edgeinfer.daemon.kv_transfer.stats import TransferStats
from edgeinfer.daemon.listeners import Listeners
from edgeinfer.daemon.load_report import LoadTracker
from edgeinfer.daemon.metrics import DaemonMetrics
from edgeinfer.shared.errors import EdgeInferError

log = logging.getLogger(__name__)


class TransferPlaneError(EdgeInferError):
    """A ZeroMQ socket of the daemon cannot be set up (port in use, bad key file)."""


class TransferPlane:
    def __init__(
        self,
        config: DaemonConfig,
        engine: AsyncEngine,
        load: LoadTracker,
        metrics: DaemonMetrics,
        listeners: Listeners | None = None,
    ) -> None:
        """``listeners``: the sockets the daemon bound at start-up; without them (tests) each
        ZeroMQ socket binds its port itself."""
        self.config = config
        self.listeners = listeners
        self.engine = engine
        self.load = load
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self.server: PrefillServer | None = None
        self.client: RemotePrefillClient | None = None
        self.publisher: HeartbeatPublisher | None = None
        self.kv_events: KvEventLog | None = None  # None: prefix caching off, nothing to tell

    async def start(self) -> None:
        cfg = self.config
        try:
            if cfg.role in ("prefill", "both"):
                curve = None
                if cfg.curve_secret_key is not None and cfg.curve_allowed_clients_dir is not None:
                    curve = ServerCurve(cfg.curve_secret_key, cfg.curve_allowed_clients_dir)
                self.server = PrefillServer(
                    self.engine,
                    cfg.zmq_bind(cfg.kv_port),
                    ctx=self.ctx,
                    curve=curve,
                    stats=TransferStats(observe_latency=self.metrics.kv_transfer_time),
                    request_timeout_s=max(cfg.kv_timeout_s * 4, 30.0),
                    listen_fd=self.listeners.take_kv() if self.listeners else None,
                    prefill_rate=lambda: self.load.rates()[0],
                    # Well inside the decode side's wait for this daemon's next message.
                    pull_timeout_s=min(2.0, cfg.kv_timeout_s / 4),
                )
                await self.server.start()
                log.info("serving prefills on %s", cfg.kv_endpoint)
            if cfg.role == "decode":
                client_curve = None
                if cfg.curve_secret_key is not None and cfg.curve_server_public_key is not None:
                    client_curve = ClientCurve(cfg.curve_secret_key, cfg.curve_server_public_key)
                self.client = RemotePrefillClient(
                    self.engine,
                    ctx=self.ctx,
                    curve=client_curve,
                    stats=TransferStats(observe_latency=self.metrics.kv_transfer_time),
                    timeout_s=cfg.kv_timeout_s,
                )
                # Connect to the configured peers now: their pongs (what each supports, e.g.
                # receiving pages it lacks) are then in before the first request, which would
                # otherwise go without. ZeroMQ keeps retrying a peer that is not up yet.
                for peer in cfg.prefill_peers:
                    self.client.connect(peer)
            await self.load.start()
            started_at = time.time()
            if cfg.enable_prefix_caching:
                events = KvEventLog(self.load.daemon_id, started_at)
                await self.engine.call(events.attach)
                self.engine.on_kv_events = events.push
                self.kv_events = events
            self.publisher = HeartbeatPublisher(
                cfg.zmq_bind(cfg.heartbeat_port),
                cfg.heartbeat_interval_s,
                self.load.heartbeat,
                context=self.ctx,
                listen_fd=self.listeners.take_heartbeat() if self.listeners else None,
                started_at=started_at,
                events=self.kv_events,
            )
            await self.publisher.start()
        except (zmq.ZMQError, OSError) as exc:
            await self.stop(drain=False)
            raise TransferPlaneError(f"cannot open the daemon's ZeroMQ sockets: {exc}") from exc

    @property
    def in_flight(self) -> int:
        """KV transfers this daemon is serving for decode peers right now."""
        return self.server.in_flight if self.server is not None else 0

    def prefill_candidates(self, requested: str | None) -> list[str]:
        """Peers to try in order: the one the request named, then the configured ones
        (starting at a random one, so decode daemons spread their prefills)."""
        peers = list(self.config.prefill_peers)
        if peers:
            start = random.randrange(len(peers))
            peers = peers[start:] + peers[:start]
        if requested:
            peers = [requested] + [p for p in peers if p != requested]
        return peers

    async def set_draining(self, draining: bool) -> None:
        if self.server is not None:
            self.server.set_draining(draining)
        if self.publisher is not None:
            # Tell the routers now rather than up to one period later.
            await self.publisher.publish_now()

    def export_metrics(self, metrics: DaemonMetrics) -> None:
        if self.server is not None:
            metrics.sync_transfer_stats(self.server.stats, "sent")
        if self.client is not None:
            metrics.sync_transfer_stats(self.client.stats, "received")

    async def stop(self, drain: bool = True) -> None:
        if self.server is not None:
            await self.server.stop(drain=drain, timeout_s=self.config.drain_timeout_s)
        if self.client is not None:
            await self.client.close()
        if self.publisher is not None:
            await self.publisher.stop()
        self.engine.on_kv_events = None
        await self.load.stop()
        self.ctx.destroy(linger=0)
