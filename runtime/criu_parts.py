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

At restore, node j of a new launch on M hosts restores its block of ranks (runtime/multihost.py
host_block), each rank r from the folder it was dumped into: part node<k> of a checkpoint dumped
on N hosts, the part whose block holds r, or the checkpoint itself for one dumped on one host
(`restore_sources`). Which ranks each part holds is what the checkpoint's manifest meta says:
`blocks` ([first rank, ranks] per dumping host, in node order: hosts may hold unequal shares,
W = 6 on 2 + 1 devices dumps parts of 4 and 2 ranks), or for a checkpoint written before blocks
were named, the equal W/N blocks of its `nodes` (`dumped_blocks`); the leader checked at the
commit that each part's own meta names its block. The restoring layout may differ in every way
(2 hosts x 2 ranks -> 1 host x 4, and back; 2 + 1 devices -> 1 host, -> 3 equal hosts, -> 1 + 2):
the same blocks put node k's part back on node k; otherwise parts merge onto a host, or one is
split over hosts, or both.
Its store verified the checkpoint's manifest (pinned to the digest the control plane recorded),
the files outside every part, and the parts it restores from: each host checks what it restores,
so a job on N hosts restored on N reads its checkpoint once in all, not N times (`unread_parts`,
CheckpointStore.skip_parts_of); a bad part fails the restore of every host that reads it.

What makes another host count exact: nothing a restored rank kept in memory of its old layout
decides anything after the restore. Its PIDs live in a PID namespace of its own (runtime/criu.py),
so ranks of two parts never collide on one host. Its virtual group rebuilt nothing at the cut and
builds its inner group anew at the resume: the shared area and the host chain come from the host
keys the ranks all-gather then, where they now run (runtime/vpg.py InnerGroup), and every path
reduces in rank order (the same bits on 1, 2 or 4 hosts). Its cores are the restoring host's (the
resume file's DeviceMap), and so are gloo's bind address, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK
and GROUP_RANK in its os.environ (protocol.cut.ResumeFile: nodes, node_rank, node_addr), set
before the script goes on. What Meridian promises about the environment: a value the script
COPIED from it before the cut (LOCAL_RANK in a variable) keeps the old layout's number; on CPU
devices nothing of Meridian's depends on it, so training is bit-exact; a script that itself acts
on a copied LOCAL_RANK (each host's local rank 0 writes a file, say) acts on the old layout.
A sandboxed job's private /tmp and /dev/shm: parts merged onto one host put what each saved
into that host's new folders (torch leaves /tmp/torchinductor_<user> on every host: alike, it
merges); a part split over hosts gives each host a copy of what its ranks shared, so what one of
them writes there after the cut, those now on another host no longer see.
Refused by name instead of restored (runtime/engines.py `regroup_refusal`): parts that name
different spool paths (one launcher hosts one spool); merged parts that saved one path of their
private folders differently (one host's folders cannot hold both); a GPU job (its ranks' CUDA
devices were picked by their old LOCAL_RANK, and the GPU map of runtime/criu_cuda.py is made only
onto as many hosts as dumped it: not built for another count).
A GPU job's host moves its ranks' CUDA state into host memory around its own dump, as a job of
one host does (runtime/criu_cuda.py, in dump_host_ranks); its part manifest's meta `cuda_s` says
how long each way took there ([device -> host, host -> device] seconds, null where not taken), and
the leader's checkpoint event says the slowest host's each way (the hosts move at once).

Parts are stored whole: the memory pages of a one-host CRIU checkpoint are deduplicated against
a base (runtime/criu_pages.py), those of a checkpoint spanning hosts are not (not built).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from protocol.cut import MAX_SECONDS
from runtime import rank_logs
from runtime import store as checkpoint_store
from runtime.multihost import blocks_problem, node_ranks

PART_PREFIX = "node"


class PartError(checkpoint_store.CheckpointError):
    """A host's part of a checkpoint spanning hosts is missing or not what it must be."""


def part_dir(root, node: int) -> Path:
    """Returns the folder of node `node`'s part under a checkpoint (or its staging folder)."""
    return Path(root) / f"{PART_PREFIX}{node}"


def other_parts(*, nodes: int, node_rank: int) -> frozenset[str]:
    """The folder names of the parts node `node_rank` of `nodes` neither restores nor checks at a
    resume from a checkpoint dumped on `nodes` hosts (criu_parts.unread_parts when as many restore
    it): the other hosts'."""
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
    cuda_s = launcher.cuda_stage_s  # set by dump_host_ranks: None when no rank here held a GPU
    checkpoint_store.write_manifest(part, files, meta={
        "node": launcher.node_rank, "ranks": [process.rank for process in launcher.ranks],
        "request_id": request.id, "step": step, "spool": str(launcher.spool), "left_out": list(left_out),
        "cuda_s": list(cuda_s) if cuda_s is not None else None})
    checkpoint_store.fsync_dir(staging)
    return checkpoint_store.manifest_sha256(part)


