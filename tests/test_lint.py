"""The source tree passes ruff's pycodestyle and pyflakes rules at line length 120 (``[tool.ruff]`` in
pyproject.toml): unused imports or names, undefined names, long lines."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing_in_src_tests_scripts_benchmarks():
    out = subprocess.run([sys.executable, '-m', 'ruff', 'check', '--no-cache', 'src', 'tests', 'scripts', 'benchmarks'],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
