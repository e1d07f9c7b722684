"""What a webhook may be sent to: a URL that parses, and for a tenant's webhook only public addresses, also where an
IPv6 address carries an IPv4 one (a translator or tunnel would deliver to that IPv4 address)."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

import httpx

# Addresses that carry an IPv4 address in their last 32 bits: NAT64's well-known prefix (RFC 6052) and the
# deprecated IPv4-compatible form. 64:ff9b:1::/48 is local-use NAT64 (RFC 8215), never public, and its embedded
# address sits where the operator's prefix length puts it: it is refused whole.
NAT64 = ipaddress.ip_network("64:ff9b::/96")
NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


def webhook_url_problem(url: str) -> str | None:
    """What is wrong with a webhook URL, in words for whoever gave it; None when it can be sent to."""
    example = "give one such as https://hooks.example.com/alerts"
    try:
        parts = urlsplit(url)
        port = parts.port  # a port that is not a number, or past 65535, raises here
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        return f"The URL cannot be used ({exc}): {example}."
    if parts.scheme not in ("http", "https"):
        return f"The URL must start with http:// or https://: {example}."
    if not parts.hostname:
        return f"The URL names no host: {example}."
    if port == 0:
        return "The URL's port must be between 1 and 65535."
    return None


def is_public_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Globally reachable, and so is every IPv4 address an IPv6 one carries (IPv4-mapped, NAT64, 6to4, Teredo):
    those reach the IPv4 address through a translator or tunnel, private ones included."""
    if not address.is_global:
        return False
    if address.version == 4:
        return True
    if address in NAT64_LOCAL:
        return False
    return all(embedded.is_global for embedded in _embedded_ipv4(address))


def _embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    found = [a for a in (address.ipv4_mapped, address.sixtofour) if a is not None]
    found += list(address.teredo or ())
    if address in NAT64 or address in IPV4_COMPATIBLE:
        found.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
    return found
