"""Async saves to object storage on a loopback S3 endpoint (2 ranks, one launch).

The endpoint is moto's S3 server on 127.0.0.1 (see tests/object_store.py for why not
radosgw); the scenarios are in scenarios_object_store.py.
"""

import os

import pytest

from tests.functional import scenarios_object_store
from tests.functional.harness import assert_scenario_ok, launch, selected_scenarios
from tests.object_store import (
    LOOPBACK,
    FaultyProxy,
    LoopbackS3Server,
    object_store_skip_reason,
    s3_client,
    write_msc_config,
)

SCENARIOS = list(scenarios_object_store.SCENARIOS)
BUCKET = "checkpoints"

pytestmark = pytest.mark.skipif(object_store_skip_reason() is not None, reason=str(object_store_skip_reason()))


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("object_store")
    server = LoopbackS3Server(str(tmp / "moto.log")).start()
    auth_server = LoopbackS3Server(str(tmp / "moto-auth.log"), enforce_auth=True).start()
    proxies = [
        FaultyProxy(server.port, 1 << 20, fault)
        for fault in ("drop", "drop", "silent", "silent", "drip", "drip")
    ]
    try:
        s3_client(server.endpoint).create_bucket(Bucket=BUCKET)
        profiles = {
            "loopback": {"endpoint": server.endpoint, "bucket": BUCKET},
            "dropping_False": {"endpoint": proxies[0].endpoint, "bucket": BUCKET},
            "dropping_True": {"endpoint": proxies[1].endpoint, "bucket": BUCKET},
            "silent_False": {"endpoint": proxies[2].endpoint, "bucket": BUCKET},
            "silent_True": {"endpoint": proxies[3].endpoint, "bucket": BUCKET},
            "drip_False": {"endpoint": proxies[4].endpoint, "bucket": BUCKET},
            "drip_True": {"endpoint": proxies[5].endpoint, "bucket": BUCKET},
            "down": {"endpoint": f"http://{LOOPBACK}:{_closed_port()}", "bucket": BUCKET},
            "badauth": {"endpoint": auth_server.endpoint, "bucket": BUCKET},
            "nobucket": {"endpoint": server.endpoint, "bucket": "no-such-bucket"},
        }
        config = write_msc_config(str(tmp / "msc_config.json"), profiles)
        yield {"server": server, "config": config, "tmp": str(tmp), "proxies": proxies}
    finally:
        for proxy in proxies:
            proxy.close()
        auth_server.stop()
        server.stop()


@pytest.fixture(scope="module")
def launch_results(request, store):
    only = selected_scenarios(request)
    options = {"profile": "loopback", "run": "run1"}
    if only is not None:
        options["only"] = only
    return launch(
        "tests.functional.scenarios_object_store:run_all",
        2,
        store["tmp"],
        timeout_s=420,
        options=options,
        env={"MSC_CONFIG": store["config"]},
    )


@pytest.mark.timeout(480)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_object_store(launch_results, store, scenario):
    assert_scenario_ok(launch_results, scenario)
    faults = {"server_stopped_mid_upload": 0, "store_stops_answering": 2, "store_drips_bytes": 4}
    for name, first in faults.items():
        if scenario.startswith(name):
            proxy = store["proxies"][first + int("persistent" in scenario)]
            assert proxy.triggered, "the proxy never saw an upload large enough to fail it"
