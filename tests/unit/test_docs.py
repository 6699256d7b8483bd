"""The docs stay true where a machine can tell.

- Every key the config models accept (the CNI network config, the device plugin's config) is in
  docs/configuration.md, and every key its tables name is accepted by a model.
- Every error code the plugin defines is a row of docs/troubleshooting.md.
- Every relative link of README.md, docs/ and conf/README.md resolves, anchors included, and
  every repository path named in backquotes exists.
- Every command of the README's two-command block and quick start exists, with the flags shown.
- docs/img/node.svg is Graphviz's rendering of docs/img/node.dot.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, installed_executable

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", REPO / "conf" / "README.md", *sorted(DOCS.glob("*.md"))]
TOP_LEVEL = ("cni/", "dp/", "conf/", "docs/", "scripts/", "integration/", "tests/", "imagebuild/", ".ci/")


def model_keys() -> tuple[set[str], set[str]]:
    """(CNI network config keys, device plugin config keys), nested models included."""
    from rdma_netns.config import model
    from rdma_netns_dp import config as dp

    cni = set()
    for cls in (model.NetConf, model.Rail, model.RangeFromNodeAddress):
        cni |= set(cls.model_fields)
    dpk = set()
    for cls in (dp.DevicePluginConfig, dp.ResourceConfig, dp.Selectors, dp.CdiConfig, dp.MetricsConfig, dp.DraConfig):
        dpk |= set(cls.model_fields)
    return cni, dpk


def table_keys(text: str) -> set[str]:
    """The backquoted names in the first column of every table row (`a` / `b`, `c[]`)."""
    keys = set()
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        keys |= {k.removesuffix("[]") for k in re.findall(r"`([A-Za-z][A-Za-z0-9]*(?:\[\])?)`", first)}
    return keys


def test_every_config_key_is_in_the_reference_and_every_key_there_is_accepted():
    reference = (DOCS / "configuration.md").read_text()
    cni, dpk = model_keys()
    named = set(re.findall(r"`([A-Za-z][A-Za-z0-9]*)`", reference))
    missing = sorted((cni | dpk) - named)
    assert not missing, f"keys the models accept but docs/configuration.md never names: {missing}"
    # The Helm chart's values have their own table, checked against values.yaml (test_helm_chart.py).
    unknown = sorted(table_keys(reference.split("## The Helm chart's values")[0]) - cni - dpk)
    assert not unknown, f"docs/configuration.md's tables name keys no model accepts: {unknown}"


def test_the_key_check_can_fail():
    cni, dpk = model_keys()
    assert "gidWaitMs" in cni and "sharedUnits" in dpk and "cniEventsFifo" in dpk
    assert table_keys("| `noSuchKey` / `mode` | x | y |") == {"noSuchKey", "mode"}


def error_codes() -> dict[str, int]:
    from rdma_netns.spec import errors

    codes = {name: value for name, value in vars(errors).items()
             if name.isupper() and isinstance(value, int) and not isinstance(value, bool)}
    from rdma_netns import entry

    codes["INTERNAL_ERROR"] = entry.INTERNAL_ERROR
    return codes


def test_every_error_code_is_in_troubleshooting():
    page = (DOCS / "troubleshooting.md").read_text()
    rows = set(re.findall(r"^\| (\d+) \|", page, re.M))
    codes = error_codes()
    assert len(codes) >= 20
    missing = sorted(f"{name} ({code})" for name, code in codes.items() if str(code) not in rows)
    assert not missing, f"error codes without a row in docs/troubleshooting.md: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text, fence, found = page.read_text(), False, set()
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            found.add(slug(line.lstrip("#")))
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for link in links(page):
        if re.match(r"[a-z]+://", link) or link.startswith("mailto:"):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no {target.relative_to(REPO) if target.is_relative_to(REPO) else target})")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link} (no heading #{anchor} in {target.name})")
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_named_exists(page: Path):
    missing = []
    for token in set(re.findall(r"`([^`\s]+)`", page.read_text())):
        path = token.rstrip(".,:;")
        if not path.startswith(TOP_LEVEL) and path not in ("install.sh", "pyproject.toml"):
            continue
        if any(c in path for c in "<>*{}$|=") or path.startswith(("docs/img/node.svg",)):
            continue
        if not (REPO / path).exists():
            missing.append(path)
    assert not missing, f"{page.name} names paths that do not exist: {sorted(missing)}"


def section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def test_the_readme_commands_exist_with_their_flags():
    readme = (REPO / "README.md").read_text()
    two = section(readme, "## Two commands")
    block = re.search(r"```sh\n(.*?)```", two, re.S)[1]
    commands = [line.split("#")[0].split() for line in block.splitlines() if line.strip()]
    assert [c[0] for c in commands] == ["scripts/demo.sh", "scripts/test.sh"], commands
    assert not any("sudo" in line for line in block.splitlines()), "the commands run as written by root"
    quick = section(readme, "## Quick start on a cluster")
    prose = re.sub(r"```.*?```", "", two + quick, flags=re.S)
    spans = re.findall(r"`([^`]+)`", prose)
    # The node's launcher (/opt/cni/bin/rdma-netns) is the same admin tool as `rdma-netns`.
    ours = [s.split() for s in spans if s.startswith(("scripts/", "rdma-netns ", "/opt/cni/bin/rdma-netns ",
                                                      "./install.sh"))]
    assert len(ours) >= 4, ours
    for argv in [*commands, *ours]:
        script = REPO / argv[0]
        if argv[0].startswith(("scripts/", "./")):
            assert script.is_file() and script.stat().st_mode & 0o111, f"{argv[0]} is not an executable here"
            for flag in (a for a in argv[1:] if a.startswith("--")):
                assert flag in script.read_text(), f"{argv[0]} has no {flag}"
        else:
            help_text = subprocess.run([installed_executable(), *argv[1:2], "--help"], capture_output=True,
                                       text=True, timeout=60)
            assert help_text.returncode == 0, f"rdma-netns {argv[1]}: {help_text.stderr}"
            for flag in (a for a in argv[2:] if a.startswith("--")):
                assert flag in help_text.stdout, f"rdma-netns {argv[1]} has no {flag}"


def test_the_node_picture_is_the_rendering_of_its_source():
    dot = shutil.which("dot")
    if dot is None:
        pytest.skip("Graphviz is not installed (scripts/setup.sh installs it)")
    rendered = subprocess.run([dot, "-Tsvg", str(DOCS / "img" / "node.dot")], capture_output=True, check=True).stdout
    assert rendered == (DOCS / "img" / "node.svg").read_bytes(), \
        "docs/img/node.svg is stale: dot -Tsvg docs/img/node.dot -o docs/img/node.svg"


def test_readme_is_short():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
