"""Stale-checkpoint detection on the coordinator: only "nothing changed" warns."""

import logging

from megatron_async.integrity.staleness import ChangeReport, judge_staleness
from megatron_async.saver.finalize import CommittedSave, PreviousSave


def _digests(**items):
    return [((fqn, (0,)), digest) for fqn, digest in items.items()]


def _record(previous, checkpoint, digests):
    """Compare, judge and keep one save of a job of one rank, as the finalization does."""
    digests = dict(digests)
    comparison = previous.compare(digests)
    report = ChangeReport.from_counts(comparison.counts(), 1, comparison.previous_checkpoint)
    judge_staleness(checkpoint, report)
    previous.last = CommittedSave(checkpoint, digests, None)
    return report


def test_the_first_save_has_nothing_to_compare():
    report = _record(PreviousSave(), "/ckpt/iter_1", _digests(a="1", b="2"))
    assert (report.items, report.previous_checkpoint, report.is_stale) == (2, None, False)
    assert "first save" in report.summary()


def test_frozen_items_are_counted_without_a_warning(caplog):
    history = PreviousSave()
    _record(history, "/ckpt/iter_1", _digests(frozen="1", trained="2"))
    with caplog.at_level(logging.WARNING, logger="megatron_async.integrity.staleness"):
        report = _record(history, "/ckpt/iter_2", _digests(frozen="1", trained="3", new="4"))
    assert (report.changed, report.is_stale) == (2, False)  # "trained" changed, "new" was added
    assert report.summary() == "2 of 3 items changed since the previous save"
    assert not caplog.records


def test_nothing_changed_warns_naming_both_checkpoints(caplog):
    history = PreviousSave()
    _record(history, "/ckpt/iter_1", _digests(a="1", b="2"))
    with caplog.at_level(logging.WARNING, logger="megatron_async.integrity.staleness"):
        report = _record(history, "/ckpt/iter_2", _digests(a="1", b="2"))
    assert report.is_stale and report.summary() == "0 of 2 items changed since the previous save"
    assert "/ckpt/iter_2" in caplog.text and "/ckpt/iter_1" in caplog.text


def test_an_overwrite_of_the_same_checkpoint_is_not_stale(caplog):
    history = PreviousSave()
    _record(history, "/ckpt/iter_1", _digests(a="1"))
    with caplog.at_level(logging.WARNING, logger="megatron_async.integrity.staleness"):
        _record(history, "/ckpt/iter_1", _digests(a="1"))
    assert not caplog.records
