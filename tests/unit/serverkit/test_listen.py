"""serverkit/listen.py: a port that cannot be listened on is one line naming the port and the flag."""

from __future__ import annotations

import errno

from serverkit.listen import cannot_listen


def test_a_port_in_use_names_the_port_and_the_flag() -> None:
    error = OSError(errno.EADDRINUSE, "address already in use")
    assert cannot_listen("HTTP", "127.0.0.1", 8000, "--http-port", error) == \
        "HTTP port 8000 is already in use: choose another with --http-port"


def test_another_cause_is_said_as_it_is() -> None:
    error = OSError(errno.EACCES, "Permission denied")
    message = cannot_listen("gRPC", "0.0.0.0", 80, "--grpc-port", error)
    assert message == ("cannot listen for gRPC on 0.0.0.0:80 (Permission denied): "
                       "check the address, or choose another port with --grpc-port")
    assert "\n" not in message
