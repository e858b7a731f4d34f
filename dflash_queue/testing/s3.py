"""A real S3-compatible HTTP endpoint on loopback for tests and benchmarks: moto's threaded server.

Moto keeps its buckets in module-level backends of this process, so `stop()` takes the HTTP listener down (clients
get connection refused, as when a store goes away) while every object survives, and `start()` on the same port
brings the same store back.
"""

from __future__ import annotations

import logging
import socket

import boto3

# Fixed, fake credentials for the loopback endpoint; moto accepts any.
TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "dfq-testing",
    "AWS_SECRET_ACCESS_KEY": "dfq-testing-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LoopbackS3:
    def __init__(self, port: int | None = None) -> None:
        from moto.server import ThreadedMotoServer

        self._server_class = ThreadedMotoServer
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._server = None
        # One line per request otherwise.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> LoopbackS3:
        if self._server is None:
            server = self._server_class(ip_address="127.0.0.1", port=self.port, verbose=False)
            server.start()
            self._server = server
        return self

    def stop(self) -> None:
        """Close the listener (new connections are refused); the stored objects stay in this process."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    def client(self):
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=TEST_CREDENTIALS["AWS_DEFAULT_REGION"],
            aws_access_key_id=TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def __enter__(self) -> LoopbackS3:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
