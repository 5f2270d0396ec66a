"""The local S3 server (moto on 127.0.0.1) for the object-storage tests: one per session, started on first use."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cadence.testing import s3


@pytest.fixture(scope="session")
def s3_server() -> Iterator[s3.S3Server]:
    problem = s3.missing()
    if problem is not None:
        pytest.skip(f"object-storage tests: the local S3 server {problem}")
    with s3.s3_server() as server:
        yield server
