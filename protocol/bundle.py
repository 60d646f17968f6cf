"""The code bundle: a job's project directory as it crosses from a user's laptop (the CLI packs it),
through the control plane (which checks it on upload and keeps it by its sha256), to a node
(the agent verifies the digest and unpacks it into the job's workspace).

Here, and not in cli/, jobs/ or agent/, because all three must apply the same rules, and
`protocol` is the one package every side imports (standard library only).

Format: a gzip-compressed POSIX tar holding regular files, folders and symlinks that stay
inside the tree. Packing is deterministic (sorted names, mtime 0, uid/gid 0, modes 0644/0755),
so the same directory gives the same archive and the same digest: an upload of an unchanged
project is stored once.

Refused (BundleError naming the member and why): an absolute path, a `..` component, a
duplicate name, a symlink whose target leaves the tree or that another member lies under,
a hard link, a device, FIFO or other special file, more than `max_entries` members, more than
`max_bytes` unpacked, a member whose name or link target is too long, and anything that is not
a readable gzip tar.
"""
from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import os
import posixpath
import stat
import tarfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

SHA256_HEX_LENGTH = 64
DEFAULT_MAX_ARCHIVE_BYTES = 256 << 20  # the compressed upload
DEFAULT_MAX_UNPACKED_BYTES = 1 << 30
DEFAULT_MAX_ENTRIES = 20_000
MAX_MEMBER_NAME = 1024
IGNORE_FILES = (".gitignore", ".meridianignore")
ALWAYS_IGNORED = (".git/", "__pycache__/", "*.pyc", ".venv/", ".meridian-bundle.tar.gz")
HASH_CHUNK = 1 << 20


class BundleError(ValueError):
    """A bundle that cannot be packed, is not what it claims, or is refused as unsafe."""


def is_sha256(text: object) -> bool:
    return (isinstance(text, str) and len(text) == SHA256_HEX_LENGTH
            and all(c in "0123456789abcdef" for c in text))


