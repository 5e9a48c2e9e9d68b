"""Writer options: one validated object, from the strategy's config or the writer's keywords."""

from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_async.errors import CheckpointValidationError
from megatron_async.mcore.config import TorchDistSaveConfig
from megatron_async.writer.filesystem import FileSystemWriterAsync
from megatron_async.writer.options import WriteOptions

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    "options, rule",
    [
        ({"thread_count": 0}, "thread_count must be an int >= 1"),
        ({"thread_count": True}, "thread_count must be an int"),
        ({"thread_count": 2.0}, "thread_count must be an int"),
        ({"separation_hint": ""}, "separation_hint must be a non-empty key prefix"),
        ({"separation_hint": f"a{os.sep}b"}, "separation_hint must be a non-empty key prefix"),
        ({"write_timeout_s": 0}, "write_timeout_s must be a positive"),
        ({"write_timeout_s": "60"}, "write_timeout_s must be a positive"),
    ],
)
def test_every_invalid_option_is_a_validation_error_that_states_the_rule(options, rule):
    with pytest.raises(CheckpointValidationError, match=rule) as info:
        WriteOptions(**options)
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still do


def test_options_are_frozen_and_keyword_only():
    options = WriteOptions(thread_count=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.thread_count = 4
    with pytest.raises(TypeError):
        WriteOptions(3)


def test_the_config_builds_its_writer_options_once_and_validates_through_them():
    config = TorchDistSaveConfig(thread_count=3, separation_hint="optimizer", direct_io=False)
    options = config.write_options
    assert options is config.write_options
    assert (options.thread_count, options.separation_hint, options.direct_io) == (3, "optimizer", False)
    assert options.use_cached_data_structure is True  # the strategy's default, not the writer's
    assert dataclasses.replace(config, thread_count=4).write_options.thread_count == 4
    with pytest.raises(CheckpointValidationError, match="write_timeout_s"):
        TorchDistSaveConfig(write_timeout_s=-1)


def test_the_writer_builds_its_options_from_the_reference_api_keywords(tmp_path):
    writer = FileSystemWriterAsync(
        tmp_path, thread_count=2, sync_files=False, separation_hint="opt", is_multiproc_io=True
    )
    assert writer.options == WriteOptions(
        thread_count=2, sync_files=False, separation_hint="opt", is_multiproc_io=True
    )
    # The reference API's attribute names still read the options.
    assert (writer.thread_count, writer.sync_files, writer.separation_hint) == (2, False, "opt")
    assert writer.is_multiproc_io is True and writer.use_msc is False


def test_the_writer_takes_an_options_object_as_it_is(tmp_path):
    options = WriteOptions(thread_count=4, is_multiproc_io=True)
    writer = FileSystemWriterAsync(tmp_path, options=options)
    assert writer.options is options
    assert (writer.thread_count, writer.is_multiproc_io) == (4, True)
    with pytest.raises(CheckpointValidationError, match="inside options"):
        FileSystemWriterAsync(tmp_path, options=options, thread_count=2)


def test_an_invalid_writer_keyword_is_a_validation_error(tmp_path):
    with pytest.raises(CheckpointValidationError, match="thread_count must be an int >= 1"):
        FileSystemWriterAsync(tmp_path, thread_count=0)


@pytest.mark.parametrize("path", [None, 3, b"/tmp/x"])
def test_a_checkpoint_directory_that_is_no_path_is_a_validation_error(path):
    with pytest.raises(CheckpointValidationError, match="must be a path .* got"):
        FileSystemWriterAsync(path)
