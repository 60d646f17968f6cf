"""The launcher saves a job's workspace as root while the job may still run: what it reads must be
what the job wrote, never a node's file reached through a link or a hard link."""
import os

import pytest

from runtime.workspace import Workspace, WorkspaceError, open_as_scanned, scan

JOB_UID = 1_000_123

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to a job uid needs root")


@needs_root
def test_a_file_the_workspace_owner_does_not_own_is_never_saved(tmp_path):
    secret = tmp_path / "node-token"
    secret.write_text("the node's token")
    ws = Workspace(tmp_path / "ws", tmp_path / "outputs")
    ws.path.mkdir()
    os.chown(ws.path, JOB_UID, JOB_UID)
    mine = ws.path / "result.txt"
    mine.write_text("the job's result")
    os.chown(mine, JOB_UID, JOB_UID)
    os.link(secret, ws.path / "token-link")  # a hard link: a regular file, root's

    with pytest.raises(WorkspaceError, match="token-link"):
        ws.persist()
    assert not (tmp_path / "outputs" / "objects").exists() or not any(
        p.read_bytes() == b"the node's token" for p in (tmp_path / "outputs").rglob("*") if p.is_file())


def test_a_file_swapped_for_a_link_after_the_scan_is_refused(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("the node's secret")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("the job's output")
    scanned = scan(ws)
    (ws / "a.txt").unlink()
    (ws / "a.txt").symlink_to(secret)

    with pytest.raises(WorkspaceError, match="a.txt"):
        open_as_scanned(ws / "a.txt", scanned["a.txt"])


def test_a_folder_swapped_for_a_link_after_the_scan_is_refused(tmp_path):
    node = tmp_path / "node"
    node.mkdir()
    (node / "f.txt").write_text("the node's file")
    ws = tmp_path / "ws"
    (ws / "d").mkdir(parents=True)
    (ws / "d" / "f.txt").write_text("the job's output")
    scanned = scan(ws)
    (ws / "d").rename(tmp_path / "moved")
    (ws / "d").symlink_to(node)

    with pytest.raises(WorkspaceError, match="changed"):
        open_as_scanned(ws / "d" / "f.txt", scanned["d/f.txt"])


def test_an_unchanged_file_opens_as_scanned(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "a.txt").write_text("the job's output")
    with open_as_scanned(ws / "a.txt", scan(ws)["a.txt"]) as handle:
        assert handle.read() == b"the job's output"
