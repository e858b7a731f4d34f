"""A real S3-compatible HTTP endpoint on loopback for tests and benchmarks: moto's threaded server.

Moto keeps its buckets in module-level backends of this process, so `stop()` takes the HTTP listener down (clients
get connection refused, as when a store goes away) while every object survives, and `start()` on the same port
brings the same store back.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

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
        self._server: Any = None
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


class LoopbackS3Process:
    """The same endpoint in its own process (`python -m moto.server`): for benchmarks, where a server sharing
    the client's interpreter would compete with it for the GIL. Its objects live and die with the process."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.process: Any = None

    def start(self, timeout: float = 60.0) -> LoopbackS3Process:
        import subprocess
        import sys
        import time

        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server did not start on port {self.port}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        self.process = None

    client = LoopbackS3.client
    create_bucket = LoopbackS3.create_bucket

    def __enter__(self) -> LoopbackS3Process:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
