"""Which layouts the chain across hosts takes (runtime/hostchain.py); the reductions themselves
are checked in tests/runtime/test_vpg.py."""
import pytest

from runtime import hostchain


@pytest.mark.parametrize("keys,expected", [
    ([7, 7, 9, 9], [range(0, 2), range(2, 4)]),
    ([7, 7, 7, 9, 9, 9, 4, 4, 4], [range(0, 3), range(3, 6), range(6, 9)]),
    ([7, 7, 7, 7], None),  # one host: its one area, not a chain
    ([7, 9, 7, 9], None),  # a host's ranks in two blocks: host order is not rank order
    ([7, 7, 9, 9, 7, 7], None),
    ([7, 7, 7, 9], None),  # hosts with different numbers of ranks
    ([7, 9, 4, 5], None),  # one rank per host: the flat path
], ids=["2x2", "3x3", "one-host", "interleaved", "host-twice", "uneven", "one-rank-per-host"])
def test_host_blocks(keys, expected):
    assert hostchain.host_blocks(keys) == expected


def test_a_host_key_is_the_same_within_a_host_and_names_its_shared_memory(monkeypatch, tmp_path):
    here = hostchain.host_key()
    assert hostchain.host_key() == here
    monkeypatch.setenv("MERIDIAN_VPG_SHM_DIR", str(tmp_path))
    assert hostchain.host_key() != here
