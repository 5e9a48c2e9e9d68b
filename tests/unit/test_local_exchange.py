"""megatron_async.local.part_replication: background writers replicate their parts to
clique peers while they write them.

Each rank is a forked process that writes its own part, streamed to its peers through a
TCPStore whose master lives in the test process; no process group is initialized.
"""

import dataclasses
import multiprocessing
import os
import pickle
import random
import socket
import sys
import threading
import time
from queue import Empty

import pytest
import torch.distributed as dist

from megatron_async.errors import LocalCheckpointError, LocalReplicationError
from megatron_async.local.cliques import CliqueReplicationStrategy
from megatron_async.local import transport
from megatron_async.local.exchange import ForgetPublishedKey, PeerExchange
from megatron_async.local.part_replication import PartReplication
from megatron_async.local.transport import LOCAL_ADDR_ENV, store_address
from megatron_async.local.parts import LocalIdentity, holder_dir, scan
from tests.local_parts_aids import read_verified, write_part

ITERATION = 30
SESSION = "s"
PREFIX = f"megatron_async/local/{SESSION}/{ITERATION}"
FAULT_TIMEOUT_S = 3.0
"""The exchange deadline of the fault tests: the survivors fail this soon."""


def _part(rank, num_bytes):
    """A rank's part as three buffers of different kinds (bytes, bytearray, memoryview)."""
    data = random.Random(rank).randbytes(num_bytes)
    return [data[:100], bytearray(data[100:-7]), memoryview(data[-7:])]


def _failing_after_a_chunk(buffers):
    """The part's buffers, but the write fails once more than one chunk went out."""
    yield b"".join(bytes(b) for b in buffers)[: (8 << 20) + 5]
    raise OSError(28, "No space left on device")


def _replicate(spec, rank, identity, directory, buffers):
    """Write the part with its replication, as the background writer does."""
    with PartReplication(spec, rank, ITERATION, identity) as replication:
        try:
            write_part(directory, ITERATION, rank, buffers, identity, replication=replication)
        except Exception as exc:
            replication.fail(f"{type(exc).__name__}: {exc}")
            raise
        return replication.finish()


