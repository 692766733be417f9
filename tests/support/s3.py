"""A real S3 API on this machine for the tests of runs and data in a bucket: moto's server on a
free port holding the bucket ``runs`` (module-scoped: one server per test module that uses it), a
fresh prefix in that bucket for each test as a URI pyarrow and Ray Train open, and the objects
under a URI as the tests list them back."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pyarrow.fs as pafs
import pytest


# A real S3 API on this machine: moto's server on a free port, with a bucket.
@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    """The endpoint (``host:port``) of a moto S3 server holding the bucket ``runs``."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"{host}:{port}"
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1")
    client.create_bucket(Bucket="runs")
    yield endpoint
    server.stop()


@pytest.fixture
def s3_root(s3_server: str) -> str:
    """A fresh prefix in the bucket, as a URI pyarrow (and Ray Train) open with the endpoint."""
    return f"s3://runs/{uuid.uuid4().hex[:8]}?endpoint_override={s3_server}&scheme=http&region=us-east-1"


def files_under(uri: str) -> dict[str, int]:
    """Every object under ``uri``: path relative to it -> size."""
    fs, root = pafs.FileSystem.from_uri(uri)
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    return {i.path[len(root) + 1 :]: i.size for i in infos if i.type == pafs.FileType.File}
