"""The driver's own checks, without starting a run."""

import pytest


def test_driver_refuses_a_fleet_port_someone_else_listens_on():
    import socket

    from launch.train import check_port_free

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(SystemExit, match="fleet.port"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # closed again: free
