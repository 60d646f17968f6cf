"""The leader's check of every host's part of a CRIU checkpoint spanning hosts
(runtime/criu_parts.py): a part missing, altered, not the one its host reported, holding more
than it lists or belonging to another cut refuses the commit, naming the node. (The dumps
themselves are proven on emulated hosts: tests/hosts/test_multihost_criu.py.)"""
import types

import pytest

from runtime import criu_parts, engines
from runtime import store as checkpoint_store

REQUEST_ID, STEP = 1700000000000, 6


def write_part(staging, node, *, ranks, step=STEP, spool="/run/meridian/j", **meta):
    """Writes node `node`'s part as dump_part lays it out (a stand-in page image per rank), its
    manifest's meta with `meta` besides; returns its manifest's sha256."""
    part = criu_parts.part_dir(staging, node)
    for rank in ranks:
        (part / f"rank{rank}").mkdir(parents=True)
        (part / f"rank{rank}" / "pages-1.img").write_bytes(bytes([rank]) * 8192)
    (part / "logs").mkdir()
    checkpoint_store.write_manifest(part, checkpoint_store.hash_tree(part), meta={
        "node": node, "ranks": list(ranks), "request_id": REQUEST_ID, "step": step, "spool": spool, **meta})
    return checkpoint_store.manifest_sha256(part)


@pytest.fixture
def staging(tmp_path):
    folder = tmp_path / ".staging-abc"
    folder.mkdir()
    return folder


def verify(staging, reported):
    return criu_parts.verify_parts(staging, blocks=[range(0, 2), range(2, 4)], request_id=REQUEST_ID, step=STEP,
                                   reported=reported)


def test_it_accepts_every_host_part_as_its_host_reported_it(staging):
    reported = {0: write_part(staging, 0, ranks=(0, 1)), 1: write_part(staging, 1, ranks=(2, 3))}
    assert verify(staging, reported) == criu_parts.VerifiedParts(left_out=(), cuda_s=None)  # no GPU anywhere


def test_the_checkpoint_says_the_slowest_hosts_cuda_stage_each_way(staging):
    """A GPU job's hosts move their ranks' CUDA state at once: the event's seconds are the slowest
    host's each way (a host without one, or a way not taken (a stop's ranks stay off the GPU), counts
    for nothing)."""
    reported = {0: write_part(staging, 0, ranks=(0, 1), cuda_s=[1.5, 0.25]),
                1: write_part(staging, 1, ranks=(2, 3), cuda_s=[2.75, None])}
    assert verify(staging, reported).cuda_s == (2.75, 0.25)


@pytest.mark.parametrize("cuda_s", ["1.5", [1.5], [1.5, -1], [True, 0.5], [1e9, 0.5], {"out": 1}])
def test_a_part_whose_cuda_seconds_are_no_reading_is_refused_by_node(staging, cuda_s):
    reported = {0: write_part(staging, 0, ranks=(0, 1)), 1: write_part(staging, 1, ranks=(2, 3), cuda_s=cuda_s)}
    with pytest.raises(criu_parts.PartError, match="node 1's part manifest has a cuda_s that is not"):
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


def committed_parts(tmp_path, *, nodes, world_size=4, spools=None, blocks=None):
    """A checkpoint folder with the parts of `nodes` hosts (as dump_part writes them), host k's
    ranks blocks[k] (default: the equal W/N blocks), its spool path spools[k] (default: the same on
    every host, as agents and meridian-run name it)."""
    folder = tmp_path / "ckpt-000000000006-1"
    per_node = world_size // nodes
    for node in range(nodes):
        write_part(folder, node, ranks=blocks[node] if blocks else range(node * per_node, (node + 1) * per_node),
                   **({"spool": spools[node]} if spools else {}))
    return folder


def _equal(world_size, nodes, node_rank):
    per_node = world_size // nodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


