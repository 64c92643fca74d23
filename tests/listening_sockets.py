"""The TCP sockets a process and its descendants listen on, read from Linux's /proc (no psutil, no ``ss``): what
the server tests check stays on loopback."""

import ipaddress
import os
import pathlib
import socket

LISTEN = "0A"  # the TCP state column of /proc/net/tcp for a listening socket


def descendants(root: int) -> set:
    """``root`` and every process below it, from each process's parent in /proc/PID/stat."""
    children = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The command name in parentheses may hold spaces and parentheses: the fields after the last ')'.
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _address(hex_address: str):
    """An address of /proc/net/tcp or tcp6 (host byte order in 32-bit words) and its port."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words), int(port, 16)


def _listening_inodes() -> dict:
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = pathlib.Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == LISTEN:
                inodes[fields[9]] = _address(fields[1])
    return inodes


def listening_sockets(root: int) -> list:
    """``(pid, command name, address, port)`` for every TCP socket ``root`` or a descendant listens on."""
    inodes, found = _listening_inodes(), []
    for pid in descendants(root):
        try:
            name = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone meanwhile
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile (the listing's own descriptor among them)
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                found.append((pid, name, *inodes[link[8:-1]]))
    return found


def is_loopback(address) -> bool:
    """Whether only this machine can reach ``address`` (an IPv4-mapped IPv6 loopback counts)."""
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def self_check() -> None:
    """The reader finds a loopback listener of this process, and a wildcard one as not loopback."""
    with socket.create_server(("127.0.0.1", 0)) as local, socket.create_server(("0.0.0.0", 0)) as wild:
        seen = {port: address for _, _, address, port in listening_sockets(os.getpid())}
        assert is_loopback(seen[local.getsockname()[1]])
        assert not is_loopback(seen[wild.getsockname()[1]])