def sha256_of_file(path: str | os.PathLike) -> tuple[str, int]:
    """Returns (hex sha256, size) of a file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


# --- ignore rules -------------------------------------------------------------------------------


@dataclass(frozen=True)
class IgnoreRule:
    pattern: str
    negate: bool
    directory_only: bool
    anchored: bool
    base: str  # the folder (relative, "" for the root) whose ignore file holds the rule

    def matches(self, rel: str, is_dir: bool) -> bool:
        if self.directory_only and not is_dir:
            return False
        if self.base:
            if not rel.startswith(self.base + "/"):
                return False
            rel = rel[len(self.base) + 1:]
        if self.anchored:
            return fnmatch.fnmatchcase(rel, self.pattern)
        return fnmatch.fnmatchcase(posixpath.basename(rel), self.pattern) or fnmatch.fnmatchcase(rel, self.pattern)


def parse_ignore(text: str, *, base: str = "") -> list[IgnoreRule]:
    """Returns the rules of a .gitignore-style file: `#` comments, `!` negation, a trailing `/`
    for folders only, a `/` inside or in front anchors to the file's folder; `**` is read as `*`
    (fnmatch's `*` already crosses `/`)."""
    rules = []
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        if negate:
            line = line[1:]
        directory_only = line.endswith("/")
        line = line.rstrip("/")
        anchored = "/" in line
        line = line.lstrip("/").replace("**/", "*").replace("/**", "/*").replace("**", "*")
        if line:
            rules.append(IgnoreRule(line, negate, directory_only, anchored, base))
    return rules


def _ignored(rules: list[IgnoreRule], rel: str, is_dir: bool) -> bool:
    verdict = False
    for rule in rules:
        if rule.matches(rel, is_dir):
            verdict = not rule.negate
    return verdict


# --- packing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedFile:
    rel: str
    size: int
    kind: str  # "file", "dir", "symlink"


def select_files(root: str | os.PathLike, *, include: Iterable[str] = (),
                 exclude: Iterable[str] = ()) -> list[PackedFile]:
    """Returns what a bundle of `root` holds, sorted: every file and folder not ignored by a
    .gitignore or .meridianignore (at any depth), by the always-ignored names (.git/, .venv/,
    __pycache__/, *.pyc), or by an `exclude` glob; an `include` glob brings back an ignored file.
    A symlink is kept as a link when its target stays inside `root`, else refused."""
    root_path = Path(root).resolve()
    if not root_path.is_dir():
        raise BundleError(f"{root} is not a directory")
    include, exclude = list(include), list(exclude)
    rules = [r for p in ALWAYS_IGNORED for r in parse_ignore(p)]
    rules += [r for p in exclude for r in parse_ignore(p)]
    found: list[PackedFile] = []

    def included(rel: str) -> bool:
        return any(fnmatch.fnmatchcase(rel, g) or fnmatch.fnmatchcase(posixpath.basename(rel), g) for g in include)

    def walk(folder: Path, rel_folder: str, rules: list[IgnoreRule]) -> None:
        local = list(rules)
        for name in IGNORE_FILES:
            ignore_file = folder / name
            if ignore_file.is_file():
                local += parse_ignore(ignore_file.read_text(errors="replace"), base=rel_folder)
        local += [r for p in exclude for r in parse_ignore(p, base=rel_folder)] if rel_folder else []
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            rel = f"{rel_folder}/{entry.name}" if rel_folder else entry.name
            is_dir = entry.is_dir(follow_symlinks=False)
            if _ignored(local, rel, is_dir) and not included(rel):
                continue
            if entry.is_symlink():
                target = os.readlink(entry.path)
                check_link_target(rel, target)
                found.append(PackedFile(rel, 0, "symlink"))
            elif is_dir:
                found.append(PackedFile(rel, 0, "dir"))
                walk(Path(entry.path), rel, local)
            elif entry.is_file(follow_symlinks=False):
                found.append(PackedFile(rel, entry.stat(follow_symlinks=False).st_size, "file"))
            # sockets, FIFOs, devices in a project folder are skipped: they are not code

    walk(root_path, "", rules)
    return found


def biggest(files: Iterable[PackedFile], count: int = 5) -> str:
    top = sorted((f for f in files if f.kind == "file"), key=lambda f: -f.size)[:count]
    return ", ".join(f"{f.rel} ({human_bytes(f.size)})" for f in top)


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def pack(root: str | os.PathLike, destination: str | os.PathLike, *, include: Iterable[str] = (),
         exclude: Iterable[str] = (), max_unpacked_bytes: int = DEFAULT_MAX_UNPACKED_BYTES,
         max_entries: int = DEFAULT_MAX_ENTRIES, max_archive_bytes: int = DEFAULT_MAX_ARCHIVE_BYTES
         ) -> tuple[str, int, list[PackedFile]]:
    """Packs `root` into `destination` (a .tar.gz) and returns (sha256, archive bytes, files).
    Above a limit it raises BundleError naming the biggest files (so the user knows what to
    exclude) and leaves no archive behind."""
    root_path = Path(root).resolve()
    files = select_files(root_path, include=include, exclude=exclude)
    total = sum(f.size for f in files)
    if len(files) > max_entries:
        raise BundleError(f"{root} holds {len(files)} files and folders to bundle, more than the limit of "
                          f"{max_entries}; add the generated ones to .meridianignore or pass --exclude")
    if total > max_unpacked_bytes:
        raise BundleError(f"{root} holds {human_bytes(total)} to bundle, more than the limit of "
                          f"{human_bytes(max_unpacked_bytes)}; the biggest files: {biggest(files)}. "
                          f"Add data sets and outputs to .meridianignore (or --exclude GLOB): a job reads its "
                          f"large inputs from shared storage, not from its code bundle")
    destination = Path(destination)
    try:
        with open(destination, "wb") as raw:
            # mtime=0 in the gzip header and in every member: the same tree, the same digest.
            with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6) as compressed:
                with tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as archive:
                    for packed in files:
                        full = root_path / packed.rel
                        info = tarfile.TarInfo(packed.rel)
                        info.mtime = 0
                        info.uid = info.gid = 0
                        info.uname = info.gname = ""
                        if packed.kind == "dir":
                            info.type, info.mode = tarfile.DIRTYPE, 0o755
                            archive.addfile(info)
                        elif packed.kind == "symlink":
                            info.type, info.mode = tarfile.SYMTYPE, 0o777
                            info.linkname = os.readlink(full)
                            archive.addfile(info)
                        else:
                            mode = full.stat().st_mode
                            info.mode = 0o755 if mode & stat.S_IXUSR else 0o644
                            with open(full, "rb") as handle:
                                info.size = os.fstat(handle.fileno()).st_size
                                archive.addfile(info, handle)
        size = destination.stat().st_size
        if size > max_archive_bytes:
            raise BundleError(f"the bundle of {root} is {human_bytes(size)} compressed, more than the upload limit "
                              f"of {human_bytes(max_archive_bytes)}; the biggest files: {biggest(files)}")
    except BaseException:
        destination.unlink(missing_ok=True)
        raise
    digest, size = sha256_of_file(destination)
    return digest, size, files


