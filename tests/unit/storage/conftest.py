"""One loopback S3 endpoint for every object-storage unit test (test process side).

The ``store`` fixture starts moto's S3 server on 127.0.0.1 once per session, creates
the bucket :data:`BUCKET`, points ``MSC_CONFIG`` at the profiles ``unit`` (that bucket)
and ``unit_nobucket`` (a bucket that does not exist), and yields a boto3 client of the
server. It skips, naming the missing package, where the server cannot run.
"""

import os

import pytest

from tests.object_store import LoopbackS3Server, object_store_skip_reason, s3_client, write_msc_config

BUCKET = "unit"


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    reason = object_store_skip_reason()
    if reason is not None:
        pytest.skip(reason)
    tmp = tmp_path_factory.mktemp("store")
    server = LoopbackS3Server(str(tmp / "moto.log")).start()
    old = os.environ.get("MSC_CONFIG")
    try:
        client = s3_client(server.endpoint)
        client.create_bucket(Bucket=BUCKET)
        os.environ["MSC_CONFIG"] = write_msc_config(
            str(tmp / "msc.json"),
            {
                "unit": {"endpoint": server.endpoint, "bucket": BUCKET},
                "unit_nobucket": {"endpoint": server.endpoint, "bucket": "missing"},
            },
        )
        yield client
    finally:
        if old is None:
            os.environ.pop("MSC_CONFIG", None)
        else:
            os.environ["MSC_CONFIG"] = old
        server.stop()
