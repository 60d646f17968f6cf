import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from stack_fixtures import stack, template_db  # noqa: E402, F401 - fixtures
