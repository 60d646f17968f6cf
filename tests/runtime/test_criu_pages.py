"""CRIU checkpoints deduplicated against a base (runtime/criu_pages.py) and the store's hash chain.

No CRIU needed: a "dump" here is a folder shaped like CRIU's (rank<r>/pages-<k>.img of whole pages,
other image files), which is all criu_pages and the store look at. tests/runtime/test_criu_cut_kinds.py
restores real CRIU dumps packed this way."""
import json
import os

import numpy as np
import pytest

from runtime import criu_pages
from runtime.store import (
    BASES_NAME,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMissing,
    CheckpointStore,
    ManifestMismatch,
    manifest_sha256,
)

pytestmark = pytest.mark.runtime
PAGE = criu_pages.PAGE


def fake_dump(store, pages_by_rank, *, seed=0):
    """A staging folder shaped like a CRIU dump: rank<r>/pages-1.img plus a small core image."""
    staging = store.staging_dir()
    for rank, pages in enumerate(pages_by_rank):
        (staging / f"rank{rank}").mkdir()
        pages.tofile(staging / f"rank{rank}" / "pages-1.img")
        (staging / f"rank{rank}" / "core-1.img").write_bytes(b"core %d %d" % (rank, seed))
    return staging


def random_pages(rng, n):
    return rng.integers(0, 256, size=(n, PAGE), dtype=np.uint8)


def commit(store, staging, step):
    base = store.base_candidate("criu")
    if base is not None and criu_pages.is_packed(base[0]):
        stats = criu_pages.pack(staging, base_dir=base[0], base_name=base[0].name,
                                base_manifest_sha256=base[1])
    else:
        stats = criu_pages.pack(staging)
    return store.commit(staging, step, "criu", meta={"world_size": 2}), stats


def rebuilt(store, ref, dest):
    manifest = store.verify(ref)
    out = criu_pages.unpack(ref.path, dest, manifest)
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(tmp_path / "store", keep=2)


@pytest.fixture
def chain(store, tmp_path):
    """A base checkpoint (two ranks sharing most pages) and one that changed 3 pages of rank 0."""
    rng = np.random.default_rng(3)
    common = random_pages(rng, 200)
    rank0 = np.concatenate([common, random_pages(rng, 20)])
    rank1 = np.concatenate([common, np.zeros((30, PAGE), np.uint8)])
    base_ref, base_stats = commit(store, fake_dump(store, [rank0, rank1]), 1)
    changed = rank0.copy()
    changed[[5, 100, 210]] = random_pages(rng, 3)
    delta_ref, delta_stats = commit(store, fake_dump(store, [changed, rank1], seed=1), 2)
    return {"base": base_ref, "delta": delta_ref, "base_stats": base_stats, "delta_stats": delta_stats,
            "pages": [changed, rank1], "base_pages": [rank0, rank1]}


def test_pages_are_stored_once_and_a_later_checkpoint_stores_only_what_changed(store, chain, tmp_path):
    # 200 pages shared by both ranks, 20 own pages of rank 0, 30 zero pages (one distinct).
    assert chain["base_stats"]["stored_pages"] == 200 + 20 + 1
    assert chain["base_stats"]["base"] is None
    assert chain["delta_stats"] == {"pages": 450, "stored_pages": 3, "reused_pages": 447,
                                    "base": chain["base"].path.name, "rebased": False}
    assert chain["delta"].base == chain["base"].uri
    assert chain["delta"].bytes < 0.05 * chain["base"].bytes
    files = rebuilt(store, chain["delta"], tmp_path / "images")
    assert files["rank0/pages-1.img"] == chain["pages"][0].tobytes()
    assert files["rank1/pages-1.img"] == chain["pages"][1].tobytes()
    assert files["rank0/core-1.img"] == b"core 0 1"
    assert not any(name.endswith(".map") or name.startswith("pages.") for name in files)
    base_files = rebuilt(store, chain["base"], tmp_path / "base-images")
    assert base_files["rank0/pages-1.img"] == chain["base_pages"][0].tobytes()


def test_images_are_rebuilt_where_the_kernel_refuses_to_copy_between_the_stores_and_the_jobs_filesystems(
        store, chain, tmp_path, monkeypatch):
    # Found on emulated hosts: copy_file_range fails with EXDEV from the shared store's mount to the
    # job's folder (a one-host CRIU checkpoint restored onto 2 hosts). Only that refusal is played
    # here (a second filesystem is not at hand in a unit test); the copy itself is real.
    import errno

    def refused(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")
    monkeypatch.setattr(os, "copy_file_range", refused)
    files = rebuilt(store, chain["delta"], tmp_path / "images")
    assert files["rank0/pages-1.img"] == chain["pages"][0].tobytes()  # own pages and the base's
    assert files["rank1/pages-1.img"] == chain["pages"][1].tobytes()


def test_a_host_restoring_its_share_of_a_one_host_checkpoint_rebuilds_only_its_ranks_images(store, chain, tmp_path):
    manifest = store.verify(chain["delta"])
    out = criu_pages.unpack(chain["delta"].path, tmp_path / "share", manifest, ranks=range(1, 2))
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == \
        ["rank1/core-1.img", "rank1/pages-1.img"]
    assert (out / "rank1" / "pages-1.img").read_bytes() == chain["pages"][1].tobytes()


def test_the_manifest_pins_the_base_by_its_manifest_sha256(store, chain):
    manifest = store.verify(chain["delta"])
    assert manifest["bases"] == [{"name": chain["base"].path.name,
                                  "manifest_sha256": manifest_sha256(chain["base"].path)}]
    assert BASES_NAME not in manifest["files"]


def test_a_missing_base_refuses_the_checkpoint_and_says_whose_base(store, chain):
    import shutil
    shutil.rmtree(chain["base"].path)
    with pytest.raises(CheckpointMissing, match=f"base checkpoint {chain['base'].path.name} of "
                                                f"{chain['delta'].path.name}"):
        store.verify(chain["delta"])
    assert store.latest_good() is None  # never the delta without its base


def test_an_altered_base_page_blob_is_refused(store, chain):
    blob = chain["base"].path / criu_pages.BLOB
    data = bytearray(blob.read_bytes())
    data[PAGE * 7] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="sha256.*base checkpoint"):
        store.verify(chain["delta"])


