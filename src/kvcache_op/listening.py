"""Where a server listens: which hosts are loopback, a listening socket, a free port, the address and URL it prints,
and the cores its replicas may share."""

from __future__ import annotations

import os
import random
import socket


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (all of 127.0.0.0/8, ``::1``) or ``localhost``."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost: not judged loopback (it may resolve anywhere)
        return False


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket (port 0: a free one, read back from the socket); ``OSError`` naming the address
    if it cannot be had (the port taken), the socket closed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as error:
        sock.close()
        raise OSError(error.errno, f"cannot listen on {address_of(host, port)}: {error.strerror}") from None
    return sock


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform tells it), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def free_port(host: str) -> int:
    """A port free on ``host`` now, below the kernel's ephemeral range where it names one. Another process may still
    take it before it is bound again, but no outgoing connection will: those take ephemeral ports, as bind(0) does,
    and Ray Serve's proxy binds the number seconds after it is chosen (one was taken in between)."""
    low = _ephemeral_low()
    if low > 2048:
        for _ in range(64):
            port = random.randrange(max(1024, low - 16384), low)
            try:
                with listening_socket(host, port):
                    return port
            except OSError:
                continue
    with listening_socket(host, 0) as sock:
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux), else 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as stream:
            return int(stream.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def address_of(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def url_of(host: str, port: int) -> str:
    """The server's base URL."""
    return f"http://{address_of(host, port)}"
