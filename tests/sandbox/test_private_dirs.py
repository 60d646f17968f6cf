"""A sandboxed job's /tmp and /dev/shm are its own on each node: shared by its ranks on that host,
out of every other job's sight and out of the node's, and gone when its ranks are.

Measured on the landed code before this: every sandboxed job's ranks used the node's /tmp and
/dev/shm; a second job read what the first had written into both (its files are 0644), and both
saw the files the agent (root) had left there."""
import json
import os
import signal
import socket
import subprocess
import sys
import uuid

import pytest
from polling import poll
from sandbox_helpers import ROOT, SCRIPTS, UID_BASE, entry, make_node, needs_sandbox, outcome, probe_report, workspace

from runtime import private_dirs
from runtime import sandbox as mechanisms

pytestmark = [pytest.mark.runtime, needs_sandbox]
PROBE = SCRIPTS / "private_dirs_probe.py"


@pytest.fixture
def node_files():
    """Files the agent (root) left in the node's /tmp and /dev/shm, readable by anyone who sees them."""
    paths = [os.path.join(folder, f"meridian-test-agent-{uuid.uuid4().hex[:8]}") for folder in ("/tmp", "/dev/shm")]
    for path in paths:
        with open(path, "w") as handle:
            handle.write("the agent's")
        os.chmod(path, 0o644)
    yield paths
    for path in paths:
        os.unlink(path)


def _private_paths(job_dir):
    """Returns the node paths of a launcher's private /tmp and /dev/shm (its launcher.json; None
    where it names none)."""
    info = poll(f"{job_dir}/launcher.json", lambda: json.loads((job_dir / "launcher.json").read_text())
                if (job_dir / "launcher.json").exists() else None)
    return info.get("private_tmp"), info.get("private_shm")


def _bound_back_under_tmp(node_root):
    """The names a sandboxed job sees in its /tmp: the node's folders it needs that live under the
    node's /tmp, bound back at their own paths (the test's node; the checkout itself, with the
    probe script, when it was cloned under /tmp)."""
    names = {node_root.name}
    if ROOT.resolve().parts[:2] == ("/", "tmp") and len(ROOT.resolve().parts) > 2:
        names.add(ROOT.resolve().parts[2])
    return names


def _exists(*paths):
    return [path is not None and os.path.exists(path) for path in paths]


def test_a_jobs_tmp_and_dev_shm_are_its_own_and_gone_when_it_ends(node_root, node_files):
    """Job 121 writes a secret into its /tmp and /dev/shm; job 122, on the same node at the same time,
    finds neither, nor the agent's files; 122's directories are gone when it finishes, 121's when the
    agent kills it (its launcher could not remove them: the agent does)."""
    work, store = node_root / "w", node_root / "store"
    node = make_node(work)
    space_a, space_b = workspace(work, 121), workspace(work, 122)
    secrets = ["/tmp/secret-a-rank0", "/dev/shm/secret-a-rank0"]
    try:
        node.reconcile([first := entry(121, store, script=PROBE, args=["a", "--sleep", "120", *node_files])])
        seen_a = probe_report(space_a / "a-rank0.json")
        tmp_a, shm_a = _private_paths(node.jobs[121].job_dir)
        # on the node, where job 121's secrets are while it runs: in its own folders
        owners_a = [os.stat(os.path.join(folder, "secret-a-rank0")).st_uid if folder else None
                    for folder in (tmp_a, shm_a)]
        mode_a = os.stat(shm_a).st_mode & 0o7777 if shm_a else None
        node.reconcile([first, entry(122, store, script=PROBE, args=["b", *secrets, *node_files], indices=(1,))])
        finished = outcome(node, 122)
        assert finished["state"] == "finished", finished.get("error")
        tmp_b, shm_b = _private_paths(node.jobs[122].job_dir)
        left_b = _exists(tmp_b, shm_b)  # the launcher removed them
        assert node.fence([121], why="the test is over") == [121]
        left_a = _exists(tmp_a, shm_a)  # the agent did, after the kill (the launcher could not)
    finally:
        node.kill_all()
    seen_b = probe_report(space_b / "b-rank0.json")
    assert {path: seen_b["reads"][path][:9] for path in secrets + node_files} == dict.fromkeys(
        secrets + node_files, "refused:2")  # ENOENT: not there at all
    assert seen_b["shm"] == ["secret-b-rank0"]
    # what the node's /tmp shows: only the way to the job's spool, workspace and store (the test's
    # node lives in /tmp), bound back at their own paths
    assert set(seen_b["tmp"]) == {"secret-b-rank0", *_bound_back_under_tmp(node_root)}
    assert seen_a["reads"] == {path: "refused:2" for path in node_files}
    assert seen_a["shm"] == ["secret-a-rank0"]
    assert set(seen_a["tmp"]) == {"secret-a-rank0", *_bound_back_under_tmp(node_root)}
    assert seen_a["tmpdir"] == seen_a["gettempdir"] == "/tmp"
    assert "private /tmp and /dev/shm" in finished["sandbox"]
    assert owners_a == [mechanisms.identity_for_job(121, base=UID_BASE).uid] * 2
    assert mode_a == private_dirs.DIR_MODE
    assert left_a == left_b == [False, False]


