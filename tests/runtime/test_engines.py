"""The engine registry: choice, refusals and what a new engine needs (a class, not another `if`)."""
import pytest

from runtime import criu, engines, launcher
from runtime.exits import EXIT_USAGE, LaunchError

pytestmark = pytest.mark.runtime


class SpareEngine(engines.Engine):
    """A stand-in for a later engine (the CUDA state one): available when `ready` says so."""

    name = "spare"
    label = "the spare engine"
    ready = (True, "1.0")

    @classmethod
    def available(cls):
        return cls.ready

    @classmethod
    def auto_reason(cls, detail):
        return f"spare {detail} is ready"

    def spawn(self, command, *, env, log):
        raise NotImplementedError

    def dump(self, launcher, request, step, staging, *, stop, timeout_s):
        raise NotImplementedError

    def restore(self, launcher, ref, meta):
        raise NotImplementedError

    def cut(self, runtime, request, step):
        raise NotImplementedError


@pytest.fixture
def spare_first(monkeypatch):
    monkeypatch.setattr(engines, "ENGINES", {"spare": SpareEngine, **engines.ENGINES})
    monkeypatch.setattr(SpareEngine, "ready", (True, "1.0"))
    return SpareEngine


def test_the_launchers_choices_are_the_registry_and_auto():
    assert launcher.ENGINES == ("criu", "framework", "auto")


def test_a_registered_engine_is_chosen_requested_and_named_without_launcher_changes(spare_first):
    assert engines.choose_engine("auto") == ("spare", "auto: spare 1.0 is ready")
    assert engines.choose_engine("spare") == ("spare", "requested")
    assert isinstance(engines.engine_named("spare"), SpareEngine)


def test_auto_names_every_engine_it_passed_over(spare_first, monkeypatch):
    monkeypatch.setattr(SpareEngine, "ready", (False, "no GPU"))
    monkeypatch.setattr(criu, "check_available", lambda: (False, "criu is not installed"))
    assert engines.choose_engine("auto") == (
        "framework", "auto: the spare engine unusable (no GPU); CRIU unusable (criu is not installed)")
    with pytest.raises(LaunchError, match="--engine spare: the spare engine is unavailable: no GPU") as caught:
        engines.choose_engine("spare")
    assert caught.value.code == EXIT_USAGE


def test_an_unknown_engine_is_refused_by_name():
    with pytest.raises(LaunchError, match="unknown engine 'tape'; choose one of criu, framework, auto"):
        engines.choose_engine("tape")
    with pytest.raises(LaunchError, match="no checkpoint engine is named 'tape'") as caught:
        engines.engine_named("tape")
    assert caught.value.code == EXIT_USAGE


def test_only_criu_refuses_to_resume_where_criu_is_unusable(monkeypatch):
    monkeypatch.setattr(criu, "check_available", lambda: (False, "criu is not installed"))
    assert engines.CriuEngine().can_resume({}) == \
        "the checkpoint needs CRIU, which is unavailable: criu is not installed"
    assert engines.FrameworkEngine().can_resume({}) is None
