"""Released source packages of vLLM and vllm-ascend, fetched by name from the package index.

`pip download --no-binary :all:` cannot fetch these: pip prepares an sdist's metadata
before saving it, and vLLM's setup.py imports torch. So this module asks the index
pip is configured with (PIP_INDEX_URL / `pip config`, default PyPI) for the file
list in the Simple API's JSON form (PEP 691), downloads the release's .tar.gz,
checks the sha256 the index lists, and unpacks only the files the detectors read
into a cache (`$DSPARK_KIT_CACHE/engine-src/<dist>-<version>/`). A release
unpacked once is fetched again only when the detectors come to read another file.
`index_versions` lists the releases the survey covers: every one with a source package.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from dspark_kit.compat.engine_features import ASCEND_FILES, VLLM_FILES
from dspark_kit.data.tiny_verifier import cache_root

DEFAULT_INDEX = "https://pypi.org/simple"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
DONE = ".complete"  # written last: a folder without it is a half-unpacked release


class SourceError(RuntimeError):
    """One line naming the release and what failed."""


def index_url() -> str:
    """The index pip uses here: PIP_INDEX_URL, else `pip config get global.index-url`, else PyPI."""
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        try:
            out = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                                 check=False, capture_output=True, text=True, timeout=30)
            url = out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
            url = ""
    return (url or DEFAULT_INDEX).rstrip("/")


def source_root() -> Path:
    return cache_root() / "engine-src"


def wanted_files(dist: str) -> tuple[str, ...]:
    return tuple((VLLM_FILES if dist == "vllm" else ASCEND_FILES).values())


def _listing(dist: str, index: str, what: str) -> dict:
    req = urllib.request.Request(f"{index}/{dist}/", headers={"Accept": SIMPLE_JSON})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.load(r)
    except (OSError, ValueError) as e:
        raise SourceError(f"{what}: cannot read {index}/{dist}/ as PEP 691 JSON ({e})") from None


def _sdist_version(dist: str, filename: str) -> str | None:
    for prefix in (f"{dist.replace('-', '_')}-", f"{dist}-"):
        if filename.startswith(prefix) and filename.endswith(".tar.gz"):
            return filename[len(prefix):-len(".tar.gz")]
    return None


def index_versions(dist: str, index: str | None = None) -> list[str]:
    """Every release of `dist` the index lists with a source package that is not yanked (the
    survey reads source packages only), unsorted. SourceError when the index cannot be read."""
    index = index or index_url()
    listing = _listing(dist, index, f"{dist} releases")
    found = set()
    for f in listing.get("files", []):
        version = _sdist_version(dist, f.get("filename", ""))
        if version and not f.get("yanked"):
            found.add(version)
    return sorted(found)


def _sdist_entry(dist: str, version: str, index: str) -> dict:
    listing = _listing(dist, index, f"{dist} {version}")
    names = {f"{dist.replace('-', '_')}-{version}.tar.gz", f"{dist}-{version}.tar.gz"}
    for f in listing.get("files", []):
        if f.get("filename") in names:
            return f
    raise SourceError(f"{dist} {version}: the index lists no source package ({' or '.join(sorted(names))})")


def fetch(dist: str, version: str, index: str | None = None, root: Path | None = None) -> Path:
    """The folder holding `vllm/` or `vllm_ascend/` of that release (only the detectors' files)."""
    dest = (root or source_root()) / f"{dist}-{version}"
    if unpacked_files(dest) == sorted(wanted_files(dist)):
        return dest
    index = index or index_url()
    entry = _sdist_entry(dist, version, index)
    url = entry["url"] if "://" in entry["url"] else f"{index}/{dist}/{entry['url']}"
    want = entry.get("hashes", {}).get("sha256")
    with tempfile.TemporaryDirectory(prefix="dspark-src-") as tmp:
        archive = Path(tmp) / entry["filename"]
        digest = hashlib.sha256()
        try:
            with urllib.request.urlopen(url, timeout=300) as r, archive.open("wb") as out:
                while chunk := r.read(1 << 20):
                    digest.update(chunk)
                    out.write(chunk)
        except OSError as e:
            raise SourceError(f"{dist} {version}: download of {entry['filename']} failed ({e})") from None
        if want and digest.hexdigest() != want:
            raise SourceError(f"{dist} {version}: sha256 {digest.hexdigest()} != the index's {want}")
        staging = Path(tmp) / "unpacked"
        _unpack(archive, staging, wanted_files(dist))
        (staging / DONE).write_text(json.dumps({"file": entry["filename"], "sha256": digest.hexdigest(),
                                                "files": sorted(wanted_files(dist))}))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(str(staging), dest)
    return dest


def _unpack(archive: Path, dest: Path, files: tuple[str, ...]) -> None:
    dest.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            _, _, rel = member.name.partition("/")
            if rel in files and member.isfile():
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(member)
                if src is not None:
                    target.write_bytes(src.read())


def unpacked_files(folder: Path) -> list[str] | None:
    """The files a cached release was unpacked for (None: not cached); a release unpacked before
    the detectors read another file is fetched again."""
    try:
        return json.loads((folder / DONE).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