def test_the_ranks_of_one_job_share_one_dev_shm_and_reduce_through_it(node_root, node_files):
    """A 2-rank job: each rank finds the other's /dev/shm file and the all-reduce goes through the
    shared-memory area (runtime/localreduce.py), as it does unsandboxed; the node's files are not there."""
    work, store = node_root / "w", node_root / "store"
    node = make_node(work)
    space = workspace(work, 131)
    try:
        node.reconcile([entry(131, store, script=PROBE, args=["pair"], world_size=2, indices=(0, 1))])
        report = outcome(node, 131)
        assert report["state"] == "finished", report.get("error")
        tmp, shm = _private_paths(node.jobs[131].job_dir)
    finally:
        node.kill_all()
    ranks = [probe_report(space / f"pair-rank{rank}.json") for rank in (0, 1)]
    for seen in ranks:
        assert seen["allreduce"] == 3.0 and seen["local_area"] is True
        assert {"secret-pair-rank0", "secret-pair-rank1"} <= set(seen["shm"])
        assert not {os.path.basename(path) for path in node_files} & set(seen["shm"] + seen["tmp"])
    assert ranks[0]["shm_ids"] == ranks[1]["shm_ids"] and ranks[0]["tmp_ids"] == ranks[1]["tmp_ids"]
    assert tmp is not None and shm is not None and _exists(tmp, shm) == [False, False]


HOLDER = """
import sys, time
from runtime.private_dirs import PrivateDirs
dirs = PrivateDirs.create(job_dir=sys.argv[1], job_id=sys.argv[2], gid=int(sys.argv[3]), keep=[])
print(dirs.shm, flush=True)
time.sleep(600)
"""


def test_a_killed_launchers_private_dev_shm_is_swept_and_a_live_ones_is_not(tmp_path):
    """What a launcher killed with SIGKILL left in /dev/shm goes at the next sweep (the next sandboxed
    launcher's start, the agent's start, the agent's kill of a job); a live launcher's stays."""
    holders, shm = [], []
    try:
        for name in ("killed", "alive"):
            (tmp_path / name).mkdir()
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / name), f"sweep-{name}", "4242"],
                                      cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                                      text=True)
            holders.append(holder)
            shm.append(holder.stdout.readline().strip())
        assert all(os.path.isdir(path) for path in shm)
        holders[0].send_signal(signal.SIGKILL)
        holders[0].wait()
        swept = private_dirs.sweep()
        assert shm[0] in swept and not os.path.exists(shm[0])
        assert shm[1] not in swept and os.path.isdir(shm[1])
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()
    assert shm[1] in private_dirs.sweep()


def test_what_a_job_writes_to_its_tmp_counts_against_its_workspace_quota(node_root):
    """Its private /tmp is on the node's disk: without a bound, a job could fill the node's disk
    through /tmp while its workspace stayed under quota."""
    work, store = node_root / "w", node_root / "store"
    node = make_node(work)
    workspace(work, 131)
    try:
        node.reconcile([{**entry(131, store, script=SCRIPTS / "fill_tmp.py"), "workspace_quota_bytes": 100_000}])
        ended = outcome(node, 131)
    finally:
        node.kill_all()
    assert ended["state"] == "failed"
    assert "workspace and /tmp hold" in ended["error"] and "above its quota of 97.7 KiB" in ended["error"], ended
    assert "/tmp/huge.bin (195.3 KiB)" in ended["error"], ended


