"""The local S3 server (moto on 127.0.0.1) for the object-storage tests: one per session, started on first use."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

from cadence.testing import s3


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3.S3Server]:
    """The server; the object stores' staging and cache folders (under the temp folder) go to pytest's own."""
    problem = s3.missing()
    if problem is not None:
        pytest.skip(f"object-storage tests: the local S3 server {problem}")
    scratch = tmp_path_factory.mktemp("object-scratch")
    before, tempfile.tempdir = tempfile.tempdir, str(scratch)
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(scratch)  # and the training processes the tests start
    try:
        with s3.s3_server() as server:
            yield server
    finally:
        tempfile.tempdir = before
        if previous is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = previous
