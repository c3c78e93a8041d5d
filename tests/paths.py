"""Where the tests find the repository, this folder and its stored data (tests/ is on sys.path: conftest.py)."""
import os


TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
DATA = os.path.join(TESTS, "data")
