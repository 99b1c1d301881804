"""pyproject.toml stays buildable by the setuptools that pip brings (its build isolation takes the newest)."""
from pathlib import Path

import pytest

tomllib = pytest.importorskip('tomllib')  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_license_is_an_spdx_string():
    # setuptools deprecates the {text = ...} table (a warning on every install) and stops building it after
    # 2027-02-18; the string form needs setuptools >= 77, which the build requirements must then ask for
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())
    assert project['project']['license'] == 'Apache-2.0'
    assert 'setuptools>=77' in project['build-system']['requires']
