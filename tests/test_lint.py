import os
import subprocess
import sys

from paths import REPO


def test_package_is_ruff_clean():
    # pyproject.toml's [tool.ruff] (TRL's settings): ruff is in the dev extra
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "trl_es"], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All checks passed" in result.stdout
