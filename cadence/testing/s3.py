"""A real S3-compatible server on 127.0.0.1 for tests and benchmarks: moto's server mode in a process of its own.

`s3_server()` starts `moto` on a free port, creates a bucket, and sets the
environment s3fs (and botocore) read: credentials, region and
`AWS_ENDPOINT_URL`. Child processes started inside it inherit the
environment, so a training subprocess writes to the same server. The server
runs in its own process: killing a writer never takes the server with it,
and the server's work does not share a GIL with the writer it serves.
Needs the `dev` extra (`moto[server]`, `s3fs`); `missing()` says what is
absent, for a test's skip reason.

Example:
    >>> from cadence.testing.s3 import s3_server
    >>> with s3_server() as server:  # doctest: +SKIP
    ...     Checkpoint(dir=server.url("run/checkpoints"))
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import attrs

__all__ = ["S3Server", "missing", "s3_server"]

_SERVE = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the parent closes it (or dies)
server.stop()
"""

#: The environment s3fs and botocore need for the local server (besides `AWS_ENDPOINT_URL`).
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def missing() -> str | None:
    """Why the local S3 server cannot run here (None: it can): the packages of the `dev` extra it needs."""
    absent = [name for name in ("moto", "flask", "s3fs") if importlib.util.find_spec(name) is None]
    if absent:
        return f"needs {', '.join(absent)} (pip install 'moto[server]' s3fs, or the 'dev' extra)"
    return None


@attrs.define
class S3Server:
    """A running local S3 server: its endpoint, its bucket, and the environment a client needs."""

    endpoint: str
    bucket: str
    env: dict[str, str]
    _fs: Any = None

    def url(self, key: str = "") -> str:
        """`s3://<bucket>/<key>`."""
        return f"s3://{self.bucket}/{key.strip('/')}".rstrip("/")

    def filesystem(self) -> Any:
        """An s3fs filesystem on this server that caches no listing (one per server: making one takes a second)."""
        import s3fs

        if self._fs is None:
            self._fs = s3fs.S3FileSystem(
                key=self.env["AWS_ACCESS_KEY_ID"],
                secret=self.env["AWS_SECRET_ACCESS_KEY"],
                endpoint_url=self.endpoint,
                skip_instance_cache=True,
                use_listings_cache=False,
            )
        return self._fs


@contextlib.contextmanager
def s3_server(bucket: str = "cadence", *, timeout: float = 60.0) -> Iterator[S3Server]:
    """Start moto's S3 server on a free port of 127.0.0.1 with `bucket`, set the client environment, stop it at exit.

    Raises RuntimeError when the packages are missing (`missing()`) or the server does not start in `timeout` s.
    """
    problem = missing()
    if problem is not None:
        raise RuntimeError(f"the local S3 server {problem}")
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert process.stdout is not None
        line = _read_port(process, timeout)
        endpoint = f"http://127.0.0.1:{line}"
        env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
        server = S3Server(endpoint, bucket, env)
        with _environment(env):
            _clear_instances()
            fs = server.filesystem()
            fs.mkdir(bucket)
            yield server
            _clear_instances()
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _read_port(process: subprocess.Popen[bytes], timeout: float) -> int:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    os.set_blocking(process.stdout.fileno(), False)
    text = b""
    while time.monotonic() < deadline:
        chunk = process.stdout.read()
        if chunk:
            text += chunk
        if text.endswith(b"\n"):
            return int(text.strip())
        if process.poll() is not None:
            raise RuntimeError(f"the local S3 server exited with status {process.returncode} before it started")
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"the local S3 server did not start in {timeout:.0f} s")


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _clear_instances() -> None:
    """Forget cached s3fs filesystems: one made for an earlier server would talk to a dead endpoint."""
    with contextlib.suppress(ImportError):
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
