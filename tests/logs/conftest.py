"""The live-log end-to-end tests run on the e2e stack (tests/e2e/harness.py)."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "e2e"))

from stack_fixtures import stack, template_db  # noqa: E402, F401 - fixtures
