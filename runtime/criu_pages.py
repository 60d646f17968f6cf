"""CRIU checkpoints sized to the job: memory pages stored once, against a base checkpoint.

A CRIU dump of a rank is ~230 MB for a 21-parameter model, nearly all of it the pages of the
Python + torch process, and almost none of them change between two checkpoints. CRIU's own
incremental dumps (``--track-mem`` / pre-dump / ``--prev-images-dir``) need the kernel's soft-dirty
page tracking, which this machine kind's kernel does not have (CONFIG_MEM_SOFT_DIRTY off,
FINDINGS-runtime.md), so the pages are deduplicated here, by content, after a plain dump:

    PAGES.json               format, page size, the base (checkpoint name + manifest sha256) or
                             none, and per page image: its page count and its map file
    pages.blob               the pages this checkpoint stores (each distinct page once)
    pages.index              sha256 of each page of pages.blob (32 bytes each): what a later
                             checkpoint looks its pages up in when it takes this one as its base
    rank<r>/pages-<k>.img.map   one int64 per page of CRIU's pages-<k>.img: i >= 0 is page i of
                             this checkpoint's pages.blob, -1-i is page i of the base's pages.blob

Every other CRIU image file is kept as CRIU wrote it. A checkpoint with a base names it in the
store's BASES.json (runtime/store.py): the store records the base's manifest sha256 in this
checkpoint's manifest, verifies the base with it before any restore (a missing or altered base
refuses the restore with its reason), and keeps the base as long as a checkpoint needs it. A
base is always a checkpoint without a base of its own (one level, no chains to walk).

`unpack` rebuilds CRIU's pages-<k>.img files from the two blobs into a local folder that
`criu restore` reads. Pages are matched by their sha256, so a page is reused only where its
bytes are the same (a sha256 collision is not a practical event).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from runtime import store as checkpoint_store

PAGE = 4096
FORMAT = 1
PAGES_JSON = "PAGES.json"
BLOB = "pages.blob"
INDEX = "pages.index"
MAP_SUFFIX = ".map"
DIGEST = 32
# A checkpoint that would store more than this share of its base's bytes becomes a base itself:
# the next ones then reuse its pages (the job's memory drifted away from the old base).
REBASE_FRACTION = 0.5


class PagesError(checkpoint_store.CheckpointError):
    """A deduplicated CRIU checkpoint cannot be packed or rebuilt; the message says why."""


def _page_images(root: Path) -> list[Path]:
    return sorted(root.glob("rank*/pages-*.img"))


def _digests(path: Path) -> list[bytes]:
    """Returns the sha256 digest of every page of `path`."""
    pages = _blob(path)
    view = pages.data.cast("B") if len(pages) else memoryview(b"")
    sha = hashlib.sha256
    return [sha(view[i:i + PAGE]).digest() for i in range(0, len(view), PAGE)]


def read_index(base_dir: Path) -> dict[bytes, int]:
    """Returns {page sha256: page number in the base's pages.blob} of a base checkpoint."""
    raw = (Path(base_dir) / INDEX).read_bytes()
    if len(raw) % DIGEST:
        raise PagesError(f"{base_dir / INDEX}: {len(raw)} bytes is not a list of sha256 digests")
    return {raw[i:i + DIGEST]: i // DIGEST for i in range(0, len(raw), DIGEST)}


def pack(staging, *, base_dir=None, base_name=None, base_manifest_sha256=None) -> dict:
    """See _pack. When packing fails, what it wrote is removed and CRIU's plain images are left
    as they were (the checkpoint can still be stored whole); the error is raised."""
    try:
        return _pack(staging, base_dir=base_dir, base_name=base_name,
                     base_manifest_sha256=base_manifest_sha256)
    except BaseException:
        staging = Path(staging)
        if all(image.exists() for image in _page_images(staging)) and not (staging / PAGES_JSON).exists():
            for path in [staging / BLOB, staging / INDEX, staging / checkpoint_store.BASES_NAME,
                         *staging.glob("rank*/pages-*.img" + MAP_SUFFIX)]:
                path.unlink(missing_ok=True)
        raise


def _pack(staging, *, base_dir=None, base_name=None, base_manifest_sha256=None) -> dict:
    """Replaces CRIU's pages-<k>.img files under `staging` by maps into pages.blob (this
    checkpoint's new pages) and, with a base, the base's pages.blob. Returns what it stored:
    {"pages", "stored_pages", "reused_pages", "base", "rebased"}.

    When the checkpoint would store more than REBASE_FRACTION of the base's pages, it is packed
    without a base instead (and becomes the next checkpoints' base)."""
    staging = Path(staging)
    images = _page_images(staging)
    index: dict[bytes, int] = {}
    base_pages = 0
    if base_dir is not None:
        index = read_index(base_dir)
        base_pages = len(index)
    pending = []  # (image, digests)
    new: dict[bytes, int] = {}
    new_order: list[tuple[int, int]] = []  # (image number, page number) of each new page
    reused = total = 0
    for number, image in enumerate(images):
        digests = _digests(image)
        pending.append((image, digests))
        for page_no, digest in enumerate(digests):
            total += 1
            if digest in index:
                reused += 1
            elif digest not in new:
                new[digest] = len(new_order)
                new_order.append((number, page_no))
    rebased = base_dir is not None and len(new_order) > REBASE_FRACTION * max(base_pages, 1)
    if rebased or base_dir is None:
        index, base_name, base_manifest_sha256 = {}, None, None
        new, new_order = {}, []
        for number, (_, digests) in enumerate(pending):
            for page_no, digest in enumerate(digests):
                if digest not in new:
                    new[digest] = len(new_order)
                    new_order.append((number, page_no))
        reused = 0
    images_meta = {}
    with open(staging / BLOB, "wb") as blob:
        for number, (image, _) in enumerate(pending):
            wanted = np.array([page for n, page in new_order if n == number], dtype=np.int64)
            if wanted.size:
                blob.write(_blob(image)[wanted].tobytes())
        blob.flush()
        os.fsync(blob.fileno())
    if index == {}:  # a base: later checkpoints look their pages up here
        checkpoint_store.write_file_atomic(staging / INDEX, b"".join(new))
    for image, digests in pending:
        mapping = np.fromiter((new[d] if d in new else -1 - index[d] for d in digests),
                              dtype="<i8", count=len(digests))
        rel = image.relative_to(staging).as_posix()
        map_path = image.with_name(image.name + MAP_SUFFIX)
        mapping.tofile(map_path)
        images_meta[rel] = {"pages": len(digests), "map": rel + MAP_SUFFIX}
    base = None if base_name is None else {"name": base_name, "manifest_sha256": base_manifest_sha256}
    payload = {"format": FORMAT, "page_size": PAGE, "base": base, "images": images_meta,
               "blob_pages": len(new_order)}
    if base is not None:
        checkpoint_store.write_bases(staging, [base])
    checkpoint_store.write_file_atomic(staging / PAGES_JSON, json.dumps(payload, indent=1).encode())
    for image, _ in pending:  # only now: until here the plain dump is whole
        image.unlink()
    return {"pages": total, "stored_pages": len(new_order), "reused_pages": reused,
            "base": base_name, "rebased": rebased}


def is_packed(checkpoint_dir) -> bool:
    return (Path(checkpoint_dir) / PAGES_JSON).is_file()


def unpack(checkpoint_dir, dest, manifest: dict, *, ranks=None) -> Path:
    """Rebuilds a verified packed checkpoint's CRIU images into `dest` (a fresh local folder):
    every file but the blobs and maps copied, each pages-<k>.img rebuilt page by page. Its base
    must be the one its manifest pins (`manifest["bases"]`, verified by the store). `ranks`: only
    the folders rank<r>/ of those ranks (a host restoring its share of a one-host checkpoint split
    over hosts: runtime/criu_parts.py), default every file. Raises PagesError when the checkpoint
    does not hold together (a page number out of range, a base other than the pinned one)."""
    wanted = None if ranks is None else {f"rank{rank}" for rank in ranks}

    def skipped(rel: str) -> bool:
        return wanted is not None and rel.split("/", 1)[0] not in wanted

    source = Path(checkpoint_dir)
    dest = Path(dest)
    try:
        layout = json.loads((source / PAGES_JSON).read_bytes())
    except (OSError, ValueError) as exc:
        raise PagesError(f"{source / PAGES_JSON} is unreadable: {exc}") from None
    if layout.get("format") != FORMAT or layout.get("page_size") != PAGE:
        raise PagesError(f"{source / PAGES_JSON}: unknown format {layout.get('format')!r} "
                         f"or page size {layout.get('page_size')!r}")
    pinned = manifest.get("bases") or []
    base = layout.get("base")
    if base is not None and (len(pinned) != 1 or pinned[0] != base):
        raise PagesError(f"{source.name}: its pages refer to base {base.get('name')!r}, which its "
                         f"manifest does not pin (pinned: {pinned}); refusing to restore it")
    if base is None and pinned:
        raise PagesError(f"{source.name}: its manifest pins a base but its pages name none")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for rel in sorted(manifest["files"]):
        if rel in (PAGES_JSON, BLOB, INDEX) or rel.endswith(MAP_SUFFIX) or skipped(rel):
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / rel, target)
    base_blob = source.parent / base["name"] / BLOB if base is not None else None
    for rel, entry in sorted(layout.get("images", {}).items()):
        if not isinstance(entry, dict) or Path(rel).is_absolute() or ".." in Path(rel).parts \
                or entry.get("map") != rel + MAP_SUFFIX:
            raise PagesError(f"{source / PAGES_JSON}: bad image entry {rel!r}")
        if skipped(rel):
            continue
        mapping = np.fromfile(source / entry["map"], dtype="<i8")
        if mapping.size != entry.get("pages"):
            raise PagesError(f"{source / entry['map']}: {mapping.size} pages, PAGES.json says {entry.get('pages')}")
        own_pages, base_pages = _pages_in(source / BLOB), _pages_in(base_blob)
        mine = mapping >= 0
        if (mapping[mine] >= own_pages).any() or ((-1 - mapping[~mine]) >= base_pages).any():
            raise PagesError(f"{source / entry['map']}: a page number lies outside its blob")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        _copy_runs(mapping, source / BLOB, base_blob, target)
    return dest


def _pages_in(path) -> int:
    return 0 if path is None else Path(path).stat().st_size // PAGE


def _copy_runs(mapping: np.ndarray, own_blob: Path, base_blob: Path | None, target: Path) -> None:
    """Writes the pages `mapping` names into `target`, one copy_file_range per run of pages that
    lie one after the other in the same blob (the kernel copies; nothing passes through Python)."""
    n = mapping.size
    with open(target, "wb") as out:
        if n == 0:
            return
        source = (mapping < 0).astype(np.int8)  # 0: own blob, 1: base blob
        page = np.where(mapping >= 0, mapping, -1 - mapping)
        breaks = np.flatnonzero((np.diff(source) != 0) | (np.diff(page) != 1)) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [n]))
        fds = {0: os.open(own_blob, os.O_RDONLY)}
        try:
            if base_blob is not None:
                fds[1] = os.open(base_blob, os.O_RDONLY)
            for start, end in zip(starts.tolist(), ends.tolist()):
                src = fds[int(source[start])]
                offset, length, at = int(page[start]) * PAGE, (end - start) * PAGE, start * PAGE
                while length:
                    copied = _copy_range(src, out.fileno(), length, offset, at)
                    if copied <= 0:
                        raise PagesError(f"{target}: short copy from its blob")
                    offset, at, length = offset + copied, at + copied, length - copied
        finally:
            for fd in fds.values():
                os.close(fd)


def _copy_range(src: int, dst: int, length: int, offset: int, at: int) -> int:
    """copy_file_range, or a read and a write where the kernel refuses it between the two files'
    filesystems (EXDEV: found restoring from a store mounted apart from the job's folder, as a
    shared store on a fleet is; tests/hosts/test_multihost_criu.py). Returns the bytes copied."""
    try:
        return os.copy_file_range(src, dst, length, offset, at)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS):
            raise
    chunk = os.pread(src, min(length, 8 << 20), offset)
    return os.pwrite(dst, chunk, at) if chunk else 0


def _blob(path) -> np.ndarray:
    if path is None or Path(path).stat().st_size == 0:
        return np.empty((0, PAGE), np.uint8)
    size = Path(path).stat().st_size
    if size % PAGE:
        raise PagesError(f"{path}: {size} bytes is not a whole number of pages")
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(size // PAGE, PAGE))
