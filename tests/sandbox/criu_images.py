"""Edits a CRIU core image the way a job that could write its own images would (a test tool: no
crit here). A core image is two magic words, then entries, each a 32-bit length and a protobuf
message; a task's credentials are a nested message (criu's images/creds.proto `creds_entry`: uid,
gid, euid, egid, suid, sgid, fsuid, fsgid = fields 1-8, cap_inh/prm/eff/bnd = 9-12, one 32-bit
word per element). Only that message is re-encoded; every other byte is kept."""
import struct

MAGIC_BYTES = 8
CAP_PRM, CAP_EFF = 10, 11


def _varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _fields(buf: bytes):
    """Yields (field number, wire type, tag start, value start, value end, varint value or None);
    raises ValueError for bytes that are no protobuf message."""
    at = 0
    while at < len(buf):
        start = at
        key, at = _varint(buf, at)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise ValueError("field 0")
        if wire == 0:
            value, end = _varint(buf, at)
            yield number, wire, start, at, end, value
            at = end
        elif wire == 2:
            size, begin = _varint(buf, at)
            if begin + size > len(buf):
                raise ValueError("past the end")
            yield number, wire, start, begin, begin + size, None
            at = begin + size
        elif wire in (1, 5):
            end = at + (8 if wire == 1 else 4)
            yield number, wire, start, at, end, None
            at = end
        else:
            raise ValueError(f"wire type {wire}")
    if at != len(buf):
        raise ValueError("trailing bytes")


def _is_creds(buf: bytes, uid: int) -> bool:
    try:
        seen = {n: v for n, w, _, _, _, v in _fields(buf) if w == 0 and n <= 8}
    except (ValueError, IndexError):
        return False
    return sorted(seen) == list(range(1, 9)) and set(seen.values()) == {uid}


def _edit(buf: bytes, uid: int, edit) -> bytes | None:
    """Returns `buf` with the creds message inside it (at any depth) replaced by edit(creds), or None."""
    try:
        fields = list(_fields(buf))
    except (ValueError, IndexError):
        return None
    for _, wire, start, begin, end, _ in fields:
        if wire != 2:
            continue
        inner = buf[begin:end]
        replaced = edit(inner) if _is_creds(inner, uid) else _edit(inner, uid, edit)
        if replaced is not None:
            key_end = start + len(_encode_varint(_varint(buf, start)[0]))
            return buf[:start] + buf[start:key_end] + _encode_varint(len(replaced)) + replaced + buf[end:]
    return None


def grant_caps(creds: bytes, caps_low_word: int) -> bytes:
    """Returns creds with `caps_low_word` OR'ed into the first word of cap_prm and cap_eff."""
    out, done = bytearray(), set()
    for number, wire, start, begin, end, value in _fields(creds):
        if wire == 0 and number in (CAP_PRM, CAP_EFF) and number not in done:
            done.add(number)
            out += creds[start:begin] + _encode_varint(value | caps_low_word)
        else:
            out += creds[start:end]
    return bytes(out)


def tamper_core_image(path, *, uid: int, caps_low_word: int) -> None:
    """Rewrites the core image at `path` so that its task (uid `uid`) holds the capabilities of
    `caps_low_word` (bits 0-31) permitted and effective. Raises AssertionError when no creds of
    that uid are found."""
    data = open(path, "rb").read()
    size = struct.unpack_from("<I", data, MAGIC_BYTES)[0]
    entry = data[MAGIC_BYTES + 4:MAGIC_BYTES + 4 + size]
    edited = _edit(entry, uid, lambda creds: grant_caps(creds, caps_low_word))
    assert edited is not None, f"no credentials of uid {uid} in {path}"
    with open(path, "wb") as handle:
        handle.write(data[:MAGIC_BYTES] + struct.pack("<I", len(edited)) + edited + data[MAGIC_BYTES + 4 + size:])