# --- checking and unpacking --------------------------------------------------------------------


def check_member_name(name: str) -> str:
    """Returns the normalised relative name; raises BundleError for an unsafe one."""
    if not name or len(name) > MAX_MEMBER_NAME:
        raise BundleError(f"bundle member {name[:80]!r}: the name is empty or longer than {MAX_MEMBER_NAME}")
    if "\x00" in name or "\\" in name:
        raise BundleError(f"bundle member {name[:80]!r}: a NUL or backslash in the name")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise BundleError(f"bundle member {name!r}: an absolute path (a bundle holds paths relative to its root)")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise BundleError(f"bundle member {name!r}: a '..' component (it would write outside the workspace)")
    if not parts:
        raise BundleError(f"bundle member {name!r}: names the root itself")
    return "/".join(parts)


def check_link_target(name: str, target: str) -> None:
    """Refuses a symlink `name` -> `target` that is absolute or resolves outside the tree."""
    if not target or target.startswith("/") or "\x00" in target or len(target) > MAX_MEMBER_NAME:
        raise BundleError(f"bundle member {name!r}: a symlink to {target[:80]!r}, outside the bundle "
                          f"(only relative links that stay inside are allowed)")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    if resolved == ".." or resolved.startswith("../") or resolved.startswith("/"):
        raise BundleError(f"bundle member {name!r}: a symlink to {target!r} leaves the bundle")


@dataclass(frozen=True)
class BundleSummary:
    entries: int
    unpacked_bytes: int


def _checked_members(archive: tarfile.TarFile, *, max_entries: int, max_bytes: int) -> Iterator[tarfile.TarInfo]:
    """Yields every member after checking it (and everything before it); raises BundleError."""
    seen: set[str] = set()
    links: set[str] = set()
    total = 0
    for count, member in enumerate(archive, start=1):
        if count > max_entries:
            raise BundleError(f"the bundle has more than {max_entries} members; refused")
        name = check_member_name(member.name)
        if name in seen:
            raise BundleError(f"bundle member {name!r} appears twice")
        for i in range(len(name.split("/")) - 1):
            prefix = "/".join(name.split("/")[: i + 1])
            if prefix in links:
                raise BundleError(f"bundle member {name!r} lies under the symlink {prefix!r}; refused")
        if member.islnk():
            raise BundleError(f"bundle member {name!r}: a hard link (to {member.linkname!r}); bundles hold none")
        if member.issym():
            check_link_target(name, member.linkname)
            links.add(name)
        elif member.isdev() or member.isfifo():
            raise BundleError(f"bundle member {name!r}: a device or FIFO; bundles hold files, folders and links only")
        elif not (member.isfile() or member.isdir()):
            raise BundleError(f"bundle member {name!r}: an unknown member type {member.type!r}")
        if member.isfile():
            total += member.size
            if total > max_bytes:
                raise BundleError(f"the bundle unpacks to more than {human_bytes(max_bytes)} "
                                  f"(at member {name!r}); refused")
        seen.add(name)
        member.name = name
        yield member


