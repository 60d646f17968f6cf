"""The checkpoint store: atomic commits, sha256 on restore, retention, fallback to the last
good checkpoint. Pure filesystem tests (no torch, no Django)."""
import json
import logging
import os

import pytest

from runtime.store import (
    ACCEPTED_FILE,
    MANIFEST_NAME,
    MAX_UNCONFIRMED,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMissing,
    CheckpointStore,
    path_from_uri,
    read_manifest,
    sha256_file,
)


def _make_tree(root, files):
    for rel, payload in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(payload)
    return root


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(tmp_path / "store", keep=3)


def test_it_commits_a_directory_tree_with_sizes_and_hashes(store, tmp_path):
    src = _make_tree(tmp_path / "dump", {"pages-1.img": b"x" * 1000, "rank-0/state.pt": b"abc",
                                         "rank-1/deep/er.bin": b""})
    ref = store.commit(src, step=7, engine="criu", meta={"world_size": 2})
    assert ref.step == 7 and ref.engine == "criu" and ref.bytes == 1003
    assert ref.uri.startswith("file://") and ref.path.parent == store.root
    manifest = read_manifest(ref.path)
    assert sorted(manifest["files"]) == ["pages-1.img", "rank-0/state.pt", "rank-1/deep/er.bin"]
    assert manifest["files"]["rank-0/state.pt"]["sha256"] == sha256_file(src / "rank-0/state.pt")[0]
    assert manifest["meta"] == {"world_size": 2}
    assert (ref.path / "rank-1/deep/er.bin").read_bytes() == b""
    assert store.verify(ref)["step"] == 7
    # the source is left alone when it is not a staging folder of the store
    assert (src / "pages-1.img").exists()


def test_it_commits_a_list_of_files_flat(store, tmp_path):
    a = tmp_path / "a.bin"
    a.write_bytes(b"1")
    b = tmp_path / "sub" / "b.bin"
    b.parent.mkdir()
    b.write_bytes(b"22")
    ref = store.commit([a, b], 3, "framework", None)
    assert sorted(read_manifest(ref.path)["files"]) == ["a.bin", "b.bin"]


def test_a_staging_folder_is_renamed_into_place_not_copied(store):
    staging = store.staging_dir()
    (staging / "rank-0").mkdir()
    (staging / "rank-0" / "state.pt").write_bytes(b"payload")
    ref = store.commit(staging, step=1, engine="framework")
    assert not staging.exists()
    assert (ref.path / "rank-0" / "state.pt").read_bytes() == b"payload"
    assert [p.name for p in store.root.iterdir() if p.name.startswith(".")] == []


def test_it_keeps_only_the_newest_k(store, tmp_path):
    src = _make_tree(tmp_path / "s", {"f": b"1"})
    refs = [store.commit(src, step=s, engine="framework") for s in (1, 2, 3, 4, 5)]
    assert [r.step for r in store.list()] == [3, 4, 5]
    assert not refs[0].path.exists() and refs[-1].path.exists()


def test_the_checkpoint_the_control_plane_accepted_and_all_after_it_are_never_pruned(tmp_path):
    # A copy cut off from its agent commits on until it fences itself; the control plane restores
    # elsewhere from the checkpoint it accepted last, which the agent names in the pin file.
    pin = tmp_path / ACCEPTED_FILE
    store = CheckpointStore(tmp_path / "store", keep=2, accepted_file=pin)
    src = _make_tree(tmp_path / "s", {"f": b"1"})
    first, second = (store.commit(src, step=s, engine="framework") for s in (1, 2))
    pin.write_text(second.path.name + "\n")
    for step in (3, 4, 5, 6):
        store.commit(src, step=step, engine="framework")
    assert [r.step for r in store.list()] == [2, 3, 4, 5, 6]  # 1 pruned; 2 (accepted) onwards kept
    assert not first.path.exists()
    # The pin moves on: retention drops what is older than the new accepted one, down to `keep`.
    pin.write_text(store.list()[-1].path.name)
    store.commit(src, step=7, engine="framework")
    assert [r.step for r in store.list()] == [6, 7]


