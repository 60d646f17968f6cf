"""The arrows in ARCHITECTURE.md: the core, the agent and the runtime run far from
the control plane and must never import Django, DRF, Channels or Celery."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FORBIDDEN = {"django", "rest_framework", "channels", "channels_redis", "celery", "daphne"}


def _imported_top_level_modules(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0], node.lineno


@pytest.mark.parametrize("package", ["scheduler", "agent", "runtime"])
def test_package_never_imports_django(package):
    offenders = [
        f"{path.relative_to(ROOT)}:{lineno} imports {module}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for module, lineno in _imported_top_level_modules(path)
        if module in FORBIDDEN
    ]
    assert offenders == []


def test_scheduler_core_imports_nothing_from_the_control_plane():
    offenders = [
        f"{path.relative_to(ROOT)}:{lineno} imports {module}"
        for path in sorted((ROOT / "scheduler").rglob("*.py"))
        for module, lineno in _imported_top_level_modules(path)
        if module in {"portal", "fleet", "jobs", "agent", "runtime", "torch"}
    ]
    assert offenders == []


# The Django apps' arrows: fleet may import only the scheduler; jobs may import fleet and the
# scheduler; nothing but portal imports portal.
APP_FORBIDDEN = {"fleet": {"jobs", "portal", "agent", "runtime"}, "jobs": {"portal", "agent", "runtime"}}


@pytest.mark.parametrize("package", sorted(APP_FORBIDDEN))
def test_django_apps_import_only_down_the_arrows(package):
    offenders = [
        f"{path.relative_to(ROOT)}:{lineno} imports {module}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for module, lineno in _imported_top_level_modules(path)
        if module in APP_FORBIDDEN[package]
    ]
    assert offenders == []


# The node side's arrows: the agent may import the runtime (and protocol), the runtime only
# protocol; neither may reach back into the control plane, which runs far from the nodes.
NODE_FORBIDDEN = {"agent": {"portal", "fleet", "jobs"}, "runtime": {"agent", "portal", "fleet", "jobs"}}


def _offenders(package: str, forbidden: set[str], *, root: pathlib.Path = ROOT) -> list[str]:
    return [
        f"{path.relative_to(root)}:{lineno} imports {module}"
        for path in sorted((root / package).rglob("*.py"))
        for module, lineno in _imported_top_level_modules(path)
        if module in forbidden
    ]


@pytest.mark.parametrize("package", sorted(NODE_FORBIDDEN))
def test_the_node_side_never_imports_the_control_plane(package):
    assert _offenders(package, NODE_FORBIDDEN[package]) == []


def test_the_node_side_check_sees_an_import_inside_a_function(tmp_path):
    # agent/embedded.py once imported portal.launch inside its hook function, out of sight of
    # a module-level check.
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "embedded.py").write_text(
        "def processes(context):\n    from portal.launch import ProcessSpec\n    return [ProcessSpec]\n")
    assert _offenders("agent", NODE_FORBIDDEN["agent"], root=tmp_path) == ["agent/embedded.py:2 imports portal"]


def test_the_wire_protocol_imports_only_the_standard_library():
    """Every side imports `protocol`, so it may depend on nothing but Python itself."""
    import sys
    offenders = [
        f"{path.relative_to(ROOT)}:{lineno} imports {module}"
        for path in sorted((ROOT / "protocol").rglob("*.py"))
        for module, lineno in _imported_top_level_modules(path)
        if module not in sys.stdlib_module_names and module != "protocol"
    ]
    assert offenders == []


def test_the_cli_imports_only_the_standard_library_requests_and_protocol():
    """`meridian` runs on a user's laptop: no Django, no torch, nothing of the control plane or nodes."""
    import sys
    allowed = {"requests", "protocol", "cli"}
    offenders = [
        f"{path.relative_to(ROOT)}:{lineno} imports {module}"
        for path in sorted((ROOT / "cli").rglob("*.py"))
        for module, lineno in _imported_top_level_modules(path)
        if module not in sys.stdlib_module_names and module not in allowed
    ]
    assert offenders == []


def test_no_two_test_modules_share_a_name():
    """pytest imports test files as top-level modules (no __init__.py in tests/), so two files of one
    name in different folders stop collection of the whole suite ("import file mismatch"): it did,
    in session 22's CI-like run, with tests/jobs/ and tests/sandbox/test_job_network.py."""
    by_name: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in by_name.items() if len(paths) > 1} == {}
