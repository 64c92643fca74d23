"""kvcache_op.listening: a free port for a server that binds it later is taken below the kernel's ephemeral range,
where outgoing connections (which take ephemeral ports) cannot take it in between."""

import pathlib

import pytest

from kvcache_op.listening import free_port, listening_socket

RANGE = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not RANGE.is_file(), reason="no /proc/sys/net/ipv4/ip_local_port_range (not Linux)")
def test_a_free_port_lies_below_the_ephemeral_range_and_binds():
    low = int(RANGE.read_text().split()[0])
    if low <= 2048:
        pytest.skip(f"the ephemeral range starts at {low}: no room below it")
    ports = {free_port("127.0.0.1") for _ in range(8)}
    assert all(1024 <= p < low for p in ports), (ports, low)
    for port in ports:
        with listening_socket("127.0.0.1", port):
            pass


def test_a_taken_port_is_not_given():
    with listening_socket("127.0.0.1", 0) as held:
        taken = held.getsockname()[1]
        assert all(free_port("127.0.0.1") != taken for _ in range(8))
