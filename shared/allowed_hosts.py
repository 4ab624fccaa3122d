"""Which generator URLs the learner may send its API token to: an allow list of addresses, networks and names.

A generator registers its URL in Redis, and the learner POSTs every weight push there with ``Authorization:
Bearer <API_TOKEN>``. Whoever can write that registration would otherwise choose where the token goes. So
the learner contacts a registered URL only when its host is on ``learner.allowed_generator_hosts``:

* an IP address (``127.0.0.1``, ``::1``) or a network in CIDR notation (``172.28.0.0/16``): matches a URL
  whose host is an IP literal inside it;
* a host name (``localhost``, ``gen-0.example``): matches that exact name, case-insensitively.

Names in URLs are never resolved here: a name is allowed only when it is listed itself (resolving it to match
a network would let whoever controls its DNS answer pick the address after the check).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK = ("127.0.0.1", "::1", "localhost")  # one machine's run (asyncgrpo run registers 127.0.0.1)


def parse_entry(entry: str) -> Network | str:
    """One entry: a network (an address is a network of one), or a lowercase host name; ValueError if neither."""
    text = entry.strip()
    try:
        return ipaddress.ip_network(text, strict=False)
    except ValueError:
        pass
    name = text.lower().rstrip(".")
    labels = name.split(".")
    if not name or "/" in name or not all(label and label.replace("-", "").isalnum() for label in labels):
        raise ValueError(
            f"{entry!r} is neither an IP address, a network in CIDR notation (10.244.0.0/16) nor a host name"
        )
    return name


class HostAllowList:
    """The hosts of ``entries`` (see the module docstring); :meth:`allows` checks a URL against them."""

    def __init__(self, entries: Iterable[str]) -> None:
        parsed = [parse_entry(entry) for entry in entries]
        self.networks = [entry for entry in parsed if not isinstance(entry, str)]
        self.names = {entry for entry in parsed if isinstance(entry, str)}

    def allows(self, url: str) -> bool:
        """Whether ``url`` is http(s) and its host is listed (an IP inside a listed network, or a listed name)."""
        try:
            parts = urlsplit(url)
            host = parts.hostname
        except ValueError:  # a malformed URL (an unclosed IPv6 bracket) is never contacted
            return False
        if parts.scheme not in ("http", "https") or not host:
            return False
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return host.rstrip(".") in self.names
        return any(address.version == network.version and address in network for network in self.networks)
