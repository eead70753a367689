"""One TensorFlow distribution per environment.

Each TensorFlow distribution (tensorflow, tensorflow-cpu, tensorflow-intel, tf-nightly, ...)
installs the same `tensorflow` package: with two, the one pip installed last has written its
files over the other's, and which build runs depends on the order of installation.
KerasHub's tensorflow-text requires `tensorflow` by name, so every extra in pyproject.toml
names that one.
"""

import importlib.metadata
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The names TensorFlow's builds are published under, for distributions without a file list.
TENSORFLOW_NAME = re.compile(
    r"(tensorflow|tf[-_.]nightly|intel[-_.]tensorflow)([-_.](cpu|gpu|intel|macos|aarch64|rocm))?"
)
TENSORFLOW_INIT = "tensorflow/__init__.py"
# A distribution in an extra: its name before any extras, version bound or marker.
REQUIREMENT_NAME = re.compile(r'"([A-Za-z0-9][A-Za-z0-9._-]*)')


def installs_tensorflow(dist: importlib.metadata.Distribution) -> bool:
    """Whether `dist` is a build of TensorFlow: it installs `tensorflow/__init__.py`."""
    record = dist.read_text("RECORD")
    if record is not None:
        # The file list as text, one "path,hash,size" a line: `dist.files` builds a path
        # object for each of every distribution's files (TensorFlow alone has ~20,000).
        return any(line.split(",", 1)[0] == TENSORFLOW_INIT for line in record.splitlines())
    if dist.files is not None:
        return any(str(file) == TENSORFLOW_INIT for file in dist.files)
    return TENSORFLOW_NAME.fullmatch(dist.metadata["Name"].lower()) is not None


def tensorflow_distributions() -> list[str]:
    """`name==version` of each TensorFlow distribution the running interpreter sees."""
    return sorted(
        {
            f"{dist.metadata['Name']}=={dist.version}"
            for dist in importlib.metadata.distributions()
            if installs_tensorflow(dist)
        }
    )


def test_one_tensorflow_distribution_is_installed():
    found = tensorflow_distributions()
    assert len(found) == 1, (
        "Exactly one TensorFlow distribution must be installed: each installs the same "
        "`tensorflow` package over the others'. Uninstall all of them and install the "
        f'project\'s extra again (pip install -e ".[test]"). Received: {found}'
    )


def extras_requirements() -> dict[str, list[str]]:
    """pyproject.toml's extras: {extra: [distribution name, ...]}."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = {}
    for match in re.finditer(r"^(\w+) = \[(.*?)\]$", section, re.M | re.S):
        body = "\n".join(line.split("#", 1)[0] for line in match.group(2).splitlines())
        extras[match.group(1)] = REQUIREMENT_NAME.findall(body)
    return extras


def test_every_extra_names_the_tensorflow_keras_hub_requires():
    extras = extras_requirements()
    assert {"cpu", "gpu", "hub", "test"} <= set(extras), f"Received: {sorted(extras)}"
    named = {
        extra: [name for name in names if TENSORFLOW_NAME.fullmatch(name.lower())]
        for extra, names in extras.items()
    }
    others = {extra: names for extra, names in named.items() if set(names) - {"tensorflow"}}
    assert not others, (
        "An extra names a TensorFlow distribution other than `tensorflow` (the one "
        "tensorflow-text, which keras-hub needs, requires): installed together with the "
        f"hub or test extra, two TensorFlows would overwrite each other. Received: {others}"
    )
    assert named["cpu"] == named["gpu"] == named["test"] == ["tensorflow"], f"Received: {named}"
