"""One CRIU checkpoint of a job spanning hosts: each host dumps its own ranks into its part.

A job of W ranks on N hosts checkpointed with CRIU is one checkpoint of the store, committed once
by the leader (node 0), whose folder holds one part per host:

    node<k>/MANIFEST.json   the part manifest (runtime/store.py's format, written last): every
                            other file of the part with its size and sha256, and `meta`: the node,
                            its ranks, the cut's request id and step, and the spool path the ranks
                            had when they were dumped (a restored rank goes on using it)
    node<k>/rank<r>/        CRIU's images of rank r, for each r of node k's block of ranks
    node<k>/logs/           those ranks' logs (CRIU restores an open file only at its path and size)
    node<k>/dump-rank<r>.log  CRIU's own log of the dump
    node<k>/private-tmp.tar, private-shm.tar   a sandboxed job's: what its ranks on host k left in
                            their private /tmp and /dev/shm (runtime/private_dirs.py); the part
                            manifest's meta `left_out` says what those copies could not carry

A sandboxed job's part is dumped and restored exactly as a sandboxed job of one host is
(runtime/engines.py dump_host_ranks and CriuEngine._restore_host_ranks, which both paths call):
criu as the job's uid with ambient capabilities, the private folders as external mounts, each
rank's images sealed root's, every restored task checked before it runs.

At a cut every host's launcher dumps its parked ranks (left running: they stay parked, with no
socket open, until the leader decides) into its part of the staging folder the leader named in
the CutRequest, in that host's view of the shared store, hashes what it wrote, and reports the
part manifest's sha256 to the leader (protocol.rendezvous.NodeCutReport). The leader dumps its
own part, then checks every part (`verify_parts`): present, its manifest the one its host
reported, every file of it the size and sha256 the manifest lists, no file it does not list,
the node, ranks, request and step the cut's. Only then is the staging folder committed (one
rename: runtime/store.py). A checkpoint's ranks on every host go on as soon as every part is
dumped (the leader's outcome "dumped", runtime/multihost.py: the check and the commit are no
part of the downtime); a stop's ranks are ended only once the checkpoint is committed. A missing
or bad part commits nothing: the leader withdraws the cut and every host lets its parked ranks
go on: the job goes on, after a checkpoint and after a stop alike.

At restore, node k of the new launch restores the ranks of part node<k> (the same block of ranks,
on whichever host runs node k now), after its store verified the checkpoint's manifest (pinned to
the digest the control plane recorded), the files outside every part, and its own part's files:
each host checks what it restores, so a job on N hosts reads its checkpoint once in all, not N
times (`other_parts`, CheckpointStore.skip_folders); a bad part fails the restore of its host. The number of
hosts must be the one the checkpoint was dumped on: a restored rank keeps its place in the host
chain of the reduction (runtime/hostchain.py) and its LOCAL_RANK; other host counts are refused.

Parts are stored whole: the memory pages of a one-host CRIU checkpoint are deduplicated against
a base (runtime/criu_pages.py), those of a checkpoint spanning hosts are not (not built).
"""
from __future__ import annotations

import os
from pathlib import Path

from runtime import rank_logs
from runtime import store as checkpoint_store
from runtime.multihost import node_ranks

PART_PREFIX = "node"


class PartError(checkpoint_store.CheckpointError):
    """A host's part of a checkpoint spanning hosts is missing or not what it must be."""


def part_dir(root, node: int) -> Path:
    """Returns the folder of node `node`'s part under a checkpoint (or its staging folder)."""
    return Path(root) / f"{PART_PREFIX}{node}"


def other_parts(*, nodes: int, node_rank: int) -> frozenset[str]:
    """The folder names of the parts node `node_rank` of `nodes` neither restores nor checks at a
    resume (runtime/store.py CheckpointStore.skip_folders): the other hosts'."""
    return frozenset(part_dir("", node).name for node in range(nodes) if node != node_rank)


def staging_for_node(store_root, staging_dir: str) -> Path:
    """Returns this host's view of the staging folder `staging_dir` the leader named: the folder
    of that name in this node's own store. Raises PartError for a name that is not a staging
    folder's, or when this node's store has no such folder (its --store is not the shared one)."""
    name = os.path.basename(str(staging_dir).rstrip("/"))
    if not name.startswith(checkpoint_store.STAGING_PREFIX) or name != Path(name).name:
        raise PartError(f"{staging_dir!r} is not a staging folder of a checkpoint store")
    folder = Path(store_root) / name
    if not folder.is_dir():
        raise PartError(f"the leader's staging folder {name} is not in this node's store {store_root}: "
                        "every node of a job spanning hosts must use the same shared --store")
    return folder