def test_a_pin_that_never_moves_keeps_a_bounded_number_of_checkpoints(tmp_path):
    pin = tmp_path / ACCEPTED_FILE
    store = CheckpointStore(tmp_path / "store", keep=2, accepted_file=pin)
    src = _make_tree(tmp_path / "s", {"f": b"1"})
    accepted = store.commit(src, step=1, engine="framework")
    pin.write_text(accepted.path.name)
    for step in range(2, MAX_UNCONFIRMED + 6):
        store.commit(src, step=step, engine="framework")
    steps = [r.step for r in store.list()]
    assert steps[0] == 1 and len(steps) == MAX_UNCONFIRMED + 1  # the accepted one and the newest 16
    # A pin naming no checkpoint (garbage, or missing) is the plain rule: the newest `keep`.
    pin.write_text("../../etc/passwd")
    store.commit(src, step=100, engine="framework")
    assert [r.step for r in store.list()] == [MAX_UNCONFIRMED + 5, 100]


def test_latest_good_skips_a_corrupt_checkpoint_and_says_why(store, tmp_path, caplog):
    src = _make_tree(tmp_path / "s", {"state.pt": b"good bytes"})
    older = store.commit(src, step=10, engine="framework")
    newer = store.commit(src, step=20, engine="framework")
    (newer.path / "state.pt").write_bytes(b"bad  bytes")  # same size, different content
    with caplog.at_level(logging.WARNING, logger="runtime.store"):
        assert store.latest_good() == older
    assert "state.pt" in caplog.text and "sha256" in caplog.text
    with pytest.raises(CheckpointCorrupt, match="state.pt"):
        store.verify(newer)


def test_a_host_of_a_checkpoint_spanning_hosts_checks_its_own_part_and_what_all_share_not_the_others(tmp_path):
    """Node k of N (runtime/criu_parts.other_parts) checks the files outside every part and those of
    its own part, pinned to the manifest's digest: another host's damaged part is that host's to
    find (it restores it), its own is refused naming the file; a damaged shared file, by every host."""
    from runtime.criu_parts import other_parts
    from runtime.store import manifest_sha256

    src = _make_tree(tmp_path / "s", {"node0/rank0/pages.img": b"zero", "node1/rank1/pages.img": b"one!",
                                      "workspace/out.txt": b"shared"})
    ref = CheckpointStore(tmp_path / "store").commit(src, step=5, engine="criu")
    digest = manifest_sha256(ref.path)
    (ref.path / "node1" / "rank1" / "pages.img").write_bytes(b"bad!")  # same size, other bytes

    def store_of(node):
        store = CheckpointStore(tmp_path / "store")  # each host's launcher has a store of its own
        store.skip_parts_of = lambda _meta: other_parts(nodes=2, node_rank=node)
        return store

    assert store_of(0).pinned(digest) == ref and store_of(0).verify(ref, expect_manifest_sha256=digest)
    with pytest.raises(CheckpointCorrupt, match="node1/rank1/pages.img"):
        store_of(1).pinned(digest)
    (ref.path / "workspace" / "out.txt").write_bytes(b"SHARED")
    with pytest.raises(CheckpointCorrupt, match="workspace/out.txt"):
        store_of(0).verify(ref, expect_manifest_sha256=digest)
    with pytest.raises(CheckpointCorrupt):  # a store of one host checks every part
        CheckpointStore(tmp_path / "store").verify(ref)


@pytest.mark.parametrize("damage, error, words", [
    (lambda p: (p / "state.pt").unlink(), CheckpointMissing, "state.pt is missing"),
    (lambda p: (p / "state.pt").write_bytes(b"short"), CheckpointCorrupt, "bytes, manifest says"),
    (lambda p: (p / MANIFEST_NAME).unlink(), CheckpointMissing, "MANIFEST.json is missing"),
    (lambda p: (p / MANIFEST_NAME).write_text("{not json"), CheckpointCorrupt, "not valid JSON"),
    (lambda p: (p / MANIFEST_NAME).write_text(
        (p / MANIFEST_NAME).read_text().replace('"size": 10', '"size": 11')),
     CheckpointCorrupt, "does not match its digest"),
], ids=["file-missing", "file-truncated", "manifest-missing", "manifest-garbled",
        "manifest-edited"])
def test_each_kind_of_damage_is_named_and_the_previous_checkpoint_is_used(
        store, tmp_path, damage, error, words):
    src = _make_tree(tmp_path / "s", {"state.pt": b"0123456789"})
    good = store.commit(src, step=1, engine="framework")
    bad = store.commit(src, step=2, engine="framework")
    damage(bad.path)
    with pytest.raises(error, match=words):
        store.verify(bad)
    assert store.latest_good() == good


def test_a_vanished_checkpoint_folder_is_missing(store, tmp_path):
    ref = store.commit(_make_tree(tmp_path / "s", {"f": b"1"}), step=1, engine="criu")
    os.rename(ref.path, tmp_path / "elsewhere")
    with pytest.raises(CheckpointMissing, match="no such checkpoint folder"):
        store.verify(ref)
    assert store.latest_good() is None