def test_a_base_whose_manifest_was_replaced_is_refused(store, chain):
    manifest_path = chain["base"].path / "MANIFEST.json"
    manifest = json.loads(manifest_path.read_bytes())
    manifest["step"] = 99  # still self-consistent, but not the manifest the delta pinned
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestMismatch, match="base checkpoint"):
        store.verify(chain["delta"])


def test_pages_naming_a_base_the_manifest_does_not_pin_are_refused(store, chain, tmp_path):
    manifest = store.verify(chain["delta"])
    with pytest.raises(criu_pages.PagesError, match="does not pin"):
        criu_pages.unpack(chain["delta"].path, tmp_path / "x", {**manifest, "bases": []})


def test_a_map_pointing_outside_its_blob_is_refused(store, chain, tmp_path):
    manifest = store.verify(chain["delta"])
    map_path = chain["delta"].path / "rank0" / "pages-1.img.map"
    mapping = np.fromfile(map_path, dtype="<i8")
    mapping[0] = 10 ** 6
    mapping.tofile(map_path)
    with pytest.raises(criu_pages.PagesError, match="outside its blob"):
        criu_pages.unpack(chain["delta"].path, tmp_path / "x", manifest)
    with pytest.raises(CheckpointCorrupt):  # and the store's own check catches it first
        store.verify(chain["delta"])


def test_retention_keeps_the_base_every_kept_checkpoint_needs(store, chain):
    rng = np.random.default_rng(9)
    later = []
    for step in (3, 4, 5):
        pages = chain["pages"][0].copy()
        pages[step] = random_pages(rng, 1)[0]
        ref, stats = commit(store, fake_dump(store, [pages, chain["pages"][1]], seed=step), step)
        assert stats["base"] == chain["base"].path.name
        later.append(ref)
    names = sorted(p.name for p in store.root.iterdir() if p.name.startswith("ckpt-"))
    assert names == sorted([chain["base"].path.name, later[-2].path.name, later[-1].path.name])
    assert store.latest_good() == later[-1]


def test_a_checkpoint_that_changed_most_pages_becomes_the_next_base(store, chain):
    rng = np.random.default_rng(11)
    ref, stats = commit(store, fake_dump(store, [random_pages(rng, 220), random_pages(rng, 250)]), 3)
    assert stats["rebased"] and ref.base is None
    _, stats = commit(store, fake_dump(store, [random_pages(rng, 1), random_pages(rng, 1)]), 4)
    assert stats["base"] == ref.path.name


def test_a_staged_base_that_is_not_a_checkpoint_of_the_store_is_refused(store, chain):
    for bad in ([{"name": "../elsewhere", "manifest_sha256": "0" * 64}],
                [{"name": "ckpt-000000000001-1", "manifest_sha256": "0" * 64}]):
        staging = fake_dump(store, [random_pages(np.random.default_rng(1), 2)])
        (staging / BASES_NAME).write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match="not a checkpoint of"):
            store.commit(staging, 3, "criu")
    staging = fake_dump(store, [random_pages(np.random.default_rng(1), 2)])
    (staging / BASES_NAME).write_text(json.dumps([{"name": chain["base"].path.name,
                                                   "manifest_sha256": "0" * 64}]))
    with pytest.raises(ManifestMismatch):
        store.commit(staging, 3, "criu")


def test_a_checkpoint_with_a_base_is_not_copied_away_from_it(store, chain, tmp_path):
    with pytest.raises(CheckpointError, match="restore it from the store itself"):
        store.restore(chain["delta"], tmp_path / "node-2")


def test_a_failed_pack_leaves_the_plain_dump_whole(store, tmp_path):
    staging = fake_dump(store, [random_pages(np.random.default_rng(2), 4)])
    before = (staging / "rank0" / "pages-1.img").read_bytes()
    (staging / "rank0" / "pages-2.img").write_bytes(b"x" * 100)  # not whole pages
    with pytest.raises(criu_pages.PagesError, match="whole number"):
        criu_pages.pack(staging)
    assert (staging / "rank0" / "pages-1.img").read_bytes() == before
    assert not criu_pages.is_packed(staging)
    assert sorted(os.listdir(staging)) == ["rank0"]