@pytest.mark.parametrize(("dumped_on", "restoring_on", "node_rank", "expected"), [
    (2, 2, 1, {"node1": (2, 3)}),
    (2, 1, 0, {"node0": (0, 1), "node1": (2, 3)}),  # merged: one host restores both parts
    (2, 4, 3, {"node1": (3,)}),  # split: node 3 of 4 restores rank 3 of node 1's part
    (4, 2, 1, {"node2": (2,), "node3": (3,)}),
], ids=["2->2", "2->1", "2->4", "4->2"])
def test_each_host_restores_its_ranks_from_the_parts_that_hold_them_whatever_host_count_dumped_them(
        tmp_path, dumped_on, restoring_on, node_rank, expected):
    folder = committed_parts(tmp_path, nodes=dumped_on)
    ranks = _equal(4, restoring_on, node_rank)
    plan = criu_parts.restore_sources(folder, {"nodes": dumped_on}, world_size=4, ranks=ranks)
    assert {source.folder.name: source.ranks for source in plan.sources} == expected
    assert plan.regrouped == (dumped_on != restoring_on) and plan.spool == "/run/meridian/j"
    for source in plan.sources:
        for rank in source.ranks:
            assert plan.images_of(rank) == source.folder and (source.folder / f"rank{rank}").is_dir()
    # The parts it does not restore from are the ones its store does not check.
    unread = criu_parts.unread_parts({"nodes": dumped_on}, world_size=4, ranks=ranks)
    assert unread == {f"node{k}" for k in range(dumped_on)} - set(expected)


# W = 6 dumped on 2 hosts holding 2 + 1 devices (ranks 0..3 and 4..5): the checkpoint's meta names
# the blocks, and each part its ranks.
UNEQUAL = {"nodes": 2, "blocks": [[0, 4], [4, 2]]}


@pytest.mark.parametrize(("ranks", "expected"), [
    (range(0, 6), {"node0": (0, 1, 2, 3), "node1": (4, 5)}),  # onto one host: both parts merged
    (range(0, 2), {"node0": (0, 1)}),  # onto 3 equal hosts: host 0 ...
    (range(2, 4), {"node0": (2, 3)}),
    (range(4, 6), {"node1": (4, 5)}),  # ... host 2: exactly node 1's part
    (range(0, 2), {"node0": (0, 1)}),  # onto 1 + 2 devices: host 0 ...
    (range(2, 6), {"node0": (2, 3), "node1": (4, 5)}),  # ... host 1 takes the rest of both
    (range(0, 4), {"node0": (0, 1, 2, 3)}),  # onto 2 + 1 again: each host its own part
], ids=["1", "3-equal-0", "3-equal-1", "3-equal-2", "1+2-0", "1+2-1", "2+1-0"])
def test_a_checkpoint_dumped_on_unequal_hosts_restores_onto_any_blocks(tmp_path, ranks, expected):
    folder = committed_parts(tmp_path, nodes=2, world_size=6, blocks=[range(0, 4), range(4, 6)])
    plan = criu_parts.restore_sources(folder, UNEQUAL, world_size=6, ranks=ranks)
    assert {source.folder.name: source.ranks for source in plan.sources} == expected
    assert plan.regrouped == (ranks not in (range(0, 4), range(4, 6)))
    assert criu_parts.unread_parts(UNEQUAL, world_size=6, ranks=ranks) == {"node0", "node1"} - set(expected)
    # Without the blocks (a checkpoint from before them) the parts would be read as 3 + 3: wrong
    # for this one, so a checkpoint of unequal hosts always names them.
    assert criu_parts.dumped_blocks({"nodes": 2}, world_size=6) == (range(0, 3), range(3, 6))


@pytest.mark.parametrize("blocks, message", [
    ([[0, 4], [3, 3]], "overlaps the one before"),
    ([[0, 3], [4, 2]], "leaves a gap"),
    ([[0, 4], [4, 1]], "end at rank 4, not at 5"),
    ([[0, 6]], "not \\[first rank, ranks\\] for each of its 2 hosts"),
    ([[0, "4"], [4, 2]], "not \\[first rank, ranks\\]"),
])
def test_a_checkpoint_whose_blocks_do_not_tile_its_ranks_is_refused_by_name(tmp_path, blocks, message):
    folder = committed_parts(tmp_path, nodes=2, world_size=6, blocks=[range(0, 4), range(4, 6)])
    with pytest.raises(criu_parts.PartError, match=message):
        criu_parts.restore_sources(folder, {"nodes": 2, "blocks": blocks}, world_size=6, ranks=range(0, 6))


