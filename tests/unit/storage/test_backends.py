"""The storage contract: one test suite run against every backend.

``storage_for`` picks :class:`LocalStorage` for a path and :class:`ObjectStorage` for an
``msc://`` URL; each test below runs on a fresh local directory and on a fresh prefix of
the loopback S3 endpoint (``store`` in conftest.py), so both backends keep one contract.
"""

import ast
import os
import pathlib
import pickle
import uuid

import pytest

import megatron_async
from megatron_async.checkpoint_dirs import is_complete_checkpoint
from megatron_async.format import COMPLETION_MARKERS, remove_completion_markers
from megatron_async.storage import storage_for
from megatron_async.storage.local import LocalStorage
from megatron_async.storage.objects import ObjectStorage

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["local", "object"])
def root(request, tmp_path):
    """A fresh, empty checkpoint location of each backend (nothing exists under it yet)."""
    if request.param == "local":
        return str(tmp_path / "ckpt")
    request.getfixturevalue("store")
    return f"msc://unit/contract/{uuid.uuid4().hex[:8]}"


def test_the_backend_is_chosen_from_the_path_without_io():
    assert isinstance(storage_for("/no/such/dir"), LocalStorage)
    assert isinstance(storage_for("relative/dir"), LocalStorage)
    assert isinstance(storage_for("msc://profile/prefix"), ObjectStorage)
    assert isinstance(storage_for(pathlib.Path("msc://profile/prefix")), ObjectStorage)
    assert not storage_for("/x").needs_msc and storage_for("msc://p/x").needs_msc


def test_written_files_read_back_whole_and_in_ranges(root):
    storage = storage_for(root)
    path = os.path.join(root, "a.bin")
    assert not storage.is_file(path)
    with pytest.raises(FileNotFoundError):
        storage.read(path)
    storage.make_dir(root)
    storage.write_atomically(path, b"0123456789")
    assert storage.is_file(path) and storage.list_dir(root) == [("a.bin", 10)]
    assert storage.read(path) == b"0123456789"
    assert storage.read_range(path, 3, 4) == b"3456"
    assert storage.read_range(path, 8, 100) == b"89"  # fewer at the end
    storage.write_atomically(path, "é")  # str is UTF-8; an overwrite replaces it whole
    assert storage.read(path) == "é".encode()
    storage.sync(path)
    storage.sync(os.path.join(root, "missing.bin"))  # skipped
    storage.sync_dir(root)


def test_listing_sizes_and_directories(root):
    storage = storage_for(root)
    assert not storage.is_dir(root)
    assert storage.list_dir(root) == []
    storage.make_dir(root)
    storage.write_atomically(os.path.join(root, "b.txt"), b"bb")
    storage.make_dir(os.path.join(root, "iter_0000001"))
    storage.write_atomically(os.path.join(root, "iter_0000001", "x"), b"xyz")
    storage.write_atomically(os.path.join(root, "a.txt"), b"a")
    assert storage.is_dir(root) and storage.is_dir(os.path.join(root, "iter_0000001"))
    assert not storage.is_file(os.path.join(root, "iter_0000001"))
    assert storage.list_dir(root) == [("a.txt", 1), ("b.txt", 2), ("iter_0000001", None)]


def test_a_dangling_link_in_a_save_directory_does_not_break_its_listing(tmp_path):
    # a user's "latest -> iter_..." link whose checkpoint retention deleted
    (tmp_path / "iter_0000001").mkdir()
    os.symlink(tmp_path / "iter_0000000", tmp_path / "latest")
    assert LocalStorage().list_dir(str(tmp_path)) == [("iter_0000001", None), ("latest", 0)]


def test_removal_of_files_and_directories(root):
    storage = storage_for(root)
    directory = os.path.join(root, "iter_0000002")
    storage.make_dir(root)
    storage.make_dir(directory)
    for name in ("__0_0.distcp",) + COMPLETION_MARKERS:
        storage.write_atomically(os.path.join(directory, name), b"{}")
    assert is_complete_checkpoint(directory, storage)
    assert storage.remove(os.path.join(directory, "__0_0.distcp"))
    assert not storage.remove(os.path.join(directory, "__0_0.distcp"))
    assert sorted(remove_completion_markers(directory, storage)) == sorted(COMPLETION_MARKERS)
    assert not is_complete_checkpoint(directory, storage)
    storage.write_atomically(os.path.join(directory, "__0_0.distcp"), b"data")
    storage.remove_dir(directory, first=COMPLETION_MARKERS)
    assert not storage.is_dir(directory)
    assert storage.list_dir(root) == []


def test_a_backend_pickles_to_the_background_writer(root):
    storage = storage_for(root)
    assert type(pickle.loads(pickle.dumps(storage))) is type(storage)


def _runtime_imports(path: str) -> set:
    """The ``megatron_async`` modules ``path`` imports when it is imported (module level,
    outside ``if TYPE_CHECKING``)."""
    found = set()
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron_async"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("megatron_async"))
    return found


def test_the_format_and_storage_modules_import_no_circle():
    package = os.path.dirname(megatron_async.__file__)
    modules = {"megatron_async.format": os.path.join(package, "format.py")}
    for name in os.listdir(os.path.join(package, "storage")):
        if name.endswith(".py") and name != "__init__.py":
            modules[f"megatron_async.storage.{name[:-3]}"] = os.path.join(package, "storage", name)
    graph = {name: _runtime_imports(path) & set(modules) for name, path in modules.items()}
    assert not graph["megatron_async.format"], "format.py imports a storage backend"

    def reaches(start, target, seen=()):
        return any(n == target or (n not in seen and reaches(n, target, seen + (n,))) for n in graph[start])

    assert not [name for name in graph if reaches(name, name)]


def test_a_local_deletion_cut_short_leaves_an_incomplete_checkpoint(tmp_path, monkeypatch):
    """As in a store: the markers go first, so what a failed deletion leaves is incomplete."""
    from megatron_async import checkpoint_dirs
    from megatron_async.storage import local

    path = str(tmp_path / "iter_0000003")
    os.makedirs(path)
    for name in ("__0_0.distcp",) + COMPLETION_MARKERS:
        (tmp_path / "iter_0000003" / name).write_bytes(b"{}")

    def cut_short(path):
        raise OSError(f"cannot delete {path}")

    monkeypatch.setattr(local.shutil, "rmtree", cut_short)
    assert not checkpoint_dirs.delete_checkpoint_dir(path)
    assert not checkpoint_dirs.is_complete_checkpoint(path)
    assert os.listdir(path) == ["__0_0.distcp"]
