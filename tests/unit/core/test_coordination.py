"""torchrun's ``LOCAL_WORLD_SIZE`` as the library reads it (``core/coordination.py``)."""

import pytest

from megatron_async.core import coordination


@pytest.mark.parametrize(
    "value, expected",
    [("8", 8), (" 2 ", 2), (None, 1), ("", 1), ("eight", 1), ("2.5", 1), ("0", 1), ("-3", 1)],
)
def test_local_world_size_is_torchruns_or_one_and_never_raises(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert coordination.local_world_size() == expected