def test_restore_copies_to_another_directory_and_checks_the_copy(store, tmp_path):
    ref = store.commit(_make_tree(tmp_path / "s", {"a/b.img": b"image", "c": b"see"}),
                       step=4, engine="criu")
    out = store.restore(ref, tmp_path / "node-2" / "work")
    assert (out / "a/b.img").read_bytes() == b"image"
    assert json.loads((out / MANIFEST_NAME).read_text())["step"] == 4
    (ref.path / "c").write_bytes(b"sea")
    with pytest.raises(CheckpointCorrupt, match="c"):
        store.restore(ref, tmp_path / "node-3")
    assert store.latest_good() is None


def test_leftover_temporary_folders_are_never_listed(store, tmp_path):
    (store.root / ".tmp-ckpt-000000000009-1").mkdir()
    (store.root / ".tmp-ckpt-000000000009-1" / "half").write_bytes(b"x")
    good = store.commit(_make_tree(tmp_path / "s", {"f": b"1"}), step=1, engine="framework")
    assert store.list() == [good] and store.latest_good() == good


@pytest.mark.parametrize("uri", ["s3://bucket/ckpt", "gs://b/c", "file://otherhost/path"])
def test_it_refuses_uris_it_cannot_reach(uri):
    with pytest.raises(ValueError, match="not supported|local path"):
        path_from_uri(uri)


def test_file_uri_and_plain_path_name_the_same_store(tmp_path):
    a = CheckpointStore(tmp_path / "st")
    b = CheckpointStore((tmp_path / "st").as_uri())
    assert a.root == b.root


@pytest.mark.parametrize("kwargs, words", [
    ({"step": -1, "engine": "criu"}, "non-negative"),
    ({"step": 1, "engine": ""}, "engine"),
    ({"step": 1, "engine": "criu", "meta": {"x": object()}}, "JSON serializable"),
], ids=["negative-step", "no-engine", "meta-not-json"])
def test_bad_commit_arguments_are_refused_before_writing(store, tmp_path, kwargs, words):
    src = _make_tree(tmp_path / "s", {"f": b"1"})
    with pytest.raises((ValueError, TypeError), match=words):
        store.commit(src, **kwargs)
    assert list(store.root.iterdir()) == []


def test_empty_and_symlinked_sources_are_refused(store, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="empty"):
        store.commit(tmp_path / "empty", step=1, engine="criu")
    src = _make_tree(tmp_path / "s", {"f": b"1"})
    (src / "link").symlink_to(src / "f")
    with pytest.raises(CheckpointError, match="not a regular file"):
        store.commit(src, step=1, engine="criu")
    assert store.list() == []
    with pytest.raises(CheckpointMissing, match="nothere"):
        store.commit([tmp_path / "nothere"], step=1, engine="criu")


def test_a_staging_folder_reuses_the_hashes_its_engine_wrote_and_restore_still_checks(store):
    from runtime.store import write_manifest
    staging = store.staging_dir()
    rank = staging / "rank-0"
    rank.mkdir()
    (rank / "state.pt").write_bytes(b"written by the engine")
    digest, size = sha256_file(rank / "state.pt")
    write_manifest(rank, {"state.pt": {"size": size, "sha256": digest}}, engine="framework")
    ref = store.commit(staging, step=3, engine="framework")
    assert read_manifest(ref.path)["files"]["rank-0/state.pt"]["sha256"] == digest
    assert store.latest_good() == ref
    # a byte flipped after the engine hashed it is caught on restore
    (ref.path / "rank-0" / "state.pt").write_bytes(b"written by the engind")
    with pytest.raises(CheckpointCorrupt, match="rank-0/state.pt"):
        store.verify(ref)


def test_a_staging_file_whose_size_disagrees_with_its_engine_manifest_is_hashed_afresh(store):
    from runtime.store import write_manifest
    staging = store.staging_dir()
    (staging / "state.pt").write_bytes(b"final bytes")
    write_manifest(staging / ".", {}, engine="criu")  # a top-level manifest is ignored
    sub = staging / "rank-1"
    sub.mkdir()
    (sub / "a").write_bytes(b"new content, longer")
    write_manifest(sub, {"a": {"size": 3, "sha256": "0" * 64}}, engine="framework")
    ref = store.commit(staging, step=1, engine="framework")
    assert read_manifest(ref.path)["files"]["rank-1/a"]["sha256"] == sha256_file(ref.path / "rank-1" / "a")[0]
    store.verify(ref)
