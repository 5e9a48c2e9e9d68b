"""Test-wide fixtures."""

import pytest


@pytest.fixture(autouse=True)
def _process_saves_not_stopped():
    """A test that leaves a file-system step behind stops its process's saves for good (the
    rule users get: restart the job); the next test starts as a fresh job would."""
    from megatron_async.core.save_directories import SaveDirectories

    yield
    SaveDirectories.of_process()._stuck = None