def test_what_the_ranks_left_in_their_private_folders_travels_with_owners_and_modes(node_root):
    """A CRIU checkpoint carries both folders (PrivateDirs.save_into) and a restore puts them into
    the new ones (load_from), owners and modes kept; what cannot travel is refused, naming it: a
    link leading outside the folder, a file of another uid (a hard link to a file of the node's)."""
    uid = gid = 1_650_001
    os.mkdir(node_root / "a")
    os.mkdir(node_root / "b")
    old = private_dirs.PrivateDirs.create(job_dir=node_root / "a", job_id="t1", gid=gid, keep=[])
    new = private_dirs.PrivateDirs.create(job_dir=node_root / "b", job_id="t2", gid=gid, keep=[])
    checkpoint = node_root / "checkpoint"
    checkpoint.mkdir()
    try:
        (old.tmp / "cache").mkdir(mode=0o700)
        (old.tmp / "cache" / "held.txt").write_text("12 steps\n")
        (old.shm / "area").write_bytes(b"\0" * 4096)
        (old.tmp / "relative-link").symlink_to("cache/held.txt")
        for path in (old.tmp / "cache", old.tmp / "cache" / "held.txt", old.shm / "area", old.tmp / "relative-link"):
            os.lchown(path, uid, gid)
        os.chmod(old.tmp / "cache" / "held.txt", 0o600)
        old.save_into(checkpoint, uid=uid)
        new.load_from(checkpoint)
        held = new.tmp / "cache" / "held.txt"
        assert held.read_text() == "12 steps\n" and (new.shm / "area").stat().st_size == 4096
        assert (held.stat().st_uid, held.stat().st_gid, held.stat().st_mode & 0o777) == (uid, gid, 0o600)
        assert (new.tmp / "cache").stat().st_uid == uid and os.readlink(new.tmp / "relative-link") == "cache/held.txt"
        assert (new.tmp.stat().st_uid, new.tmp.stat().st_mode & 0o7777) == (0, private_dirs.DIR_MODE)

        (old.tmp / "escape").symlink_to("/etc/passwd")
        with pytest.raises(private_dirs.PrivateDirsError, match="escape"):
            old.save_into(checkpoint, uid=uid)
        os.unlink(old.tmp / "escape")
        (old.shm / "the-node's").write_text("root's, not the job's")
        os.chown(old.shm / "the-node's", 4242, 4242)
        with pytest.raises(private_dirs.PrivateDirsError, match="belongs to uid 4242"):
            old.save_into(checkpoint, uid=uid)
    finally:
        old.remove()
        new.remove()


LISTENER = """
import socket, sys, time
server = socket.socket(socket.AF_UNIX)
server.bind("/tmp/live.sock")
server.listen()
print("listening", flush=True)
time.sleep(120)
"""


def test_a_stale_socket_file_is_left_out_and_said_and_a_live_one_refuses_the_checkpoint(node_root):
    """A socket file cannot travel as a file (tarfile skipped it without a word). One that a process
    of the job holds bound (a server listening in the job's /tmp, seen there as /tmp/live.sock)
    refuses the checkpoint by name: restored, its clients would find nothing. A stale one (its
    process gone, the file left) does not block the checkpoint: it is left out, and save_into
    returns it with why (the checkpoint's manifest and event carry the line)."""
    uid = gid = 1_650_002
    os.mkdir(node_root / "a")
    os.mkdir(node_root / "b")
    keep = [os.path.dirname(os.path.realpath(sys.executable)), sys.prefix, sys.base_prefix]
    old = private_dirs.PrivateDirs.create(job_dir=node_root / "a", job_id="s1", gid=gid, keep=keep)
    new = private_dirs.PrivateDirs.create(job_dir=node_root / "b", job_id="s2", gid=gid, keep=keep)
    checkpoint = node_root / "checkpoint"
    checkpoint.mkdir()
    listener = subprocess.Popen([*old.command(), sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "listening"
        stale = socket.socket(socket.AF_UNIX)
        stale.bind(str(old.shm / "stale.sock"))
        stale.close()  # its file stays
        (old.tmp / "kept.txt").write_text("kept")
        for path in (old.tmp / "live.sock", old.shm / "stale.sock", old.tmp / "kept.txt"):
            os.lchown(path, uid, gid)
        held = private_dirs.bound_unix_sockets([listener.pid, os.getpid()])
        assert "/tmp/live.sock" in held, held
        with pytest.raises(private_dirs.PrivateDirsError, match=r"/tmp/live.sock is a unix socket and a process of the "
                                                                 r"job holds it bound .*refused"):
            old.save_into(checkpoint, uid=uid, held_sockets=held)

        listener.kill()
        listener.wait()
        held = private_dirs.bound_unix_sockets([os.getpid()])
        left_out = old.save_into(checkpoint, uid=uid, held_sockets=held)
        assert [line.split(":")[0] for line in left_out] == ["/tmp/live.sock", "/dev/shm/stale.sock"], left_out
        assert all("stale unix socket file" in line for line in left_out)
        new.load_from(checkpoint)
        assert (new.tmp / "kept.txt").read_text() == "kept"
        assert not (new.tmp / "live.sock").exists() and not (new.shm / "stale.sock").exists()
    finally:
        listener.kill()
        listener.wait()
        old.remove()
        new.remove()
