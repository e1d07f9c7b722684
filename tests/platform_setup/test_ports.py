"""Port choice for engines, the dev stack and the tests' engine helpers."""

import socket

from inference_platform.ports import free_port, port_is_free


def test_free_ports_are_never_handed_out_twice():
    # Probing port 0 a thousand times here repeats some 30 ports (the kernel does not hold a probed port);
    # an engine given one port twice (HTTP and KV events) fails to bind.
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)
    assert all(port_is_free(port) for port in ports[:50])


def test_a_bound_port_is_not_free_and_a_released_one_is():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        bound = listener.getsockname()[1]
        assert not port_is_free(bound)
    assert port_is_free(bound)