def _open(source: str | os.PathLike | IO[bytes]) -> tarfile.TarFile:
    try:
        if isinstance(source, (str, os.PathLike)):
            return tarfile.open(source, mode="r:gz")
        return tarfile.open(fileobj=source, mode="r:gz")
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise BundleError(f"not a gzip-compressed tar archive ({exc}); pack the project with `meridian submit` "
                          f"or `tar czf bundle.tar.gz -C project .`") from None


def check(source: str | os.PathLike | IO[bytes], *, max_entries: int = DEFAULT_MAX_ENTRIES,
          max_bytes: int = DEFAULT_MAX_UNPACKED_BYTES) -> BundleSummary:
    """Reads the whole archive and returns its summary; raises BundleError if it would be refused."""
    entries = unpacked = 0
    try:
        with _open(source) as archive:
            for member in _checked_members(archive, max_entries=max_entries, max_bytes=max_bytes):
                entries += 1
                unpacked += member.size if member.isfile() else 0
                if member.isfile():
                    handle = archive.extractfile(member)
                    if handle is not None:
                        while handle.read(HASH_CHUNK):  # reads the data: a truncated archive fails here
                            pass
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise BundleError(f"the archive is damaged ({type(exc).__name__}: {exc})") from None
    return BundleSummary(entries, unpacked)


def unpack(source: str | os.PathLike, destination: str | os.PathLike, *, expected_sha256: str | None = None,
           max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_UNPACKED_BYTES) -> BundleSummary:
    """Unpacks the archive at `source` into the folder `destination` (created; must be empty or
    absent) and returns its summary. With `expected_sha256` the archive's digest is checked
    first and a mismatch is refused before anything is written. Files are created with
    O_EXCL|O_NOFOLLOW under folders this function made, so nothing can be written through a link."""
    if expected_sha256 is not None:
        digest, _ = sha256_of_file(source)
        if digest != expected_sha256:
            raise BundleError(f"the bundle's sha256 is {digest}, not {expected_sha256}: damaged or replaced; refused")
    dest = Path(destination)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise BundleError(f"cannot unpack into {dest}: it is not empty")
    entries = unpacked = 0
    pending_links: list[tuple[str, str]] = []
    try:
        with _open(source) as archive:
            for member in _checked_members(archive, max_entries=max_entries, max_bytes=max_bytes):
                target = dest / member.name
                entries += 1
                if member.isdir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                if member.issym():
                    pending_links.append((member.name, member.linkname))  # after every file: none is written through
                    continue
                handle = archive.extractfile(member)
                mode = 0o755 if member.mode & 0o100 else 0o644
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
                with os.fdopen(fd, "wb") as out:
                    if handle is not None:
                        while chunk := handle.read(HASH_CHUNK):
                            out.write(chunk)
                unpacked += member.size
            for name, link in pending_links:
                os.symlink(link, dest / name)
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise BundleError(f"the archive is damaged ({type(exc).__name__}: {exc})") from None
    return BundleSummary(entries, unpacked)


def pack_bytes(files: dict[str, bytes]) -> bytes:
    """Returns a bundle holding `files` (relative name -> content): for tests and the demo."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as compressed:
        with tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as archive:
            for name, content in sorted(files.items()):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(content), 0o644
                archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


# --- a job's outputs folder (written by runtime/workspace.py on the node, read by the control
# plane to serve a download): the names both sides use ------------------------------------------

OUTPUTS_LATEST = "latest.json"  # the workspace manifest of the newest checkpoint
OUTPUTS_FINAL = "final.json"  # ... of the job's end (finished or failed)
WORKSPACE_MANIFEST = "workspace.json"  # inside each checkpoint folder


def object_relpath(sha256: str) -> str:
    """Returns where a workspace file with this digest lies inside a job's outputs folder."""
    if not is_sha256(sha256):
        raise BundleError(f"{sha256!r} is not a sha256 digest")
    return f"objects/{sha256[:2]}/{sha256}"
