"""CheckpointManager, the save-directory functions and ``list`` on ``msc://`` URLs.

Single process against the loopback S3 endpoint (``store`` in conftest.py): the manager's
collectives reduce to local calls, so these tests drive the coordinator-rank logic of
tracker, resume and retention on an object store directly.
"""

import json
import uuid

import pytest

from megatron_async import checkpoint_dirs, cli
from megatron_async.errors import AsyncSaveFailedError, CheckpointValidationError, ObjectStoreError
from megatron_async.format import COMPLETION_MARKERS
from megatron_async.manager import CheckpointManager, CheckpointManagerConfig
from megatron_async.storage import storage_for
from tests.unit.storage.conftest import BUCKET

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def save_url(store):
    """A fresh ``msc://`` save directory and its key prefix in the bucket."""
    run = f"runs/{uuid.uuid4().hex[:8]}"
    return f"msc://unit/{run}", run


def put_checkpoint(save_url, iteration, complete=True):
    """PUT a shard object and, if complete, both completion markers."""
    path = f"{save_url}/{checkpoint_dirs.checkpoint_dir_name(iteration)}"
    storage = storage_for(path)
    storage.write_atomically(f"{path}/__0_0.distcp", b"shard")
    if complete:
        for marker in COMPLETION_MARKERS:
            storage.write_atomically(f"{path}/{marker}", b"{}")
    return path


def keys_under(store, prefix):
    listing = store.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    return sorted(item["Key"][len(prefix) + 1:] for item in listing.get("Contents", []))


def test_listing_and_tracker_on_a_url(store, save_url):
    url, _ = save_url
    assert checkpoint_dirs.list_checkpoints(url) == []
    assert checkpoint_dirs.read_tracker(url) is None
    put_checkpoint(url, 10)
    put_checkpoint(url, 20, complete=False)
    checkpoint_dirs.write_tracker(url, 10)
    assert checkpoint_dirs.read_tracker(url) == 10
    assert [(c.iteration, c.complete) for c in checkpoint_dirs.list_checkpoints(url)] == [
        (10, True), (20, False)]
    assert checkpoint_dirs.list_checkpoints(url)[0].path == f"{url}/iter_0000010"


def test_list_command_on_a_url(store, save_url, capsys):
    url, _ = save_url
    put_checkpoint(url, 1)
    put_checkpoint(url, 2, complete=False)
    checkpoint_dirs.write_tracker(url, 1)
    assert cli.main(["list", url, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["tracker_iteration"] == 1
    assert [(c["iteration"], c["complete"], c["tracked"]) for c in listing["checkpoints"]] == [
        (1, True, True), (2, False, False)]
    assert cli.main(["list", url]) == 0
    text = capsys.readouterr().out
    assert "iter         1  complete" in text and "<- tracker" in text and "INCOMPLETE" in text


def test_list_command_on_an_unreadable_store_says_why(store, capsys):
    assert cli.main(["list", "msc://unit_nobucket/runs"]) == 2
    error = capsys.readouterr().err
    assert "msc://unit_nobucket/runs" in error and "NoSuchBucket" in error and "MSC_CONFIG" in error


def test_construction_refuses_a_store_it_cannot_write(store):
    url = "msc://unit_nobucket/runs"
    with pytest.raises(CheckpointValidationError, match="is not writable") as caught:
        CheckpointManager(CheckpointManagerConfig(save_dir=url))
    assert f"save directory {url}" in str(caught.value) and "NoSuchBucket" in str(caught.value)


def test_commit_moves_the_tracker_only_for_a_complete_checkpoint(store, save_url):
    url, prefix = save_url
    manager = CheckpointManager(CheckpointManagerConfig(save_dir=url, load_dir=url))
    path = manager.prepare_save(2)
    assert path == f"{url}/iter_0000002"
    assert keys_under(store, prefix) == []  # an object store needs no directory
    put_checkpoint(url, 2)
    manager.commit(2)
    assert checkpoint_dirs.read_tracker(url) == 2
    manager.prepare_save(4)
    put_checkpoint(url, 4, complete=False)
    with pytest.raises(AsyncSaveFailedError, match="missing"):
        manager.commit(4)
    assert checkpoint_dirs.read_tracker(url) == 2
    assert manager.find_resume_point().iteration == 2


def test_resume_never_picks_an_incomplete_checkpoint(store, save_url):
    url, _ = save_url
    put_checkpoint(url, 3)
    put_checkpoint(url, 6)
    put_checkpoint(url, 9, complete=False)
    manager = CheckpointManager(CheckpointManagerConfig(load_dir=url))
    point = manager.find_resume_point()
    assert (point.iteration, point.reason) == (6, "newest complete")
    checkpoint_dirs.write_tracker(url, 9)  # a tracker ahead of its checkpoint's markers
    point = manager.find_resume_point()
    assert (point.iteration, point.path, point.reason) == (6, f"{url}/iter_0000006", "newest complete")
    checkpoint_dirs.write_tracker(url, 3)
    assert manager.find_resume_point().reason == "tracker"
    assert manager.find_resume_point(6).path == f"{url}/iter_0000006"


def test_retention_deletes_every_object_of_old_checkpoints(store, save_url):
    url, prefix = save_url
    manager = CheckpointManager(CheckpointManagerConfig(save_dir=url, keep_last_n=2))
    put_checkpoint(url, 1, complete=False)  # remains of a killed save
    for iteration in (2, 4, 6):
        manager.prepare_save(iteration)
        put_checkpoint(url, iteration)
        manager.commit(iteration)
    manager.prepare_save(8)
    put_checkpoint(url, 8, complete=False)  # still being written: left alone
    assert sorted({key.split("/")[0] for key in keys_under(store, prefix)}) == [
        "iter_0000004", "iter_0000006", "iter_0000008", "latest_checkpointed_iteration.txt"]
    assert keys_under(store, f"{prefix}/iter_0000002") == []
    assert checkpoint_dirs.read_tracker(url) == 6


def test_prepare_save_deletes_the_remains_of_an_earlier_save(store, save_url):
    url, prefix = save_url
    put_checkpoint(url, 5, complete=False)
    CheckpointManager(CheckpointManagerConfig(save_dir=url)).prepare_save(5)
    assert keys_under(store, f"{prefix}/iter_0000005") == []


def test_an_interrupted_deletion_leaves_an_incomplete_checkpoint(store, save_url, monkeypatch):
    """Markers go first: when the data objects cannot be deleted, the checkpoint reads
    as incomplete (no resume picks it) and deletion reports the failure."""
    url, prefix = save_url
    path = put_checkpoint(url, 7)
    from megatron_async.storage import objects

    bounded = objects.call_with_deadline

    def store_fails_under(what, url, call, *args):
        if what == "deleting" and url == path:  # the data objects, after the markers
            raise ObjectStoreError(f"deleting {url} failed: the store went away")
        return bounded(what, url, call, *args)

    monkeypatch.setattr(objects, "call_with_deadline", store_fails_under)
    assert not checkpoint_dirs.delete_checkpoint_dir(path)
    assert not checkpoint_dirs.is_complete_checkpoint(path)
    assert keys_under(store, f"{prefix}/iter_0000007") == ["__0_0.distcp"]
    assert CheckpointManager(CheckpointManagerConfig(load_dir=url)).find_resume_point() is None
