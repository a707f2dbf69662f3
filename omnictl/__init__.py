"""omnictl: the command-line client of omnid, and a small client library other programs can import.

Importing this package runs in the importer's process and thread, loads only the standard library
(never torch, vLLM, diffusers or click) and blocks on nothing; only ``Client`` calls touch the socket.

    from omnictl import Client
    job = Client().submit("t2i", {"prompt": "a red fox"})
"""

from omnictl.client import (
    ApiError,
    Client,
    ClientError,
    ConnectionLost,
    DaemonUnreachable,
    ProtocolError,
    default_socket_path,
    file_input,
)

__all__ = [
    "ApiError",
    "Client",
    "ClientError",
    "ConnectionLost",
    "DaemonUnreachable",
    "ProtocolError",
    "default_socket_path",
    "file_input",
]
