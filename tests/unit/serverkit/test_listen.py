"""serverkit/listen.py: a port that cannot be listened on is one line naming the port and the flag."""

from __future__ import annotations

import errno

from serverkit.listen import Listener, cannot_listen, cannot_listen_on


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


def test_several_ports_in_use_are_named_in_one_line() -> None:
    in_use = OSError(errno.EADDRINUSE, "address already in use")
    message = cannot_listen_on("127.0.0.1", [(Listener("HTTP", 8000, "--http-port"), in_use),
                                             (Listener("gRPC", 8001, "--grpc-port"), in_use)])
    assert message == "HTTP port 8000 and gRPC port 8001 are already in use: choose others with --http-port and --grpc-port"


def test_several_causes_are_each_said_on_the_one_line() -> None:
    message = cannot_listen_on("0.0.0.0", [(Listener("HTTP", 80, "--http-port"), OSError(errno.EACCES, "Permission denied")),
                                           (Listener("gRPC", 8001, "--grpc-port"), OSError(errno.EADDRINUSE, "in use"))])
    assert message == ("cannot listen for HTTP on 0.0.0.0:80 (Permission denied): check the address, or choose another "
                       "port with --http-port; gRPC port 8001 is already in use: choose another with --grpc-port")