def dump_part(launcher, request, step: int, staging) -> str:
    """Dumps this node's ranks, parked at the cut `request` after `step`, into its part of
    `staging` by the one-host dump's own code (runtime/engines.py dump_host_ranks),
    leaving them running (still parked); writes the part manifest (with what the part left out,
    `left_out`) and returns its sha256. Raises RuntimeError (a CRIU dump failed), CheckpointError,
    or what dump_host_ranks raises; the ranks are then still parked and the caller lets them go on."""
    from runtime.engines import dump_host_ranks  # not at the top: runtime.engines imports this module

    part = part_dir(staging, launcher.node_rank)
    part.mkdir()
    rank_logs.carry(launcher, part / "logs")
    left_out = dump_host_ranks(launcher, part, leave_running=True)
    files = checkpoint_store.hash_tree(part)
    checkpoint_store.write_manifest(part, files, meta={
        "node": launcher.node_rank, "ranks": [process.rank for process in launcher.ranks],
        "request_id": request.id, "step": step, "spool": str(launcher.spool), "left_out": list(left_out)})
    checkpoint_store.fsync_dir(staging)
    return checkpoint_store.manifest_sha256(part)


def verify_parts(staging, *, nodes: int, world_size: int, request_id: int, step: int,
                 reported: dict[int, str | None]) -> tuple[str, ...]:
    """Checks that `staging` holds the part of every node 0..nodes-1 as the module docstring says,
    node k's manifest with sha256 `reported[k]`, and nothing else. Returns what the parts left out
    (their manifests' `left_out`, each line prefixed "node k: "); raises PartError naming the
    first node whose part is missing or bad, and why."""
    staging = Path(staging)
    left_out: list[str] = []
    expected = {part_dir(staging, node).name for node in range(nodes)}
    strays = sorted(entry.name for entry in staging.iterdir() if entry.name not in expected)
    for node in range(nodes):
        part = part_dir(staging, node)
        digest = reported.get(node)
        if not digest:
            raise PartError(f"node {node} reported no part of the checkpoint")
        try:
            manifest = checkpoint_store.read_manifest(part, expect_sha256=digest)
            checkpoint_store.verify_dir(part, manifest)
            on_disk = set(checkpoint_store.file_names(part))
        except checkpoint_store.ManifestMismatch:
            raise PartError(f"node {node}'s part of the checkpoint is not the one node {node} reported "
                            f"(its manifest's sha256 is not {digest[:16]}…)") from None
        except checkpoint_store.CheckpointError as exc:
            raise PartError(f"node {node}'s part of the checkpoint is missing or bad: {exc}") from None
        if on_disk != set(manifest["files"]):
            unlisted = sorted(on_disk - set(manifest["files"]))
            raise PartError(f"node {node}'s part holds files its manifest does not list: {unlisted[:5]}")
        meta = manifest.get("meta") or {}
        want = {"node": node, "ranks": list(node_ranks(world_size=world_size, nodes=nodes, node_rank=node)),
                "request_id": request_id, "step": step}
        wrong = {key: meta.get(key) for key, value in want.items() if meta.get(key) != value}
        if wrong:
            raise PartError(f"node {node}'s part is not the one of this cut: it says {wrong}, "
                            f"the cut is {want}")
        notes = meta.get("left_out") or []
        if not isinstance(notes, list) or not all(isinstance(note, str) for note in notes):
            raise PartError(f"node {node}'s part manifest has a left_out that is not a list of lines")
        left_out.extend(f"node {node}: {note}" for note in notes)
    if strays:
        raise PartError(f"the checkpoint's staging folder holds {strays[:5]} besides the parts of its "
                        f"{nodes} nodes")
    return tuple(left_out)


def part_spool(ref_path, node: int) -> str | None:
    """Returns the spool path node `node`'s ranks had when they were dumped (its part manifest's
    meta; the store verified the checkpoint before), or None when it names none."""
    manifest = checkpoint_store.read_manifest(part_dir(ref_path, node))
    spool = (manifest.get("meta") or {}).get("spool")
    return spool if isinstance(spool, str) else None
