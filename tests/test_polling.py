"""tests/polling.py: the one poll-with-a-deadline every test and harness waits with."""
import itertools

import pytest
from polling import PollTimeout, poll


def test_it_returns_the_first_truthy_value():
    answers = itertools.chain([None, 0, ""], itertools.repeat("ready"))
    assert poll("readiness", lambda: next(answers), timeout=5, interval=0.01) == "ready"


def test_it_fails_the_test_naming_what_it_waited_for_with_the_diagnostics():
    with pytest.raises(PollTimeout, match=r"timed out after 0.05 s waiting for the store to go\nstill there") as caught:
        poll("the store to go", lambda: False, timeout=0.05, interval=0.01, on_timeout=lambda: "still there")
    assert isinstance(caught.value, AssertionError)


def test_without_diagnostics_the_message_is_one_line():
    with pytest.raises(PollTimeout) as caught:
        poll("nothing", lambda: None, timeout=0.01)
    assert str(caught.value) == "timed out after 0.01 s waiting for nothing"
