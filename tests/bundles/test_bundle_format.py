"""protocol/bundle.py: packing a project directory and unpacking a bundle safely.

Every malicious archive is built by hand with tarfile (as an attacker would), then refused by
both `check` (the control plane, at upload) and `unpack` (the agent), writing nothing outside."""
import gzip
import io
import os
import tarfile

import pytest

from protocol import bundle
from protocol.bundle import BundleError


def _archive(tmp_path, members, name="evil.tar.gz"):
    """members: list of (TarInfo, bytes | None)."""
    path = tmp_path / name
    with tarfile.open(path, "w:gz") as archive:
        for info, content in members:
            if content is not None:
                info.size = len(content)
                archive.addfile(info, io.BytesIO(content))
            else:
                archive.addfile(info)
    return path


def _info(name, kind=tarfile.REGTYPE, linkname=""):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.mode = 0o644
    return info


def _project(tmp_path):
    root = tmp_path / "project"
    (root / "data").mkdir(parents=True)
    (root / "train.py").write_text("print('hi')\n")
    (root / "data" / "input.txt").write_text("1 2 3\n")
    (root / "outputs").mkdir()
    (root / "outputs" / "old.bin").write_bytes(b"x" * 10)
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".gitignore").write_text("outputs/\n*.log\n")
    (root / "run.log").write_text("noise")
    (root / ".meridianignore").write_text("secret.env\n")
    (root / "secret.env").write_text("TOKEN=1")
    (root / "link-to-data").symlink_to("data/input.txt")
    return root


def test_it_packs_a_project_honouring_gitignore_and_meridianignore(tmp_path):
    root = _project(tmp_path)
    digest, size, files = bundle.pack(root, tmp_path / "b.tar.gz")
    names = {f.rel for f in files}
    assert {"train.py", "data", "data/input.txt", ".gitignore", ".meridianignore", "link-to-data"} <= names
    assert not names & {"outputs", "outputs/old.bin", ".git", ".git/HEAD", "run.log", "secret.env"}
    assert bundle.is_sha256(digest) and size == (tmp_path / "b.tar.gz").stat().st_size
    out = tmp_path / "ws"
    bundle.unpack(tmp_path / "b.tar.gz", out, expected_sha256=digest)
    assert (out / "data" / "input.txt").read_text() == "1 2 3\n"
    assert os.readlink(out / "link-to-data") == "data/input.txt"


def test_packing_is_deterministic_so_the_same_tree_has_the_same_digest(tmp_path):
    root = _project(tmp_path)
    first, _, _ = bundle.pack(root, tmp_path / "a.tar.gz")
    os.utime(root / "train.py", (1, 1))  # only the mtime changes
    second, _, _ = bundle.pack(root, tmp_path / "b.tar.gz")
    assert first == second
    (root / "train.py").write_text("print('changed')\n")
    assert bundle.pack(root, tmp_path / "c.tar.gz")[0] != first


def test_include_brings_back_an_ignored_file_and_exclude_drops_one(tmp_path):
    root = _project(tmp_path)
    files = {f.rel for f in bundle.select_files(root, include=["run.log"], exclude=["data/"])}
    assert "run.log" in files and "data/input.txt" not in files


def test_above_the_size_limit_the_error_names_the_biggest_files(tmp_path):
    root = _project(tmp_path)
    (root / "weights.pt").write_bytes(b"\0" * 50_000)
    with pytest.raises(BundleError, match=r"weights\.pt \(48\.8 KiB\).*\.meridianignore"):
        bundle.pack(root, tmp_path / "b.tar.gz", max_unpacked_bytes=20_000)
    assert not (tmp_path / "b.tar.gz").exists()


def test_a_symlink_leaving_the_project_is_refused_when_packing(tmp_path):
    root = _project(tmp_path)
    (root / "escape").symlink_to("../../etc/passwd")
    with pytest.raises(BundleError, match="escape"):
        bundle.pack(root, tmp_path / "b.tar.gz")


MALICIOUS = [
    ("absolute path", [(_info("/tmp/owned"), b"x")], "absolute path"),
    ("dot-dot", [(_info("a/../../owned"), b"x")], r"'\.\.' component"),
    ("symlink out", [(_info("out", tarfile.SYMTYPE, "../../etc"), None)], "leaves the bundle"),
    ("absolute symlink", [(_info("out", tarfile.SYMTYPE, "/etc/passwd"), None)], "outside the bundle"),
    ("write through a symlink", [(_info("d", tarfile.SYMTYPE, "."), None), (_info("d/x"), b"x")],
     "lies under the symlink"),
    ("hardlink out", [(_info("h", tarfile.LNKTYPE, "/etc/shadow"), None)], "hard link"),
    ("hardlink inside", [(_info("a"), b"x"), (_info("h", tarfile.LNKTYPE, "a"), None)], "hard link"),
    ("device file", [(_info("dev", tarfile.CHRTYPE), None)], "device or FIFO"),
    ("fifo", [(_info("fifo", tarfile.FIFOTYPE), None)], "device or FIFO"),
    ("duplicate", [(_info("a"), b"x"), (_info("a"), b"y")], "appears twice"),
]


@pytest.mark.parametrize("members,message", [(m, msg) for _, m, msg in MALICIOUS], ids=[i for i, _, _ in MALICIOUS])
def test_a_malicious_archive_is_refused_and_writes_nothing_outside(tmp_path, members, message):
    path = _archive(tmp_path, members)
    with pytest.raises(BundleError, match=message):
        bundle.check(path)
    dest = tmp_path / "ws" / "job"
    with pytest.raises(BundleError, match=message):
        bundle.unpack(path, dest)
    outside = {p.name for p in tmp_path.iterdir()}
    assert outside == {"evil.tar.gz", "ws"}
    assert not (tmp_path / "owned").exists() and not os.path.lexists("/tmp/owned")


def test_too_many_entries_is_refused(tmp_path):
    path = _archive(tmp_path, [(_info(f"f{i}"), b"") for i in range(50)])
    with pytest.raises(BundleError, match="more than 40 members"):
        bundle.check(path, max_entries=40)
    with pytest.raises(BundleError, match="more than 40 members"):
        bundle.unpack(path, tmp_path / "ws", max_entries=40)


def test_a_bomb_that_unpacks_beyond_the_limit_is_refused(tmp_path):
    # 20 MB of zeros compress to ~20 KB: the declared sizes add up past the bound.
    path = _archive(tmp_path, [(_info("zeros"), b"\0" * (20 << 20))])
    assert path.stat().st_size < 100_000
    with pytest.raises(BundleError, match="unpacks to more than"):
        bundle.unpack(path, tmp_path / "ws", max_bytes=1 << 20)
    assert not (tmp_path / "ws" / "zeros").exists()


def test_a_digest_mismatch_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "b.tar.gz"
    path.write_bytes(bundle.pack_bytes({"train.py": b"print(1)\n"}))
    with pytest.raises(BundleError, match="damaged or replaced"):
        bundle.unpack(path, tmp_path / "ws", expected_sha256="0" * 64)
    assert not (tmp_path / "ws").exists() or not any((tmp_path / "ws").iterdir())


def test_something_that_is_not_a_gzip_tar_is_a_clear_error(tmp_path):
    path = tmp_path / "b.zip"
    path.write_bytes(b"PK\x03\x04 not a tar")
    with pytest.raises(BundleError, match="not a gzip-compressed tar"):
        bundle.check(path)
    truncated = tmp_path / "t.tar.gz"
    truncated.write_bytes(gzip.compress(b"\0" * 10)[:15])
    with pytest.raises(BundleError):
        bundle.check(truncated)
