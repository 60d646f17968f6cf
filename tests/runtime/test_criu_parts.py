"""The leader's check of every host's part of a CRIU checkpoint spanning hosts
(runtime/criu_parts.py): a part missing, altered, not the one its host reported, holding more
than it lists or belonging to another cut refuses the commit, naming the node. (The dumps
themselves are proven on emulated hosts: tests/hosts/test_multihost_criu.py.)"""
import types

import pytest

from runtime import criu_parts, engines
from runtime import store as checkpoint_store
from runtime.exits import LaunchError

REQUEST_ID, STEP = 1700000000000, 6


def write_part(staging, node, *, ranks, step=STEP):
    """Writes node `node`'s part as dump_part lays it out (a stand-in page image per rank);
    returns its manifest's sha256."""
    part = criu_parts.part_dir(staging, node)
    for rank in ranks:
        (part / f"rank{rank}").mkdir(parents=True)
        (part / f"rank{rank}" / "pages-1.img").write_bytes(bytes([rank]) * 8192)
    (part / "logs").mkdir()
    checkpoint_store.write_manifest(part, checkpoint_store.hash_tree(part), meta={
        "node": node, "ranks": list(ranks), "request_id": REQUEST_ID, "step": step, "spool": "/run/meridian/j"})
    return checkpoint_store.manifest_sha256(part)


@pytest.fixture
def staging(tmp_path):
    folder = tmp_path / ".staging-abc"
    folder.mkdir()
    return folder


def verify(staging, reported):
    criu_parts.verify_parts(staging, nodes=2, world_size=4, request_id=REQUEST_ID, step=STEP, reported=reported)


def test_it_accepts_every_host_part_as_its_host_reported_it(staging):
    reported = {0: write_part(staging, 0, ranks=(0, 1)), 1: write_part(staging, 1, ranks=(2, 3))}
    verify(staging, reported)


def test_it_refuses_a_checkpoint_without_one_host_part(staging):
    reported = {0: write_part(staging, 0, ranks=(0, 1)), 1: "0" * 64}
    with pytest.raises(criu_parts.PartError, match="node 1's part of the checkpoint is missing or bad: .*node1"):
        verify(staging, reported)
    with pytest.raises(criu_parts.PartError, match="node 1 reported no part"):
        verify(staging, {0: reported[0]})


def test_it_refuses_a_part_whose_file_changed_after_its_host_hashed_it(staging):
    reported = {0: write_part(staging, 0, ranks=(0, 1)), 1: write_part(staging, 1, ranks=(2, 3))}
    image = criu_parts.part_dir(staging, 1) / "rank3" / "pages-1.img"
    image.write_bytes(b"\x00" + image.read_bytes()[1:])
    with pytest.raises(criu_parts.PartError, match=r"node 1's part .*rank3/pages-1.img is corrupt"):
        verify(staging, reported)


def test_it_refuses_a_part_whose_manifest_is_not_the_one_its_host_reported(staging):
    reported = {0: write_part(staging, 0, ranks=(0, 1)), 1: write_part(staging, 1, ranks=(2, 3))}
    (criu_parts.part_dir(staging, 1) / "rank2" / "pages-1.img").write_bytes(b"other")  # and its manifest:
    checkpoint_store.write_manifest(criu_parts.part_dir(staging, 1),
                                    checkpoint_store.hash_tree(criu_parts.part_dir(staging, 1)),
                                    meta={"node": 1, "ranks": [2, 3], "request_id": REQUEST_ID, "step": STEP})
    with pytest.raises(criu_parts.PartError, match="node 1's part of the checkpoint is not the one node 1 reported"):
        verify(staging, reported)


def test_it_refuses_a_part_with_files_its_manifest_does_not_list(staging):
    reported = {0: write_part(staging, 0, ranks=(0, 1)), 1: write_part(staging, 1, ranks=(2, 3))}
    (criu_parts.part_dir(staging, 0) / "rank1" / "extra.img").write_bytes(b"x")
    unlisted = r"node 0's part holds files its manifest does not list: \['rank1/extra.img'\]"
    with pytest.raises(criu_parts.PartError, match=unlisted):
        verify(staging, reported)


def test_it_refuses_a_part_of_another_cut_or_of_other_ranks(staging):
    reported = {0: write_part(staging, 0, ranks=(0, 1)), 1: write_part(staging, 1, ranks=(2, 3), step=STEP - 1)}
    with pytest.raises(criu_parts.PartError, match="node 1's part is not the one of this cut"):
        verify(staging, reported)
    other = staging.parent / ".staging-def"
    other.mkdir()
    reported = {0: write_part(other, 0, ranks=(0, 1)), 1: write_part(other, 1, ranks=(1, 2))}
    with pytest.raises(criu_parts.PartError, match="node 1's part is not the one of this cut"):
        verify(other, reported)


def test_it_refuses_a_staging_folder_with_more_than_the_parts(staging):
    reported = {0: write_part(staging, 0, ranks=(0, 1)), 1: write_part(staging, 1, ranks=(2, 3))}
    (staging / "rank0").mkdir()
    with pytest.raises(criu_parts.PartError, match=r"holds \['rank0'\] besides the parts of its 2 nodes"):
        verify(staging, reported)


def test_a_follower_whose_store_lacks_the_leaders_staging_folder_is_told_its_store_is_not_shared(tmp_path, staging):
    own = tmp_path / "own-store"
    own.mkdir()
    with pytest.raises(criu_parts.PartError, match="is not in this node's store .* the same shared --store"):
        criu_parts.staging_for_node(own, str(staging))
    assert criu_parts.staging_for_node(staging.parent, f"/elsewhere/{staging.name}") == staging
    with pytest.raises(criu_parts.PartError, match="is not a staging folder"):
        criu_parts.staging_for_node(staging.parent, "/somewhere/ckpt-000000000001-1")


@pytest.mark.parametrize(("dumped_on", "restoring_on"), [(2, 1), (1, 2), (2, 4)], ids=["2->1", "1->2", "2->4"])
def test_a_criu_checkpoint_is_restored_only_onto_as_many_hosts_as_dumped_it(dumped_on, restoring_on):
    launcher = types.SimpleNamespace(nodes=restoring_on, node_rank=0)
    ref = types.SimpleNamespace(uri="file:///store/ckpt-000000000006-1", path=None)
    with pytest.raises(LaunchError, match=f"CRIU images of {dumped_on} host\\(s\\) and this launch spans "
                                          f"{restoring_on}") as caught:
        engines.CriuEngine().restore(launcher, ref, {"nodes": dumped_on, "request_id": REQUEST_ID})
    assert caught.value.code == 2


def test_auto_gives_a_job_spanning_hosts_the_framework_engine_and_criu_only_when_asked(monkeypatch):
    from runtime import criu, launcher
    monkeypatch.setattr(criu, "check_available", lambda: (True, "4.1.1"))  # CRIU's availability is not under test

    def chosen(engine, nodes):
        fake = types.SimpleNamespace(sandbox=None, options=types.SimpleNamespace(engine=engine), nodes=nodes)
        return launcher.Launcher.choose_engine(fake)

    name, reason = chosen("auto", 2)
    assert name == "framework" and "spanning 2 hosts" in reason and "--engine criu" in reason
    assert chosen("criu", 2)[0] == "criu"
    assert chosen("auto", 1)[0] != "framework"  # one host: CRIU (or a better engine) where it works
