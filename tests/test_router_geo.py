"""Client address behind proxies, GeoIP lookups (MaxMind's test database), the network model
and the RTT prober."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict

from edgeinfer.router.errors import RouterError
from edgeinfer.router.geo import ClientLocator, GeoPoint
from edgeinfer.router.network import NetworkModel, RttProber, great_circle_km
from edgeinfer.router.pop_registry import PopConfig, PopRegistry

DB = Path(__file__).parent / "data" / "geoip" / "GeoIP2-City-Test.mmdb"
HERE = GeoPoint(50.11, 8.68)  # the router's PoP (Frankfurt)
# Addresses of the test database's cities, on three continents.
LONDON_IP, MILTON_IP, CHANGCHUN_IP = "81.2.69.160", "216.160.83.56", "175.16.199.0"
PROXY = "10.0.0.5"


@pytest.fixture
def locator() -> ClientLocator:
    return ClientLocator(DB, ["10.0.0.0/8", "2001:db8::/32"], HERE)


def test_forwarding_headers_of_an_untrusted_peer_are_ignored(locator: ClientLocator) -> None:
    headers = {"X-Forwarded-For": LONDON_IP}
    assert locator.client_ip("198.51.100.7", headers) == "198.51.100.7"
    assert locator.client_ip(None, headers) == ""


def test_trusted_chain_yields_the_right_most_untrusted_address(locator: ClientLocator) -> None:
    forged, client = "203.0.113.9", LONDON_IP
    xff = f"{forged}, {client}, 10.1.1.1, 10.2.2.2:8080"
    assert locator.client_ip(PROXY, {"x-forwarded-for": xff}) == client
    # Repeated headers count as one comma-joined list (aiohttp's CIMultiDict).
    multi = CIMultiDict([("X-Forwarded-For", forged), ("X-Forwarded-For", f"{client}, 10.1.1.1")])
    assert locator.client_ip(PROXY, multi) == client
    # All hops trusted: the left-most one is as far as anyone can see.
    assert locator.client_ip(PROXY, {"X-Forwarded-For": "10.9.9.9, 10.1.1.1"}) == "10.9.9.9"
    # Garbage from a trusted hop stops the walk at that hop.
    assert locator.client_ip(PROXY, {"X-Forwarded-For": f"{client}, unknown"}) == PROXY
    assert locator.client_ip(PROXY, {}) == PROXY


def test_rfc7239_forwarded_when_configured() -> None:
    loc = ClientLocator(None, ["10.0.0.0/8"], HERE, forwarded_header="forwarded")
    value = 'for=192.0.2.60;proto=https, For="[2001:db8:cafe::17]:4711", for=10.3.3.3'
    assert loc.client_ip(PROXY, {"Forwarded": value}) == "2001:db8:cafe::17"
    # The header the proxies do not rewrite is a client's to forge: ignored.
    assert loc.client_ip(PROXY, {"X-Forwarded-For": LONDON_IP}) == PROXY
    assert loc.client_ip(PROXY, {"Forwarded": "for=_hidden, for=10.3.3.3"}) == "10.3.3.3"


def test_bad_configuration_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RouterError, match="not-a-cidr"):
        ClientLocator(None, ["not-a-cidr"], HERE)
    with pytest.raises(RouterError, match="GeoIP database"):
        ClientLocator(tmp_path / "missing.mmdb", [], HERE)
    with pytest.raises(RouterError):
        GeoPoint(0.0, 181.0)


def test_locate_cities_on_three_continents(locator: ClientLocator) -> None:
    assert locator.locate(LONDON_IP) == GeoPoint(51.5142, -0.0931)
    assert locator.locate(MILTON_IP) == GeoPoint(47.2513, -122.3149)
    assert locator.locate(CHANGCHUN_IP) == GeoPoint(43.88, 125.3228)
    assert locator.locate(f"::ffff:{LONDON_IP}") == GeoPoint(51.5142, -0.0931)


@pytest.mark.parametrize(
    "ip", ["127.0.0.1", "10.1.2.3", "192.168.0.1", "::1", "fe80::1%eth0", "x", "", "1.1.1.1"]
)
def test_unplaceable_addresses_fall_back_to_the_router(locator: ClientLocator, ip: str) -> None:
    assert locator.locate(ip) == HERE


def test_no_database_means_every_client_is_local() -> None:
    assert ClientLocator(None, [], HERE).locate(LONDON_IP) == HERE


def test_great_circle_and_rtt_floor() -> None:
    london, nyc = GeoPoint(51.5074, -0.1278), GeoPoint(40.7128, -74.006)
    assert great_circle_km(london, nyc) == pytest.approx(5570, abs=15)
    net = NetworkModel(fibre_km_per_ms=100.0, fixed_rtt_ms=2.0)
    assert net.client_rtt_s(london, nyc, HERE, None) == pytest.approx(0.0577, abs=2e-4)
    dots = np.array([1.0, 0.5, -1.0])
    assert np.allclose(net.rtt_floor_from_dot_s(dots), net.rtt_floor_s(np.arccos(dots) * 6371.0088))
    # The per-request form: same point (dot 1), antipode (dot -1) and between, never NaN.
    xyz = np.array([[1.0, 0.0, 0.0], [0.5, 0.75**0.5, 0.0], [-1.0, 0.0, 0.0]])
    to_point = net.rtt_floor_to_point_s(xyz, (1.0, 0.0, 0.0))
    assert np.allclose(to_point, net.rtt_floor_from_dot_s(dots), rtol=0, atol=1e-6)


def test_measured_rtt_applies_only_in_the_routers_catchment() -> None:
    net = NetworkModel(catchment_km=1000.0)
    paris, tokyo = GeoPoint(48.86, 2.35), GeoPoint(35.68, 139.69)
    floor = net.client_rtt_s(paris, tokyo, HERE, None)
    assert net.client_rtt_s(paris, tokyo, HERE, floor + 0.05) == pytest.approx(floor + 0.05)
    assert net.client_rtt_s(paris, tokyo, HERE, 0.001) == floor  # nothing beats the floor
    sydney = GeoPoint(-33.87, 151.21)
    far = net.client_rtt_s(sydney, tokyo, HERE, None)
    assert net.client_rtt_s(sydney, tokyo, HERE, 5.0) == far


def test_kv_transfer_between_pops() -> None:
    net = NetworkModel(inter_pop_gbps=8.0)
    fra, ams = GeoPoint(50.11, 8.68), GeoPoint(52.37, 4.9)
    assert net.kv_transfer_s(fra, fra, 1e9) == 0.0
    rtt = net.inter_pop_rtt_s(fra, ams)
    assert net.kv_transfer_s(fra, ams, 1e9) == pytest.approx(rtt + 1.0)


@pytest.mark.asyncio
async def test_rtt_prober_records_an_ewma_per_pop() -> None:
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/health", health)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    registry = PopRegistry(
        [
            PopConfig("fra", 50.11, 8.68, (url,)),
            PopConfig("dead", 0.0, 0.0, ("http://127.0.0.1:9",)),
        ],
        here="fra",
        heartbeat_interval_s=1.0,
    )
    prober = RttProber(registry, interval_s=0.02)
    await prober.start()
    try:
        for _ in range(200):
            if registry.rtt("fra") is not None:
                break
            await asyncio.sleep(0.01)
        rtt = registry.rtt("fra")
        assert rtt is not None and 0 < rtt < 0.5
        assert registry.rtt("dead") is None
    finally:
        await prober.stop()
        await server.close()