def test_the_leader_checks_each_part_holds_its_hosts_unequal_block(staging):
    reported = {0: write_part(staging, 0, ranks=(0, 1, 2, 3)), 1: write_part(staging, 1, ranks=(4, 5))}
    blocks = [range(0, 4), range(4, 6)]
    criu_parts.verify_parts(staging, blocks=blocks, request_id=REQUEST_ID, step=STEP, reported=reported)
    with pytest.raises(criu_parts.PartError, match="node 0's part is not the one of this cut"):
        criu_parts.verify_parts(staging, blocks=[range(0, 3), range(3, 6)], request_id=REQUEST_ID, step=STEP,
                                reported=reported)


def test_a_checkpoint_of_one_host_is_restored_on_two_each_host_its_block_of_ranks(tmp_path):
    meta = {"nodes": 1, "spool": "/run/meridian/j1-0-42"}
    plans = [criu_parts.restore_sources(tmp_path, meta, world_size=4, ranks=_equal(4, 2, node)) for node in (0, 1)]
    assert [plan.sources[0].ranks for plan in plans] == [(0, 1), (2, 3)]
    assert all(plan.regrouped and plan.spool == "/run/meridian/j1-0-42" and plan.images_of(2 * k) == tmp_path
               for k, plan in enumerate(plans))
    assert criu_parts.unread_parts(meta, world_size=4, ranks=range(2, 4)) == set()  # no parts: all read


def test_parts_dumped_with_different_spool_paths_are_not_merged_onto_one_host(tmp_path):
    folder = committed_parts(tmp_path, nodes=2, spools=["/run/meridian/a", "/run/meridian/b"])
    with pytest.raises(criu_parts.PartError, match=r"different spool paths \['/run/meridian/a', '/run/meridian/b'\]"):
        criu_parts.restore_sources(folder, {"nodes": 2}, world_size=4, ranks=range(4))
    # On as many hosts as dumped them, each host has one spool: restored as before.
    plan = criu_parts.restore_sources(folder, {"nodes": 2}, world_size=4, ranks=range(2, 4))
    assert plan.spool == "/run/meridian/b"


def _sandboxed_launcher(device_kind="cpu"):
    identity = types.SimpleNamespace(uid=1_650_100, gid=1_650_100)
    return types.SimpleNamespace(sandbox=types.SimpleNamespace(
        spec=types.SimpleNamespace(device_kind=device_kind), identity=identity))


def test_a_regrouped_restore_of_a_gpu_job_or_of_private_files_that_clash_is_refused_by_name(tmp_path):
    import tarfile
    folder = committed_parts(tmp_path, nodes=2)
    merged = criu_parts.restore_sources(folder, {"nodes": 2}, world_size=4, ranks=range(4))
    same = criu_parts.restore_sources(folder, {"nodes": 2}, world_size=4, ranks=range(2))
    unconfined = types.SimpleNamespace(sandbox=None)
    assert engines.regroup_refusal(unconfined, merged) is None
    assert "GPU job" in engines.regroup_refusal(_sandboxed_launcher("gpu"), merged)
    assert engines.regroup_refusal(_sandboxed_launcher("gpu"), same) is None  # not regrouped

    def save(node, name, files):
        with tarfile.open(criu_parts.part_dir(folder, node) / name, "w") as archive:
            for arcname, content in files.items():
                source = tmp_path / "source"
                if content is None:
                    source.mkdir(exist_ok=True)
                else:
                    source.write_bytes(content)
                archive.add(source, arcname=arcname, recursive=False)
                source.rmdir() if content is None else source.unlink()
    # What torch leaves in every host's /tmp (found on emulated hosts), and a file both hosts wrote
    # alike, merge: one host's folders hold them as each host did.
    for node in (0, 1):
        save(node, "private-tmp.tar", {"torchinductor_meridian": None, "same.txt": b"alike"})
        save(node, "private-shm.tar", {})
    assert engines.regroup_refusal(_sandboxed_launcher(), merged) is None
    save(1, "private-shm.tar", {"cache.bin": b"host 1"})  # only host 1 has it: merges too
    assert engines.regroup_refusal(_sandboxed_launcher(), merged) is None
    save(0, "private-shm.tar", {"cache.bin": b"host 0"})  # both, not alike: refused, naming it
    refusal = engines.regroup_refusal(_sandboxed_launcher(), merged)
    assert "/dev/shm/cache.bin: differs between node0 and node1" in refusal, refusal
    assert engines.regroup_refusal(_sandboxed_launcher(), same) is None


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