@dataclass(frozen=True)
class VerifiedParts:
    """What the leader learns from the parts it checked: what they left out (each line prefixed
    "node k: "), and the CUDA stages of the slowest host each way ((device -> host, host -> device)
    seconds, None where no host took one; None when no host's ranks held a GPU)."""
    left_out: tuple[str, ...]
    cuda_s: tuple[float | None, float | None] | None


def _part_cuda_s(node: int, value) -> tuple[float | None, float | None] | None:
    """Part meta `cuda_s` of node `node`, checked (another host wrote it: typed, and bounded as the
    checkpoint event's own device_out / device_in are, protocol.launch.CheckpointSeconds)."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 2 or not all(
            seconds is None or (isinstance(seconds, int | float) and not isinstance(seconds, bool)
                                and 0 <= seconds <= MAX_SECONDS) for seconds in value):
        raise PartError(f"node {node}'s part manifest has a cuda_s that is not [seconds or null, seconds or "
                        f"null] (0 to {MAX_SECONDS:.0f} s): {str(value)[:80]}")
    return (value[0], value[1])


def _slowest(stages: list[tuple[float | None, float | None]]) -> tuple[float | None, float | None] | None:
    if not stages:
        return None
    out = [stage[0] for stage in stages if stage[0] is not None]
    back = [stage[1] for stage in stages if stage[1] is not None]
    return (max(out) if out else None, max(back) if back else None)


def verify_parts(staging, *, blocks: Sequence[range], request_id: int, step: int,
                 reported: dict[int, str | None]) -> VerifiedParts:
    """Checks that `staging` holds the part of every node 0..N-1 (N = len(blocks), node k's block of
    ranks blocks[k]) as the module docstring says, node k's manifest with sha256 `reported[k]`, and
    nothing else. Returns what the parts left out and their CUDA stages (VerifiedParts); raises
    PartError naming the first node whose part is missing or bad, and why."""
    staging = Path(staging)
    nodes = len(blocks)
    left_out: list[str] = []
    cuda_stages: list[tuple[float | None, float | None]] = []
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
        want = {"node": node, "ranks": list(blocks[node]),
                "request_id": request_id, "step": step}
        wrong = {key: meta.get(key) for key, value in want.items() if meta.get(key) != value}
        if wrong:
            raise PartError(f"node {node}'s part is not the one of this cut: it says {wrong}, "
                            f"the cut is {want}")
        notes = meta.get("left_out") or []
        if not isinstance(notes, list) or not all(isinstance(note, str) for note in notes):
            raise PartError(f"node {node}'s part manifest has a left_out that is not a list of lines")
        left_out.extend(f"node {node}: {note}" for note in notes)
        stage = _part_cuda_s(node, meta.get("cuda_s"))
        if stage is not None:
            cuda_stages.append(stage)
    if strays:
        raise PartError(f"the checkpoint's staging folder holds {strays[:5]} besides the parts of its "
                        f"{nodes} nodes")
    return VerifiedParts(left_out=tuple(left_out), cuda_s=_slowest(cuda_stages))


def part_spool(ref_path, node: int) -> str | None:
    """Returns the spool path node `node`'s ranks had when they were dumped (its part manifest's
    meta; the store verified the checkpoint before), or None when it names none."""
    manifest = checkpoint_store.read_manifest(part_dir(ref_path, node))
    spool = (manifest.get("meta") or {}).get("spool")
    return spool if isinstance(spool, str) else None


def dumped_nodes(meta: dict) -> int:
    """Returns how many hosts dumped the CRIU checkpoint of manifest meta `meta` (1: no parts)."""
    nodes = meta.get("nodes") or 1
    return nodes if isinstance(nodes, int) and not isinstance(nodes, bool) and nodes >= 1 else 1


def dumped_blocks(meta: dict, *, world_size: int) -> tuple[range, ...]:
    """Returns each dumping host's block of ranks, in node order, for the checkpoint of manifest
    meta `meta`: its `blocks` ([[first rank, ranks], ...], written since hosts may hold unequal
    shares), else the equal W/N blocks of `nodes` hosts (a checkpoint from before); (range(W),)
    when one host dumped it. Raises PartError when they do not tile 0..W-1 in node order, or
    when `nodes` does not divide W and no blocks are named."""
    dumped = dumped_nodes(meta)
    if dumped == 1:
        return (range(world_size),)
    named = meta.get("blocks")
    if named is None:
        try:
            return tuple(node_ranks(world_size=world_size, nodes=dumped, node_rank=node) for node in range(dumped))
        except ValueError as exc:
            raise PartError(f"the checkpoint says {dumped} hosts dumped it, which does not fit its "
                            f"{world_size} ranks: {exc}") from None
    if not (isinstance(named, list) and len(named) == dumped
            and all(isinstance(pair, list) and len(pair) == 2
                    and all(isinstance(n, int) and not isinstance(n, bool) for n in pair) for pair in named)):
        raise PartError(f"the checkpoint's blocks {str(named)[:200]} are not [first rank, ranks] for each of "
                        f"its {dumped} hosts")
    blocks = tuple(range(first, first + count) for first, count in named)
    problem = blocks_problem(dict(enumerate(blocks)), world_size=world_size, nodes=dumped)
    if problem is not None or any(len(block) < 1 for block in blocks):
        raise PartError(f"the checkpoint's blocks {named} do not fit its {world_size} ranks: "
                        f"{problem or 'an empty block'}")
    return blocks


def parts_read(*, blocks: Sequence[range], ranks: range) -> tuple[int, ...]:
    """Returns the parts (dumped node numbers, node k having dumped blocks[k]) that hold any of
    `ranks`, the ranks a host restores; () when one host dumped the checkpoint (no parts)."""
    if len(blocks) == 1:
        return ()
    return tuple(node for node, block in enumerate(blocks) if block.start < ranks.stop and ranks.start < block.stop)


def unread_parts(meta: dict, *, world_size: int, ranks: range) -> frozenset[str]:
    """The folder names of the parts a host restoring the ranks `ranks` neither restores nor checks
    at a resume from the checkpoint of manifest meta `meta` (CheckpointStore.skip_parts_of): the
    parts of ranks other hosts restore. A meta whose blocks do not fit the job skips nothing (the
    restore then refuses it)."""
    try:
        blocks = dumped_blocks(meta, world_size=world_size)
    except PartError:
        return frozenset()
    read = parts_read(blocks=blocks, ranks=ranks)
    if not read:
        return frozenset()  # no parts: everything is this host's to check
    return frozenset(part_dir("", node).name for node in range(len(blocks)) if node not in read)


@dataclass(frozen=True)
class RestoreSource:
    """One folder a host restores ranks from: a part, or a checkpoint one host dumped."""

    folder: Path  # holds rank<r>/ (CRIU's images), logs/, a sandboxed job's private-*.tar
    ranks: tuple[int, ...]  # the ranks restored from it on this host
    dumped_ranks: tuple[int, ...]  # every rank dumped into it (more than `ranks`: the part is split)
    spool: str | None  # the spool path its ranks had when they were dumped


@dataclass(frozen=True)
class RestoreSources:
    """What node `node_rank` of a new launch restores of a CRIU checkpoint, and from where."""

    sources: tuple[RestoreSource, ...]
    dumped: int  # how many hosts dumped the checkpoint

    @property
    def regrouped(self) -> bool:
        """True when the ranks restored on this host are not exactly the ranks one host dumped
        (parts merged, or a part split): the host count changed."""
        return len(self.sources) != 1 or self.sources[0].ranks != self.sources[0].dumped_ranks

    @property
    def spool(self) -> str | None:
        """The one spool path every source's ranks had (None: none named)."""
        return self.sources[0].spool

    def images_of(self, rank: int) -> Path:
        return next(source.folder for source in self.sources if rank in source.ranks)


