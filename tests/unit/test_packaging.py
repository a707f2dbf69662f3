"""pyproject.toml builds without a deprecation from setuptools (the table form of ``project.license``
stops building after 2027-02-18). Runs in the pytest process: setuptools reads the file as a build would."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution
from setuptools.warnings import SetuptoolsDeprecationWarning

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_pyproject_reads_without_a_setuptools_deprecation() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", SetuptoolsDeprecationWarning)
        dist = apply_configuration(Distribution(), str(PYPROJECT))
    assert dist.metadata.get_name() == "omnid"


def test_the_license_is_an_spdx_expression_that_the_build_backend_understands() -> None:
    document = tomllib.loads(PYPROJECT.read_text())
    assert document["project"]["license"] == "Apache-2.0"
    # the SPDX string form needs setuptools 77 or later in the isolated build environment
    [requirement] = [r for r in document["build-system"]["requires"] if r.startswith("setuptools")]
    assert requirement == "setuptools>=77"
