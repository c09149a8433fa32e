"""Which Host headers the API answers (DNS-rebinding protection), and which addresses count as loopback.

A web page on a name its author controls can re-point that name at 127.0.0.1 (or any address of your network)
and then drive a local API from your browser: the browser believes it talks to the page's own origin. What gives
it away is the Host header, which still carries the attacker's name. So a request is answered only when its Host
is a localhost name (`localhost`, `*.localhost`, loopback addresses), the address `--host` names, the address the
connection arrived on (an address literal cannot be re-pointed), this machine's hostname when listening on every
interface, or a name given with `--allowed-hosts` (`*` turns the check off). Pure functions, no I/O beyond
reading the machine's hostname once.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Sequence

WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def is_loopback(host: str) -> bool:
    """True for `localhost`, names under `.localhost`, and loopback address literals (127.0.0.0/8, ::1)."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str | None:
    """The name or address of a Host header value, lowercased, without port or brackets ('[::1]:8000' -> '::1');
    None when it is not a well-formed host."""
    value = header.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0 or (value[end + 1 :] and not _is_port(value[end + 1 :])):
            return None
        return value[1:end] or None
    name, colon, port = value.partition(":")
    if colon and not port.isdigit():
        return None
    name = name.rstrip(".")
    if not name or any(c.isspace() or c in "/\\@?#" for c in name):
        return None
    return name


def _is_port(text: str) -> bool:
    return text.startswith(":") and text[1:].isdigit()


def _normal(host: str) -> str:
    name = host.strip().lower().strip("[]").rstrip(".")
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return name
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:10.0.0.5 on a dual-stack socket is 10.0.0.5
    return str(mapped or address)


class AllowedHosts:
    """The Host names a server listening on `bind_host` answers (see the module docstring)."""

    def __init__(self, bind_host: str, extra: Sequence[str] = ()):
        self.any = "*" in extra
        names = {_normal(h) for h in extra if h != "*"}
        if bind_host not in WILDCARD_HOSTS:
            names.add(_normal(bind_host))
        else:
            names.add(_normal(socket.gethostname()))
        self.names = frozenset(names)

    def allows(self, header: str | None, local_address: str | None = None) -> bool:
        """Whether a request with this Host header value, on a connection that arrived at `local_address`, is
        answered. A missing or malformed Host is refused."""
        if self.any:
            return True
        if header is None:
            return False
        name = host_name(header)
        if name is None:
            return False
        name = _normal(name)
        if is_loopback(name) or name in self.names:
            return True
        return local_address is not None and name == _normal(local_address)