def restore_sources(ref_path, meta: dict, *, world_size: int, ranks: range) -> RestoreSources:
    """Returns where the host that restores the ranks `ranks` (its block) finds each of them in the
    checkpoint at `ref_path` (verified by the store), its manifest meta `meta`. Raises PartError
    when the checkpoint's blocks do not fit its ranks, when a part it needs names no usable
    manifest, or when the sources name different spool paths (a restored rank goes on using its
    own, and one launcher hosts one spool)."""
    dumped = dumped_nodes(meta)
    mine = tuple(ranks)
    if dumped == 1:
        spool = meta.get("spool")
        return RestoreSources(sources=(RestoreSource(folder=Path(ref_path), ranks=mine,
                                                     dumped_ranks=tuple(range(world_size)),
                                                     spool=spool if isinstance(spool, str) else None),),
                              dumped=1)
    blocks = dumped_blocks(meta, world_size=world_size)
    sources = []
    for part in parts_read(blocks=blocks, ranks=ranks):
        try:
            spool = part_spool(ref_path, part)
        except checkpoint_store.CheckpointError as exc:
            raise PartError(f"no usable part for node {part}: {exc}") from None
        dumped_ranks = tuple(blocks[part])
        sources.append(RestoreSource(folder=part_dir(ref_path, part), spool=spool, dumped_ranks=dumped_ranks,
                                     ranks=tuple(rank for rank in mine if rank in dumped_ranks)))
    spools = sorted({str(source.spool) for source in sources})
    if len(spools) > 1:
        raise PartError(f"the parts this host restores ({', '.join(source.folder.name for source in sources)}) "
                        f"were dumped with different spool paths {spools}: a restored rank goes on using its "
                        "own, and one launcher hosts one spool; restore them onto as many hosts as dumped them")
    return RestoreSources(sources=tuple(sources), dumped=dumped)
