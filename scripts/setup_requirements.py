"""What scripts/setup.sh installs, read from pyproject.toml and this interpreter's installed distributions.

    python scripts/setup_requirements.py missing|cpu|NAME EXTRAS   (EXTRAS: comma-separated, may be empty)

- ``missing``: ``self`` when this checkout is not installed editable from here, then the name of each requirement
  not met, a line each; nothing when everything is in place (so a second set-up takes seconds).
- ``NAME`` (e.g. ``xgrammar``, ``s3fs``): that requirement as the project states it (nothing where it has none).
- ``cpu``: every requirement but xgrammar, then xgrammar's own requirements but triton, a line each: what a CPU-only
  torch needs (triton is xgrammar's CUDA path, ~1 GB installed, which a CPU-only torch never runs). Run after
  xgrammar is installed without its dependencies, since its requirements are read from its installed metadata.

Run from the repository root. packaging is pip's vendored copy where the interpreter has none of its own (a fresh
virtualenv has none).
"""

from __future__ import annotations

import json
import os
import sys
import tomllib
from importlib import metadata

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement

HERE = os.path.realpath(os.getcwd())
# what is installed, not this folder (its build leaves a dspine_batch.egg-info here) nor PYTHONPATH=$PWD
PATHS = [p for p in sys.path if p and os.path.realpath(p) != HERE]


def installed(name: str) -> metadata.Distribution | None:
    return next(iter(metadata.distributions(name=name, path=PATHS)), None)


def applies(req: Requirement) -> bool:
    """Whether a requirement holds on this interpreter and platform (an extra's requirement of a dependency not)."""
    return req.marker is None or req.marker.evaluate({**default_environment(), "extra": ""})


def requirements(extras: list[str]) -> list[Requirement]:
    project = tomllib.load(open("pyproject.toml", "rb"))["project"]
    texts = list(project["dependencies"])
    for extra in extras:
        texts += project.get("optional-dependencies", {}).get(extra, [])
    return [Requirement(t) for t in texts]


def missing(reqs: list[Requirement]) -> list[str]:
    out = []
    dist = installed("dspine-batch")
    url = json.loads((dist and dist.read_text("direct_url.json")) or "{}")
    if url.get("url") != "file://" + HERE or not url.get("dir_info", {}).get("editable"):
        out.append("self")
    for req in reqs:
        dist = installed(req.name)
        if applies(req) and (dist is None or not req.specifier.contains(dist.version, prereleases=True)):
            out.append(req.name)
    return out


def cpu_only(reqs: list[Requirement]) -> list[str]:
    mine = [str(r) for r in reqs if r.name != "xgrammar" and applies(r)]
    theirs = [Requirement(t) for t in metadata.requires("xgrammar") or []]
    return mine + [str(r) for r in theirs if r.name != "triton" and applies(r)]


def main(mode: str, extras: str) -> None:
    reqs = requirements([e for e in extras.split(",") if e])
    if mode == "missing":
        lines = missing(reqs)
    elif mode == "cpu":
        lines = cpu_only(reqs)
    else:
        lines = [str(r) for r in reqs if r.name == mode]
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
