"""A real S3-compatible server on loopback for the storage tests: the moto server (``python -m
moto.server``, installed by the ``test`` extra) in a subprocess on a free port, and a TCP relay
in front of it that a test can SIGKILL mid-upload.

moto keeps its objects in memory, so killing the server itself would also erase the evidence
of what a torn upload left behind; killing the relay instead cuts every connection of the
client mid-request exactly as a dead S3 endpoint does, while the bucket survives to be read
through the server's own port.

- ``S3Server(log_dir)``: start/stop the server; ``uri(bucket, path)`` is an ``s3://`` URI whose
  query options point pyarrow at this server; ``env`` holds the ``AWS_*`` variables for
  processes (pyarrow and boto read ``AWS_ENDPOINT_URL``).
- ``Relay(target_port)``: the relay process (``python tests/support/s3_server.py relay LISTEN TARGET``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
"""Any credentials do for moto; real ones come from the environment the same way."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise TimeoutError(f"{what} did not listen on port {port} within {timeout_s:.0f}s")


class S3Server:
    """The moto server in a subprocess on a free loopback port."""

    def __init__(self, log_dir: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}
        self._log = open(log_dir / f"moto-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        _wait_port(self.port, self.proc, "the moto server")
        urllib.request.urlopen(self.endpoint, timeout=30).read()  # it answers S3 requests

    def uri(self, bucket: str, path: str = "", port: int | None = None) -> str:
        """``s3://bucket/path`` pointed at this server (or at a relay on ``port``)."""
        where = f"127.0.0.1:{port or self.port}"
        return f"s3://{bucket}/{path}?endpoint_override={where}&scheme=http".replace("/?", "?")

    def create_bucket(self, bucket: str) -> None:
        import pyarrow.fs as pafs

        fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{self.port}", scheme="http",
                               access_key=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                               secret_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                               region=CREDENTIALS["AWS_DEFAULT_REGION"],
                               allow_bucket_creation=True)
        fs.create_dir(bucket)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()


class Relay:
    """A TCP relay to ``target_port`` in its own process (SIGKILL it to cut every connection)."""

    def __init__(self, target_port: int, rate_mb_s: float = 0.0):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, __file__, "relay", str(self.port),
                                      str(target_port), str(rate_mb_s)])
        _wait_port(self.port, self.proc, "the relay")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def _pipe(src: socket.socket, dst: socket.socket, rate: float) -> None:
    """Copy ``src`` to ``dst`` (at most ``rate`` bytes/s when > 0) until either side closes."""
    start, sent = time.monotonic(), 0
    with contextlib.suppress(OSError):
        while data := src.recv(1 << 16):
            dst.sendall(data)
            sent += len(data)
            if rate > 0:
                time.sleep(max(0.0, start + sent / rate - time.monotonic()))
    for sock in (src, dst):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def relay_main(listen: int, target: int, rate_mb_s: float) -> None:
    server = socket.create_server(("127.0.0.1", listen))
    while True:
        client, _ = server.accept()
        upstream = socket.create_connection(("127.0.0.1", target))
        threading.Thread(target=_pipe, args=(client, upstream, rate_mb_s * 1e6),
                         daemon=True).start()
        threading.Thread(target=_pipe, args=(upstream, client, 0.0), daemon=True).start()


if __name__ == "__main__" and sys.argv[1] == "relay":
    relay_main(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
