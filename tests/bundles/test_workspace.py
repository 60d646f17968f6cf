"""runtime/workspace.py: a job's workspace saved incrementally with its checkpoints and restored."""
import json
import os

import pytest

from runtime.workspace import Workspace, WorkspaceError, WorkspaceQuotaExceeded, object_path


def _ws(tmp_path, **kwargs):
    return Workspace(tmp_path / "ws", tmp_path / "outputs", cache=tmp_path / "cache.json", **kwargs)


def test_persist_copies_only_what_changed(tmp_path):
    ws = _ws(tmp_path)
    ws.path.mkdir()
    (ws.path / "data.txt").write_text("input")
    (ws.path / "out").mkdir()
    (ws.path / "out" / "big.bin").write_bytes(os.urandom(100_000))
    first = ws.persist()
    assert first["copied_files"] == 2 and first["copied_bytes"] == 100_005
    (ws.path / "out" / "result.txt").write_text("42")
    second = ws.persist()
    assert second["copied_files"] == 1 and second["copied_bytes"] == 2  # big.bin was not copied again
    assert set(second["files"]) == {"data.txt", "out", "out/big.bin", "out/result.txt"}


def test_restore_on_another_node_rebuilds_the_workspace_exactly(tmp_path):
    ws = _ws(tmp_path)
    ws.path.mkdir()
    (ws.path / "model.pt").write_bytes(b"weights")
    (ws.path / "latest").symlink_to("model.pt")
    manifest = ws.persist()
    (ws.path / "after-the-checkpoint.txt").write_text("not in the checkpoint")
    (ws.path / "model.pt").write_bytes(b"changed after")
    other = Workspace(tmp_path / "other-node" / "ws", tmp_path / "outputs")
    counts = other.restore(manifest)
    assert (other.path / "model.pt").read_bytes() == b"weights" and os.readlink(other.path / "latest") == "model.pt"
    counts = ws.restore(manifest)
    assert counts["removed"] == 1 and not (ws.path / "after-the-checkpoint.txt").exists()
    assert (ws.path / "model.pt").read_bytes() == b"weights"


def test_a_damaged_saved_copy_is_refused(tmp_path):
    ws = _ws(tmp_path)
    ws.path.mkdir()
    (ws.path / "a.txt").write_text("good")
    manifest = ws.persist()
    object_path(ws.outputs, manifest["files"]["a.txt"]["sha256"]).write_text("evil")
    with pytest.raises(WorkspaceError, match="a.txt.*damaged"):
        Workspace(tmp_path / "fresh", ws.outputs).restore(manifest)


def test_a_manifest_naming_a_path_outside_is_refused(tmp_path):
    ws = _ws(tmp_path)
    with pytest.raises(WorkspaceError, match="not a path inside"):
        ws.restore({"files": {"../escape": {"size": 1, "sha256": "0" * 64}}})


def test_the_quota_names_the_biggest_files(tmp_path):
    ws = _ws(tmp_path, quota_bytes=1000)
    ws.path.mkdir()
    (ws.path / "huge.bin").write_bytes(b"\0" * 5000)
    with pytest.raises(WorkspaceQuotaExceeded, match=r"huge\.bin \(4\.9 KiB\)"):
        ws.persist()
    assert not (ws.outputs / "objects").exists() or not any((ws.outputs / "objects").rglob("*"))


def test_write_pointer_is_what_a_download_reads(tmp_path):
    ws = _ws(tmp_path)
    ws.path.mkdir()
    (ws.path / "r.txt").write_text("1")
    ws.write_pointer("final.json", ws.persist(), state="finished")
    assert json.loads((ws.outputs / "final.json").read_text())["files"]["r.txt"]["size"] == 1
