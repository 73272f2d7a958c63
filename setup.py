"""The one piece of packaging that pyproject.toml cannot say: conf/ ships as the package fsdp_exp.conf.

The config groups live in conf/ at the top of the repository, beside fsdp_exp/, and are installed
inside the package as ``fsdp_exp/conf``. ``package_dir`` maps the package ``fsdp_exp.conf`` to the
folder ``conf/``; that package is the one name by which everything finds the configs
(``config_path="pkg://fsdp_exp.conf"`` in fsdp_exp/__main__.py, Hydra's compose API in the planner
and the tests), and it resolves in both kinds of install:

- ``pip install .`` or a wheel: the YAML files are copied into ``site-packages/fsdp_exp/conf/``;
- ``pip install -e .``: setuptools' editable finder maps ``fsdp_exp.conf`` to this checkout's conf/,
  so an edited or added YAML file counts at once (after a change to this mapping, install again).

pyproject.toml can either list every package by hand (each new subpackage of fsdp_exp would have to
be added, or be missing from the wheel) or find them (and finding cannot name a package after a
folder of another name). So the packages are found here, and the mapped one added. Everything else
(metadata, dependencies, which files are package data) stays in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

setup(
    # hydra_plugins: where Hydra finds the launcher class of hydra/launcher=slurm (a namespace package)
    packages=[
        *find_namespace_packages(include=["fsdp_exp*", "hydra_plugins*"], exclude=["fsdp_exp.conf", "fsdp_exp.conf.*"]),
        "fsdp_exp.conf",
    ],
    package_dir={"fsdp_exp.conf": "conf"},
)
