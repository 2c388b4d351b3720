"""The package list, found rather than typed: the checkout's root is the `selfspec` package (pyproject.toml maps it),
so every folder below it with an `__init__.py` is a subpackage, and a new one (a method's folder under methods/) ships
without a line anywhere. Config folders ship as package data: the root's conf/ as `selfspec.conf`, a method's own
conf/ (its recipe's primary config and its `draft=` option) inside its package. Everything else is in pyproject.toml.
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NOT_SHIPPED = ["tests", "tests.*", "docs", "docs.*", "outputs", "outputs.*", "build", "build.*"]
CONF_FILES = ["conf/*.yaml", "conf/*/*.yaml"]


def packages(root: Path) -> list[str]:
    """`selfspec`, `selfspec.conf` (package data only) and every package folder below `root` (`selfspec.<dotted>`)."""
    return ["selfspec", "selfspec.conf", *(f"selfspec.{p}" for p in find_packages(str(root), exclude=NOT_SHIPPED))]


def package_data(root: Path) -> dict[str, list[str]]:
    """The root's configs, the shipped heads, the regenerated data, and the conf/ folder of any package that has one."""
    data = {"selfspec.conf": ["*.yaml", "*/*.yaml"], "selfspec.data": ["regenerated/*.jsonl", "regenerated/*.md"],
            "selfspec.heads": ["pretrained/*/*"]}
    for name in packages(root)[2:]:
        if (root.joinpath(*name.split(".")[1:]) / "conf").is_dir():
            data[name] = CONF_FILES
    return data


class BuildPy(build_py):
    """The root package is the checkout's root, and this file sits there: keep it out of the wheel."""

    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir) if m[:2] != ("selfspec", "setup")]


if __name__ == "__main__":  # setuptools' build backend runs this file as __main__; tests import the two functions
    here = Path(__file__).resolve().parent
    setup(packages=packages(here), package_data=package_data(here), cmdclass={"build_py": BuildPy})
