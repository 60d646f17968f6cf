"""Bundles and workspaces: upload throughput through the real API, and what saving a job's
workspace costs at a checkpoint (first save, unchanged, one file changed).

    .venv/bin/python bench/bundles_workspace.py [--sizes-mb 1,16,64,200] [--workspace-mb 256] [--files 200]

Upload: a project folder holding one incompressible file of each size is packed
(protocol.bundle.pack), then sent with the CLI's path (HEAD, then PUT /api/bundles/<sha256>/)
to a real control plane (uvicorn + Django + SQLite, the e2e harness's stack, on this machine:
loopback, so the figure is the server's receive + hash + check + store, not a network's).
A second send of the same bundle is a HEAD only (stored once).

Workspace: runtime/workspace.Workspace.persist on a workspace of --files files totalling
--workspace-mb MB, into an object store on the same disk: the first save (everything is
copied), an unchanged save (stat only: nothing read, nothing copied), one file rewritten.
"""
import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "e2e"))


def table(rows, headers):
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows)]
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def bench_upload(sizes_mb, scratch):
    from harness import ControlPlane, prepare_database

    from cli.client import Client
    from cli.commands import bundle_upload
    from protocol import bundle

    env_dir = scratch / "db"
    env_dir.mkdir()
    env = {**os.environ, "MERIDIAN_DATA_DIR": str(env_dir), "DATABASE_URL": f"sqlite:///{env_dir / 'db.sqlite3'}",
           "DJANGO_SETTINGS_MODULE": "portal.settings"}
    env.pop("MERIDIAN_PROFILE", None)
    prepare_database(env)
    plane = ControlPlane(scratch / "cp", env={"MERIDIAN_BUNDLE_MAX_BYTES": str(1 << 31),
                                              "MERIDIAN_BUNDLE_MAX_UNPACKED_BYTES": str(1 << 31)})
    rows = []
    try:
        plane.start(template_db=env_dir / "db.sqlite3")
        client = Client(plane.url, plane.token("alice"))
        for size_mb in sizes_mb:
            project = scratch / f"project-{size_mb}"
            project.mkdir()
            (project / "train.py").write_text("print('x')\n")
            with open(project / "weights.bin", "wb") as handle:
                for _ in range(size_mb):
                    handle.write(os.urandom(1 << 20))
            archive = scratch / f"b-{size_mb}.tar.gz"
            began = time.perf_counter()
            digest, archive_bytes, _ = bundle.pack(project, archive, max_unpacked_bytes=1 << 31,
                                                   max_archive_bytes=1 << 31)
            pack_s = time.perf_counter() - began
            began = time.perf_counter()
            sent = bundle_upload(client, archive, digest)
            upload_s = time.perf_counter() - began
            began = time.perf_counter()
            again = bundle_upload(client, archive, digest)
            again_s = time.perf_counter() - began
            assert sent and not again
            rows.append([size_mb, f"{archive_bytes / 1e6:.1f}", f"{pack_s:.2f}", f"{upload_s:.2f}",
                         f"{archive_bytes / 1e6 / upload_s:.0f}", f"{again_s * 1000:.0f}"])
            shutil.rmtree(project)
            archive.unlink()
    finally:
        plane.stop()
    print("\nUpload through the API (HEAD + PUT /api/bundles/<sha256>/, loopback, uvicorn)")
    table(rows, ["file MB", "archive MB", "pack s", "upload s", "upload MB/s", "re-send ms (HEAD only)"])


def bench_workspace(total_mb, files, scratch):
    from runtime.workspace import Workspace

    workspace = Workspace(scratch / "ws", scratch / "outputs", cache=scratch / "cache.json")
    workspace.path.mkdir()
    per_file = max(1, (total_mb << 20) // files)
    for i in range(files):
        (workspace.path / f"f{i:04d}.bin").write_bytes(os.urandom(per_file))
    rows = []
    for label, change in (("first save", None), ("unchanged", None), ("1 file rewritten", "f0000.bin"),
                          ("10% of files rewritten", "10%")):
        if change == "10%":
            for i in range(0, files, 10):
                (workspace.path / f"f{i:04d}.bin").write_bytes(os.urandom(per_file))
        elif change:
            (workspace.path / change).write_bytes(os.urandom(per_file))
        began = time.perf_counter()
        manifest = workspace.persist()
        seconds = time.perf_counter() - began
        rows.append([label, f"{manifest['bytes'] / 1e6:.0f}", manifest["copied_files"],
                     f"{manifest['copied_bytes'] / 1e6:.1f}", f"{seconds * 1000:.0f}"])
    print(f"\nWorkspace saved at a checkpoint ({files} files, {total_mb} MB; object store on the same disk)")
    table(rows, ["save", "workspace MB", "files copied", "MB copied", "ms"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes-mb", default="1,16,64,200")
    parser.add_argument("--workspace-mb", type=int, default=256)
    parser.add_argument("--files", type=int, default=200)
    parser.add_argument("--skip-upload", action="store_true")
    args = parser.parse_args()
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="mer-bench-", dir="/tmp"))
    try:
        bench_workspace(args.workspace_mb, args.files, scratch)
        if not args.skip_upload:
            bench_upload([int(s) for s in args.sizes_mb.split(",")], scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
