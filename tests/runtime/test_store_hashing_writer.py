"""store.HashingFileWriter: the sha256 computed beside the writer is the sha256 of the file."""
import hashlib
import os

import pytest
import torch

from runtime import store

pytestmark = pytest.mark.runtime


def test_the_digest_is_the_files_digest_for_small_and_large_writes(tmp_path):
    path = tmp_path / "f.bin"
    chunks = [os.urandom(n) for n in (1, 7, 3 << 20, 0, 100, 9 << 20, 5)]
    writer = store.HashingFileWriter(path, parallel_bytes=1 << 20)
    for chunk in chunks:
        assert writer.write(memoryview(chunk)) == len(chunk)
    entry = writer.finish()
    payload = b"".join(chunks)
    assert entry == {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    assert store.sha256_file(path) == (entry["sha256"], entry["size"])


def test_torch_save_through_it_loads_back_and_matches_the_manifest_check(tmp_path):
    state = {"w": torch.randn(600_000), "step": 3}
    path = tmp_path / "state.pt"
    writer = store.HashingFileWriter(path)
    torch.save(state, writer)
    entry = writer.finish()
    store.verify_file(path, entry)  # what every restore checks
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3


def test_close_without_finish_stops_the_hasher(tmp_path):
    writer = store.HashingFileWriter(tmp_path / "f.bin", parallel_bytes=1 << 20)
    writer.write(os.urandom(3 << 20))
    writer.close()
    assert writer.closed and writer._hasher._shutdown