def _rank(rank, world, factor, port, root, timeout_s, size, behaviour, queue):
    """One rank's background writer: write the own part, replicated (forked child)."""
    try:
        identity = LocalIdentity(world_size=world, replication_jump=2, replication_factor=factor)
        peers = CliqueReplicationStrategy.from_replication_params(
            2, factor, world_size=world, rank=rank
        ).peers(rank)
        directory = holder_dir(root, SESSION, rank)
        buffers = _part(rank, size)
        if behaviour == "never publishes":
            time.sleep(timeout_s + 2)
            return
        if behaviour == "its own part failed":
            transport.publish_failure("127.0.0.1", port, f"{PREFIX}/{rank}", "OSError: disk full")
            return
        if behaviour == "dies after publishing":
            client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
            client.set(f"{PREFIX}/{rank}", _REFUSING_ADDRESS)
            os._exit(0)
        if behaviour == "dies mid-send":  # to rank 0: the header and half of a frame
            client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
            host, _, peer_port = client.get(f"{PREFIX}/0").decode().rpartition(":")
            sock = socket.create_connection((host, int(peer_port)))
            header = dict(session_id=SESSION, iteration=ITERATION, owner=rank, receiver=0,
                          identity=dataclasses.asdict(identity))
            transport.send_message(sock, header)
            sock.sendall(size.to_bytes(8, "big") + bytes(buffers[0]) + bytes(buffers[1][: size // 2]))
            os._exit(0)
        if behaviour == "cannot listen":

            def no_port(advertised, backlog):
                raise OSError(98, "no port to listen on")

            transport.listen = no_port  # this forked rank's module only
        if behaviour == "dies before acking":  # after rank 0's part came, before sending its own
            transport.connect_published = lambda *args: time.sleep(timeout_s + 2)

            def die_at_the_ack(sock, message):
                if message == {"ok": True}:
                    os._exit(0)

            transport.send_message = die_at_the_ack
        if behaviour == "connects slowly":  # 1 s between reading an address and connecting
            create_connection = transport.socket.create_connection
            transport.socket.create_connection = (
                lambda *args, **kwargs: time.sleep(1.0) or create_connection(*args, **kwargs)
            )
        if behaviour == "damages its part":  # on its way: one byte flipped in what is sent
            send_frame = transport.send_frame

            def send_damaged(sock, data):
                data = bytearray(memoryview(data).cast("B"))
                if data:
                    data[0] ^= 0xFF
                send_frame(sock, data)

            transport.send_frame = send_damaged  # this forked rank's module only
        if behaviour == "fails mid-write":
            buffers = _failing_after_a_chunk(buffers)
        spec = PeerExchange(
            store_host="127.0.0.1", store_port=port, key_prefix=PREFIX, session_id=SESSION,
            peers=peers, directory=directory, timeout_s=timeout_s,
        )
        if behaviour == "fails after publishing":  # and closes before its peer connects
            with PartReplication(spec, rank, ITERATION, identity) as replication:
                time.sleep(0.5)
                replication.fail("OSError: disk full")
            return
        start = time.monotonic()
        try:
            replicas = _replicate(spec, rank, identity, directory, buffers)
        except LocalReplicationError as exc:
            queue.put((rank, "failed", str(exc), exc.failures, time.monotonic() - start))
        else:
            queue.put((rank, "ok", [r.key for r in replicas], {}, time.monotonic() - start))
    except BaseException as exc:
        queue.put((rank, "crashed", repr(exc), {}, 0.0))


_REFUSING_ADDRESS = None
"""``ip:port`` of a socket the test holds bound but not listening: it refuses every
connection, and no other process can take its port meanwhile."""


@pytest.fixture
def refusing_address(monkeypatch):
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{bound.getsockname()[1]}"
        monkeypatch.setattr(sys.modules[__name__], "_REFUSING_ADDRESS", address)
        yield _REFUSING_ADDRESS


@pytest.fixture
def store():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield master


_SILENT = (
    "never publishes", "dies after publishing", "dies mid-send", "its own part failed",
    "dies before acking", "fails after publishing",
)
"""Behaviours of ranks that report nothing."""


def _run(store, root, world, factor=2, timeout_s=30.0, size=(5 << 20) + 3, behaviours=None):
    """Run ``world`` ranks; returns rank -> (outcome, text, failures, elapsed_s) of those
    that report (a rank that dies or never publishes reports nothing)."""
    behaviours = behaviours or {}
    silent = {r for r, b in behaviours.items() if b in _SILENT}
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    processes = [
        context.Process(
            target=_rank,
            args=(r, world, factor, store.port, str(root), timeout_s, size, behaviours.get(r),
                  queue),
        )
        for r in range(world)
    ]
    for process in processes:
        process.start()
    try:
        results = {}
        for _ in range(world - len(silent)):
            try:
                rank, *outcome = queue.get(timeout=timeout_s + 30)
            except Empty:
                missing = sorted(set(range(world)) - silent - set(results))
                raise AssertionError(f"ranks {missing} did not report; got {results}") from None
            results[rank] = tuple(outcome)
    finally:
        for process in processes:
            process.join(timeout_s + 10)
            if process.is_alive():
                process.kill()
    return results


def _assert_holds_verified(root, holder, owners, size):
    directory = holder_dir(root, SESSION, holder)
    records = scan(directory)
    assert [r.key for r in records] == [(ITERATION, o) for o in sorted(owners)]
    for record in records:
        expected = b"".join(bytes(b) for b in _part(record.owner, size))
        assert read_verified(directory, record) == expected
    assert not [n for n in os.listdir(directory) if "dirty" in n]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world, factor", [(4, 2), (6, 3)])
def test_every_holder_keeps_its_part_and_its_peers_verified(store, tmp_path, world, factor):
    size = (17 << 20) + 3 if factor == 2 else (1 << 20) + 5  # 3 chunks, or 1
    results = _run(store, tmp_path, world, factor, size=size)
    cliques = [tuple(range(m, world, 2)) for m in (0, 1)]  # J=2: the even and the odd ranks
    for rank in range(world):
        clique = next(c for c in cliques if rank in c)
        assert results[rank][:2] == ("ok", [(ITERATION, p) for p in clique if p != rank])
        _assert_holds_verified(tmp_path, rank, clique, size)
    assert not any(store.check([f"{PREFIX}/{r}"]) for r in range(world))  # keys deleted


@pytest.mark.timeout(60)
def test_a_peer_that_never_publishes_fails_its_clique_within_one_bound(store, tmp_path):
    results = _run(
        store, tmp_path, 4, timeout_s=FAULT_TIMEOUT_S, size=1000,
        behaviours={2: "never publishes"},
    )
    outcome, text, failures, elapsed_s = results[0]
    assert outcome == "failed" and set(failures) == {2}, text
    what = f"waiting for it to publish its address under '{PREFIX}/2'"
    assert f"rank 2: timed out after {FAULT_TIMEOUT_S:g} s {what}" in text
    assert f"rank 2: it did not connect within {FAULT_TIMEOUT_S:g} s" in text
    assert FAULT_TIMEOUT_S <= elapsed_s < FAULT_TIMEOUT_S + 1.5  # one bound, not two
    assert results[1][0] == results[3][0] == "ok"  # the other clique is not held up
    assert [r.key for r in scan(holder_dir(tmp_path, SESSION, 0))] == [(ITERATION, 0)]
    assert not store.check([f"{PREFIX}/0"])


@pytest.mark.timeout(60)
def test_a_peer_whose_address_refuses_fails_its_clique_at_once(store, tmp_path, refusing_address):
    # Its exchange is over (it died after publishing): keys name one save of one job, so
    # a refusing address is never an earlier attempt's to be read again.
    deadline_s = 30.0
    results = _run(store, tmp_path, 4, timeout_s=deadline_s, size=1000,
                   behaviours={2: "dies after publishing"})
    outcome, text, failures, elapsed_s = results[0]
    assert outcome == "failed" and set(failures) == {2}, text
    assert failures[2][0].startswith(f"cannot connect to it at {refusing_address}"), text
    assert "its exchange is over" in failures[2][0]
    assert elapsed_s < deadline_s / 2
    assert results[1][0] == results[3][0] == "ok"


def _run_with_faulty_rank_2(store, root, behaviour, timeout_s=FAULT_TIMEOUT_S):
    """4 ranks, small parts, the fault tests' deadline; rank 2 plays ``behaviour``."""
    return _run(store, root, 4, timeout_s=timeout_s, size=1000, behaviours={2: behaviour})


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "behaviour, reason",
    [
        ("its own part failed", "OSError: disk full"),
        (
            "cannot listen",
            "cannot listen for its peers or publish its address: [Errno 98] no port to listen on",
        ),
    ],
)
def test_a_peer_that_fails_before_its_exchange_fails_its_clique_at_once(
    store, tmp_path, behaviour, reason
):
    deadline_s = 30.0  # far above the time a busy machine takes to start the ranks
    results = _run_with_faulty_rank_2(store, tmp_path, behaviour, deadline_s)
    outcome, text, failures, elapsed_s = results[0]
    assert outcome == "failed" and set(failures) == {2}, text
    assert failures[2] == [f"its own part failed ({reason})"] * 2  # both ways
    assert elapsed_s < deadline_s  # it did not wait for the deadline
    assert results[1][0] == results[3][0] == "ok"


@pytest.mark.timeout(90)
def test_a_peer_whose_part_failed_and_whose_exchange_is_over_is_reported_by_its_failure(
    store, tmp_path
):
    # Rank 0 reads rank 2's address; rank 2 then fails, publishes why and closes its
    # listener before rank 0 connects: the refused address's key is read again, and the
    # reason is the failure it published, not a closed port.
    deadline_s = 30.0
    results = _run(store, tmp_path, 4, timeout_s=deadline_s, size=1000,
                   behaviours={2: "fails after publishing", 0: "connects slowly"})
    outcome, text, failures, elapsed_s = results[0]
    assert outcome == "failed" and set(failures) == {2}, text
    assert failures[2] == ["its own part failed (OSError: disk full)"] * 2, text
    assert elapsed_s < deadline_s / 2
    assert results[1][0] == results[3][0] == "ok"


@pytest.mark.timeout(60)
def test_a_peer_that_dies_mid_transfer_leaves_no_replica_and_fails_its_receiver(store, tmp_path):
    results = _run_with_faulty_rank_2(store, tmp_path, "dies mid-send")
    outcome, text, failures, elapsed_s = results[0]
    assert outcome == "failed" and set(failures) == {2}, text
    assert "rank 2: receiving its part failed: PeerLost: " in text and "of 1000 bytes" in text
    assert elapsed_s < FAULT_TIMEOUT_S + 5
    directory = holder_dir(tmp_path, SESSION, 0)
    assert sorted(os.listdir(directory)) == ["iter_0000030_0_local.json", "iter_0000030_0_local.pt"]


@pytest.mark.timeout(90)
def test_a_part_that_fails_while_it_streams_leaves_no_replica_and_fails_its_clique_at_once(
    store, tmp_path
):
    deadline_s = 30.0
    size = (9 << 20) + 3  # a chunk goes out before the write fails
    results = _run(store, tmp_path, 4, timeout_s=deadline_s, size=size,
                   behaviours={2: "fails mid-write"})
    outcome, text, failures, elapsed_s = results[0]
    assert outcome == "failed" and set(failures) == {2}, text
    assert "rank 2: its own part failed (StorageWriteError: cannot write rank 2's" in text
    assert "No space left on device" in text
    assert elapsed_s < deadline_s  # it did not wait for the deadline
    assert results[2][0] == "crashed" and "StorageWriteError" in results[2][1]
    directory = holder_dir(tmp_path, SESSION, 0)  # rank 2's partial replica is gone
    assert sorted(os.listdir(directory)) == ["iter_0000030_0_local.json", "iter_0000030_0_local.pt"]
    left = os.listdir(holder_dir(tmp_path, SESSION, 2))  # nor its own part, nor a dirty file
    assert not [name for name in left if "_2_local" in name or "dirty" in name], left
    assert results[1][0] == results[3][0] == "ok"


@pytest.mark.timeout(90)
def test_a_peer_that_dies_before_sending_its_part_fails_its_clique_at_once(store, tmp_path):
    deadline_s = 30.0
    results = _run_with_faulty_rank_2(store, tmp_path, "dies before acking", deadline_s)
    outcome, text, failures, elapsed_s = results[0]
    assert outcome == "failed" and set(failures) == {2}, text
    assert "rank 2: no acknowledgement of rank 0's part" in text
    assert "rank 2: it went away before sending its part" in text
    assert elapsed_s < deadline_s  # it did not wait for the deadline
    assert results[1][0] == results[3][0] == "ok"


@pytest.mark.timeout(60)
def test_a_replica_that_does_not_match_its_digest_is_refused_and_both_sides_fail(store, tmp_path):
    results = _run_with_faulty_rank_2(store, tmp_path, "damages its part")
    outcome, text, failures, _ = results[0]
    assert outcome == "failed" and set(failures) == {2}, text
    assert "rank 2: its part was refused: replica of rank 2's part of iteration 30" in text
    assert "damaged on its way" in text
    outcome, text, failures, _ = results[2]
    assert outcome == "failed" and set(failures) == {0}, text
    assert "rank 0: it refused rank 2's part: replica of rank 2's part" in text
    # the receiver kept no record (nor bytes) of the damaged replica; rank 2 got rank 0's
    directory = holder_dir(tmp_path, SESSION, 0)
    assert [r.key for r in scan(directory)] == [(ITERATION, 0)]
    assert sorted(os.listdir(directory)) == ["iter_0000030_0_local.json", "iter_0000030_0_local.pt"]
    _assert_holds_verified(tmp_path, 2, (0, 2), 1000)
    assert results[1][0] == results[3][0] == "ok"


def test_the_store_address_is_found_behind_prefix_stores(store):
    wrapped = dist.PrefixStore("outer", dist.PrefixStore("default_pg", store))
    assert store_address(wrapped) == ("127.0.0.1", store.port)
    assert store_address(dist.HashStore()) is None
    expected = "needs the job's TCPStore, but there is a HashStore"
    with pytest.raises(LocalCheckpointError, match=expected):
        store_address(dist.HashStore(), required=True)
    if not dist.is_initialized():
        assert store_address() is None
        with pytest.raises(LocalCheckpointError, match="there is no process group.*torchrun"):
            store_address(required=True)


def test_the_advertised_address_is_the_route_to_the_store_or_the_configured_one(monkeypatch):
    monkeypatch.delenv(LOCAL_ADDR_ENV, raising=False)
    assert transport.advertised_address("localhost", 29500) == "127.0.0.1"
    monkeypatch.setenv(LOCAL_ADDR_ENV, "10.1.2.3")
    assert transport.advertised_address("localhost", 29500) == "10.1.2.3"


@pytest.mark.timeout(60)
def test_a_process_reuses_its_store_client_and_a_forked_writer_makes_its_own(store):
    client = transport.store_client("127.0.0.1", store.port, 5.0)
    assert transport.store_client("127.0.0.1", store.port, 5.0) is client
    clients = transport.StoreClients.of_process()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()

    def child():
        own = transport.store_client("127.0.0.1", store.port, 5.0)
        own.set("from the child", "yes")
        queue.put(own is not client and transport.StoreClients.of_process() is not clients)

    process = context.Process(target=child)
    process.start()
    assert queue.get(timeout=30) is True
    process.join(30)
    assert client.get("from the child") == b"yes"


def test_the_exchange_options_pickle_and_are_checked():
    spec = PeerExchange(
        store_host="h", store_port=1, key_prefix="p", session_id="", peers=(2,), directory="d",
        timeout_s=5.0,
    )
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(LocalCheckpointError, match="timeout_s > 0"):
        PeerExchange(
            store_host="h", store_port=1, key_prefix="p", session_id="", peers=(2,),
            directory="d", timeout_s=0,
        )
    error = pickle.loads(pickle.dumps(LocalReplicationError("m", {2: ["what"]})))
    assert (str(error), error.failures) == ("m", {2: ["what"]})


@pytest.mark.timeout(60)
def test_a_strangers_connection_does_not_disturb_the_exchange(store, tmp_path):
    """Two ranks as threads of this process; something else connects to rank 0 first."""
    identity = LocalIdentity(world_size=2, replication_jump=1, replication_factor=2)
    outcomes = {}

    def rank(me, delay_s):
        time.sleep(delay_s)
        directory = holder_dir(tmp_path, SESSION, me)
        spec = PeerExchange(
            store_host="127.0.0.1", store_port=store.port, key_prefix=PREFIX,
            session_id=SESSION, peers=(1 - me,), directory=directory, timeout_s=30.0,
        )
        replicas = _replicate(spec, me, identity, directory, _part(me, 1000))
        outcomes[me] = [r.key for r in replicas]

    threads = [threading.Thread(target=rank, args=(me, me * 1.0)) for me in (0, 1)]
    threads[0].start()
    store.wait([f"{PREFIX}/0"])
    host, _, port = store.get(f"{PREFIX}/0").decode().rpartition(":")
    with socket.create_connection((host, int(port))) as stranger:
        stranger.sendall(b"GET / HTTP/1.0\r\n\r\n")
        threads[1].start()
        for thread in threads:
            thread.join(40)
    assert outcomes == {0: [(ITERATION, 1)], 1: [(ITERATION, 0)]}
    _assert_holds_verified(tmp_path, 0, (0, 1), 1000)


def test_a_long_run_of_failed_saves_leaves_no_keys_in_the_jobs_store(store):
    # Thousands of saves, some failing: each failed writer's reason stays published until
    # the save ended on every rank (its peers stop waiting), then the save's finalize
    # step (finalized or abandoned) deletes it, so the store does not grow with the run.
    baseline = store.num_keys()
    steps = []
    for save in range(1, 201):
        spec = PeerExchange(
            store_host="127.0.0.1", store_port=store.port, key_prefix=f"{PREFIX}/{save}",
            session_id=SESSION, peers=(1,), directory="unused", timeout_s=1.0,
        )
        if save % 3 == 0:  # a failed save: rank 0's writer tells its peer why
            transport.publish_failure("127.0.0.1", store.port, spec.key(0), "OSError: disk full")
            assert store.get(spec.key(0)).decode().startswith(transport.FAILED_PREFIX)
        steps.append((save, ForgetPublishedKey(spec, 0)))
    assert store.num_keys() == baseline + 66
    for save, step in steps:
        step.abandon() if save % 3 == 0 else step()
    assert store.num_keys() == baseline
