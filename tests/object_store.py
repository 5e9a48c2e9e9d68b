"""An S3-compatible endpoint on 127.0.0.1 for the object-storage tests (test process side).

The server is moto's standalone S3 server (``moto[server]``) in a child process, bound to
127.0.0.1 only, started within a bounded time and stopped by the fixture that started it.
:class:`DroppingProxy` sits between one rank and the server and drops a connection in the
middle of an upload, once, to inject a dropped connection deterministically (no timing).
:func:`write_msc_config` writes the multi-storage-client profiles the ranks use
(``MSC_CONFIG``).

Why not a real store: Debian's ``radosgw`` (Ceph 16) needs a RADOS cluster behind it (a
monitor and an OSD with their keyrings); it has no standalone backend in that release.
See docs/object_storage.md for what moto does not prove.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Dict, Optional

__all__ = [
    "LOOPBACK",
    "ACCESS_KEY",
    "SECRET_KEY",
    "object_store_skip_reason",
    "LoopbackS3Server",
    "DroppingProxy",
    "write_msc_config",
    "s3_client",
]

LOOPBACK = "127.0.0.1"
ACCESS_KEY = "megatron-async-test"
SECRET_KEY = "megatron-async-test-secret"
START_TIMEOUT_S = 60.0


def object_store_skip_reason() -> Optional[str]:
    """Why the object-storage tests cannot run here, or None when they can."""
    for module, extra in (("multistorageclient", "msc"), ("moto.server", "test"), ("boto3", "msc")):
        try:
            __import__(module)
        except ImportError as exc:
            return f"{module} is not installed ({exc}); pip install megatron-async[{extra}]"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


class LoopbackS3Server:
    """moto's S3 server on 127.0.0.1 in a child process.

    Args:
        log_path: where the server's output goes.
        enforce_auth: refuse every request whose credentials moto's IAM does not know
            (no user exists, so every key is refused): the "wrong credentials" store.
    """

    def __init__(self, log_path: str, enforce_auth: bool = False):
        self.port = _free_port()
        self.endpoint = f"http://{LOOPBACK}:{self.port}"
        self._log_path = log_path
        self._enforce_auth = enforce_auth
        self._proc: Optional[subprocess.Popen] = None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> "LoopbackS3Server":
        env = dict(os.environ)
        if self._enforce_auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        log = open(self._log_path, "ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", LOOPBACK, "-p", str(self.port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"the moto server exited with code {self._proc.returncode}; see {self._log_path}"
                )
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
                return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the moto server did not answer within {timeout_s:.0f}s")
            time.sleep(0.2)

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=10)
        self._proc = None


def s3_client(endpoint: str, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY):
    """A boto3 client of ``endpoint`` (no retries: a test wants the first answer)."""
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=access_key,
        aws_secret_access_key=secret_key,
        config=Config(retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=5, read_timeout=30),
    )


class FaultyProxy:
    """A TCP proxy on 127.0.0.1 that plays a store failing in the middle of an upload.

    Bytes are forwarded to ``target_port`` until one connection's client has sent more
    than ``fault_after_bytes``; from then on, that connection and every later one get
    the ``fault``:

    * ``"drop"``: the connection is closed on both sides and the proxy stops listening,
      so retries and new connections are refused (a server gone away);
    * ``"silent"``: the connection stays open and nothing more is forwarded either way,
      new connections are accepted and never answered (a store that stopped answering);
    * ``"drip"``: the client gets an HTTP status line and headers that never end, one
      byte every ``drip_interval_s`` (each byte resets the client's socket timeout).
    """

    def __init__(self, target_port: int, fault_after_bytes: int, fault: str = "drop",
                 drip_interval_s: float = 0.5):
        if fault not in ("drop", "silent", "drip"):
            raise ValueError(f"unknown fault {fault!r}")
        self.port = _free_port()
        self.endpoint = f"http://{LOOPBACK}:{self.port}"
        self._target_port = target_port
        self._after = fault_after_bytes
        self._fault = fault
        self._drip_interval_s = drip_interval_s
        self._triggered = threading.Event()
        self._stop = threading.Event()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((LOOPBACK, self.port))
        self._listener.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def triggered(self) -> bool:
        return self._triggered.is_set()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._triggered.is_set():
                threading.Thread(target=self._misbehave, args=(client,), daemon=True).start()
                continue
            upstream = socket.create_connection((LOOPBACK, self._target_port), timeout=30)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _misbehave(self, client: socket.socket) -> None:
        """Serve one connection after the fault: hold it open, or drip a response."""
        try:
            if self._fault == "drip":
                head = b"HTTP/1.1 200 OK\r\n" + b"x-slow: " + b"a" * 1_000_000
                for byte in head:
                    if self._stop.wait(self._drip_interval_s):
                        break
                    client.sendall(bytes([byte]))
            else:
                self._stop.wait()
        except OSError:
            pass
        client.close()

    def _pump(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        sent = 0
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                sent += len(data)
                if from_client and sent > self._after and not self._triggered.is_set():
                    self._triggered.set()
                    if self._fault == "drop":
                        self.close()
                        break
                if self._triggered.is_set() and self._fault != "drop":
                    if from_client:  # the client that tripped the fault is answered by it
                        self._misbehave(source)
                    return  # nothing from upstream reaches the client any more
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def write_msc_config(path: str, profiles: Dict[str, Dict[str, str]]) -> str:
    """Write an MSC configuration with S3 ``profiles`` and return its path.

    ``profiles`` maps a profile name to ``{"endpoint": ..., "bucket": ...}`` and optional
    ``access_key`` / ``secret_key``. Requests are not retried and time out in seconds, so
    that a fault fails a save quickly.
    """
    config = {"profiles": {}}
    for name, spec in profiles.items():
        config["profiles"][name] = {
            "storage_provider": {
                "type": "s3",
                "options": {
                    "base_path": spec["bucket"],
                    "endpoint_url": spec["endpoint"],
                    "region_name": "us-east-1",
                    "connect_timeout": 5,
                    "read_timeout": 30,
                    "retries": {"max_attempts": 1, "mode": "standard"},
                },
            },
            "credentials_provider": {
                "type": "S3Credentials",
                "options": {
                    "access_key": spec.get("access_key", ACCESS_KEY),
                    "secret_key": spec.get("secret_key", SECRET_KEY),
                },
            },
        }
    with open(path, "w") as f:
        json.dump(config, f)  # YAML is a superset of JSON
    return path
