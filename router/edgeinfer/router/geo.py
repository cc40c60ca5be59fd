"""Where a client is: its real address behind trusted proxies, then its coordinates.

:meth:`ClientLocator.client_ip` follows nginx's ``real_ip_recursive on``: forwarding headers are
believed only when the TCP peer is a trusted proxy, and then the chain is walked from the right,
skipping trusted hops; the first untrusted address is the client. Anything to its left was
written by the client itself and may be forged.

:meth:`ClientLocator.locate` never fails: an address the database cannot place (private,
loopback, unknown, malformed, no database at all) is taken to be near this router, which is
exactly where anycast delivered it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol

import geoip2.database
import geoip2.errors

from edgeinfer.router.errors import RouterError

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
ForwardedHeader = Literal["x-forwarded-for", "forwarded"]


class Located(Protocol):
    """Anything with coordinates: :class:`GeoPoint`, ``PopConfig``, ``DaemonView``."""

    @property
    def lat(self) -> float: ...

    @property
    def lon(self) -> float: ...


@dataclasses.dataclass(frozen=True, slots=True)
class GeoPoint:
    lat: float
    lon: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lat) and -90 <= self.lat <= 90):
            raise RouterError(f"latitude {self.lat} not in [-90, 90]")
        if not (math.isfinite(self.lon) and -180 <= self.lon <= 180):
            raise RouterError(f"longitude {self.lon} not in [-180, 180]")


def parse_ip(text: str) -> IPAddress | None:
    """An address from a header or peer string (``1.2.3.4``, ``1.2.3.4:80``, ``[::1]:80``,
    quoted), with IPv4-mapped IPv6 unwrapped; None when it is not an address."""
    text = text.strip().strip('"')
    if text.startswith("["):  # [v6] or [v6]:port
        text = text[1 : text.find("]")] if "]" in text else ""
    elif text.count(":") == 1:  # v4:port (a bare v6 has at least two colons)
        text = text.split(":", 1)[0]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _forwarded_for(value: str) -> list[str]:
    """The ``for=`` values of an RFC 7239 ``Forwarded`` header, left to right.

    An element without ``for=`` yields "" so that it still counts as a hop (one we cannot trust).
    """
    out = []
    for element in _split_outside_quotes(value, ","):
        found = ""
        for pair in _split_outside_quotes(element, ";"):
            key, _, val = pair.partition("=")
            if key.strip().lower() == "for":
                found = val.strip()
        out.append(found)
    return out


def _split_outside_quotes(text: str, sep: str) -> list[str]:
    parts, start, quoted = [], 0, False
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif ch == sep and not quoted:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


class ClientLocator:
    def __init__(
        self,
        db_path: Path | None,
        trusted_proxies: Sequence[str],
        fallback: GeoPoint,
        *,
        forwarded_header: ForwardedHeader = "x-forwarded-for",
    ) -> None:
        """``forwarded_header`` is the one header the trusted proxies append to. The other is
        ignored: a proxy passes through headers it does not rewrite, so a client could forge it.
        """
        self.fallback = fallback
        self.forwarded_header = forwarded_header
        self.trusted: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for cidr in trusted_proxies:
            try:
                self.trusted.append(ipaddress.ip_network(cidr.strip(), strict=False))
            except ValueError as e:
                raise RouterError(f"trusted proxy {cidr!r} is not a CIDR: {e}") from e
        self._reader: geoip2.database.Reader | None = None
        if db_path is not None:
            try:
                self._reader = geoip2.database.Reader(str(db_path))
            except (OSError, ValueError) as e:
                raise RouterError(f"cannot open GeoIP database {db_path}: {e}") from e

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    def is_trusted(self, ip: IPAddress | None) -> bool:
        return ip is not None and any(ip in net for net in self.trusted)

    def client_ip(self, peer: str | None, headers: Mapping[str, str]) -> str:
        """The client's address (as text) for a request from TCP peer ``peer``."""
        peer = peer or ""  # aiohttp reports no peer for a Unix socket
        hop = parse_ip(peer)
        if not self.is_trusted(hop):
            return peer
        chain = self._header_chain(headers)
        while chain:
            candidate = parse_ip(chain.pop())
            if candidate is None:
                # The trusted hop vouched for something that is not an address ("unknown", an
                # obfuscated id): it is the last hop we can name.
                break
            hop = candidate
            if not self.is_trusted(hop):
                break
        return str(hop)

    def locate(self, ip: str) -> GeoPoint:
        addr = parse_ip(ip)
        if addr is None or self._reader is None or not addr.is_global:
            return self.fallback
        try:
            location = self._reader.city(addr).location
        except (geoip2.errors.GeoIP2Error, ValueError) as e:  # not found, or a corrupt record
            log.debug("no location for %s: %s", ip, e)
            return self.fallback
        if location.latitude is None or location.longitude is None:
            return self.fallback
        return GeoPoint(location.latitude, location.longitude)

    def _header_chain(self, headers: Mapping[str, str]) -> list[str]:
        """Addresses of the configured header, left to right, over all its occurrences."""
        name = self.forwarded_header
        getall = getattr(headers, "getall", None)  # aiohttp: a header may appear several times
        if getall is not None:
            values = list(getall(name, []))
        else:
            values = [v for k, v in headers.items() if k.lower() == name]
        joined = ",".join(values)
        if not joined.strip():
            return []
        if name == "forwarded":
            return _forwarded_for(joined)
        return [part.strip() for part in joined.split(",")]
