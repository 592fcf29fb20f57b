"""Where the repository and the tests live, for test modules in any lane (`tests/unit`,
`tests/integration`) and the helpers beside them."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
