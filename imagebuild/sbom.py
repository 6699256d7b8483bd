"""The image's SBOM: CycloneDX 1.5 JSON of everything the image holds.

- The image root's Debian packages (its dpkg status: what scanners such as Trivy or Grype also
  find on their own).
- The release folder /opt/rdma-netns-ds/<release> (which the init container also copies to every
  node): the interpreter and each library of its closure, and the stdlib, as the Debian packages
  of the build root they were copied from (file by file through dpkg's lists, each copy with its
  path, and the interpreter and libraries as files with their SHA-256: scanners cannot see these, since no dpkg status describes /opt); and the
  Python packages of its venv with their versions and the SHA-256 of the wheel installed (the
  same as imagebuild/requirements.lock's).

It is written into the image (/usr/share/rdma-netns/sbom.cdx.json) and next to the OCI archive.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import uuid
from pathlib import Path

from imagebuild.debian import RootFacts

IN_IMAGE = "/usr/share/rdma-netns/sbom.cdx.json"
DISTRO = "debian-12"


def dpkg_status(root: Path) -> dict[str, dict[str, str]]:
    """Installed packages of a Debian root: name -> its status fields."""
    found: dict[str, dict[str, str]] = {}
    for stanza in (root / "var/lib/dpkg/status").read_text().split("\n\n"):
        fields: dict[str, str] = {}
        key = None
        for line in stanza.splitlines():
            if line[:1] in (" ", "\t") and key:
                continue  # continuation lines (Description, Conffiles): not needed
            key, _, value = line.partition(":")
            fields[key] = value.strip()
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            found[fields["Package"]] = fields
    return found


def dpkg_owners(root: Path) -> dict[str, str]:
    """Path -> the package that ships it, from dpkg's file lists (paths as listed, and with /usr
    added or removed: the root has merged /usr, the lists keep the packages' own spelling)."""
    owners: dict[str, str] = {}
    for listing in sorted((root / "var/lib/dpkg/info").glob("*.list")):
        package = listing.name[:-len(".list")].split(":")[0]
        for path in listing.read_text().splitlines():
            for spelling in (path, path.removeprefix("/usr"), "/usr" + path):
                owners.setdefault(spelling, package)
    return owners


def purl_deb(name: str, version: str, arch: str) -> str:
    return f"pkg:deb/debian/{name}@{version.replace(':', '%3A')}?arch={arch}&distro={DISTRO}"


def deb_component(fields: dict[str, str], where: str) -> dict:
    name, version, arch = fields["Package"], fields["Version"], fields.get("Architecture", "all")
    source = fields.get("Source", name).split(" ")[0]
    return {"type": "library" if name.startswith("lib") else "application", "bom-ref": purl_deb(name, version, arch),
            "name": name, "version": version, "purl": purl_deb(name, version, arch),
            "properties": [{"name": "debian:source", "value": source}, {"name": "rdma-netns:where", "value": where}]}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def python_components(site_packages: Path, wheel_hashes: dict[str, str]) -> list[dict]:
    """The venv's distributions (their *.dist-info), with the installed wheel's SHA-256."""
    out = []
    for info in sorted(site_packages.glob("*.dist-info")):
        meta = email.parser.Parser().parsestr((info / "METADATA").read_text(errors="replace"), headersonly=True)
        name, version = meta["Name"], meta["Version"]
        normalized = name.lower().replace("_", "-").replace(".", "-")
        component = {"type": "library", "bom-ref": f"pkg:pypi/{normalized}@{version}", "name": name,
                     "version": version, "purl": f"pkg:pypi/{normalized}@{version}",
                     "properties": [{"name": "rdma-netns:where", "value": str(info.parent)}]}
        if normalized in wheel_hashes:
            component["hashes"] = [{"alg": "SHA-256", "content": wheel_hashes[normalized]}]
            component["properties"].append({"name": "rdma-netns:hash-of", "value": "the wheel installed"})
        if meta["License-Expression"]:
            component["licenses"] = [{"expression": meta["License-Expression"]}]
        elif meta["License"] and len(meta["License"]) <= 80:
            component["licenses"] = [{"license": {"name": meta["License"]}}]
        out.append(component)
    return out


def build(*, image_root: Path, build_root: Path, release_dir: Path, release_path: str,
          origins: dict[str, str], wheel_hashes: dict[str, str], release: str, created: str,
          roots: dict[str, RootFacts]) -> dict:
    """The CycloneDX document. release_dir: the folder as built; release_path: its path in the image;
    origins: release-relative path -> the build root file it was copied from."""
    components: dict[str, dict] = {}
    for fields in dpkg_status(image_root).values():
        c = deb_component(fields, "image root (/)")
        components[c["bom-ref"]] = c
    installed = dpkg_status(build_root)
    owners = dpkg_owners(build_root)
    unowned = []
    files: list[dict] = []
    for rel, source in sorted(origins.items()):
        package = owners.get(source)
        if package is None or package not in installed:
            unowned.append(rel)
            continue
        c = deb_component(installed[package], release_path)
        c = components.setdefault(c["bom-ref"], c)
        if release_path not in [p["value"] for p in c["properties"] if p["name"] == "rdma-netns:where"]:
            c["properties"].append({"name": "rdma-netns:where", "value": release_path})
        occurrence = {"location": f"{release_path}/{rel}"}
        c.setdefault("evidence", {"occurrences": []})["occurrences"].append(occurrence)
        if not rel.startswith("python/lib/python3"):  # the interpreter and libraries: each a file with its hash
            location = f"{release_path}/{rel}"
            files.append({"type": "file", "bom-ref": f"file:{location}", "name": location,
                          "hashes": [{"alg": "SHA-256", "content": sha256(release_dir / rel)}],
                          "properties": [{"name": "rdma-netns:copied-from", "value": f"{c['purl']} {source}"}]})
            if rel.startswith("python/bin/"):
                files[-1]["properties"].append({"name": "rdma-netns:modified", "value": "patchelf: the "
                                                "release's own loader as interpreter, its lib folder as rpath"})
    if unowned:
        raise RuntimeError(f"no Debian package of the build root ships these files of the release: {unowned[:10]}")
    site = next((release_dir / "venv/lib").glob("python3*/site-packages"))
    python = python_components(site, wheel_hashes)
    for c in python:
        c["properties"] = [{"name": "rdma-netns:where",
                            "value": f"{release_path}/venv/lib/{site.parent.name}/site-packages"}]
        components[c["bom-ref"]] = c
    ordered = sorted(components.values(), key=lambda c: c["bom-ref"]) + files
    properties = [{"name": "org.opencontainers.image.created", "value": created}]
    for label, facts in roots.items():
        for suite, date in sorted(facts.suites.items()):
            properties.append({"name": f"rdma-netns:debian:{label}:{suite}", "value": date})
    return {
        "bomFormat": "CycloneDX", "specVersion": "1.5", "version": 1,
        "serialNumber": f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, 'rdma-netns/' + release)}",
        "metadata": {
            "timestamp": created,
            "tools": {"components": [{"type": "application", "name": "rdma-netns imagebuild"}]},
            "component": {"type": "container", "bom-ref": f"rdma-netns@{release}", "name": "rdma-netns",
                          "version": release},
            "properties": properties,
        },
        "components": ordered,
        "dependencies": [{"ref": f"rdma-netns@{release}", "dependsOn": [c["bom-ref"] for c in ordered]}],
    }


def write(document: dict, *paths: Path) -> None:
    data = json.dumps(document, indent=1, sort_keys=True) + "\n"
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data)
