"""Every console script the package declares imports and explains itself."""

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

SCRIPTS = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_console_script_answers_help(name):
    module, func = SCRIPTS[name].split(":")
    code = f"import sys; sys.argv = [{name!r}, '--help']; from {module} import {func}; {func}()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout and "--help" in done.stdout
