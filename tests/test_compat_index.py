"""`make compat` follows the package index: the releases come from it, `--check` names each one the
table lacks, and no reachable index is said and passed. The index here is a stand-in (no network)."""

from __future__ import annotations

import io
import json

import pytest

from dspark_kit.compat import engine_sources, engine_table
from dspark_kit.compat.engine_sources import SourceError


def committed() -> dict[str, list[str]]:
    return {e: [f.version for f in engine_table.rows(e)] for e in engine_table.ENGINES}


def fake_fetch(dist: str, version: str):
    raise AssertionError(f"--check fetched {dist} {version}: the stand-in answers from the committed rows")


@pytest.fixture
def survey_from_rows(monkeypatch):
    """The survey of the table's own releases gives the committed rows (the real one: test_compat_survey)."""
    def survey(fetch=None, log=print, wanted=None):
        return [f for e in engine_table.ENGINES for f in engine_table.rows(e) if f.version in wanted[e]]
    monkeypatch.setattr(engine_table, "survey", survey)


def test_releases_are_every_index_version_from_the_minimum_on():
    listed = {"vllm": ["0.23.0", "0.24.0", "0.35.0rc1", "0.9.2", "0.34.0", "0.100.0", "not-a-version"],
              "vllm-ascend": ["0.22.0", "0.23.0.post1", "0.23.0"]}
    got = engine_table.releases(lambda dist: listed[dist])
    assert got == {"vllm": ("0.24.0", "0.34.0", "0.35.0rc1", "0.100.0"),
                   "vllm-ascend": ("0.23.0", "0.23.0.post1")}


def test_check_warns_in_one_line_naming_a_release_the_table_lacks(capsys, survey_from_rows):
    listed = committed()
    listed["vllm"] = [*listed["vllm"], "99.0.0"]
    code = engine_table.main(["--check"], list_versions=lambda d: listed[d], fetch=fake_fetch)
    out = capsys.readouterr()
    warned = [ln for ln in out.err.splitlines() if "99.0.0" in ln]
    assert code == 0 and len(warned) == 1
    assert "vllm 99.0.0" in warned[0] and "make compat" in warned[0]
    assert "up to date" in out.out


def test_check_is_quiet_when_the_table_has_every_listed_release(capsys, survey_from_rows):
    listed = committed()
    assert engine_table.main(["--check"], list_versions=lambda d: listed[d], fetch=fake_fetch) == 0
    assert "warning" not in capsys.readouterr().err


def test_no_reachable_index_is_said_and_passes(capsys):
    def offline(dist):
        raise SourceError(f"{dist} releases: cannot read https://pypi.org/simple/{dist}/ as PEP 691 JSON "
                          "(<urlopen error [Errno -3] Temporary failure in name resolution>)")
    assert engine_table.main(["--check"], list_versions=offline, fetch=fake_fetch) == 0
    out = capsys.readouterr().out
    assert "no package index reachable" in out and len(out.strip().splitlines()) == 1
    # writing the table without an index is a failure, not a silent empty table
    assert engine_table.main([], list_versions=offline, fetch=fake_fetch) == 1


def test_index_versions_reads_source_packages_that_are_not_yanked(monkeypatch):
    listing = {"files": [
        {"filename": "vllm-0.34.0.tar.gz"}, {"filename": "vllm-0.34.0-cp38-abi3-manylinux1_x86_64.whl"},
        {"filename": "vllm-0.33.0.tar.gz", "yanked": False},
        {"filename": "vllm-0.2.1.tar.gz", "yanked": "A bug in tensor parallelism support."},
        {"filename": "vllm-0.35.0-cp38-abi3-manylinux1_x86_64.whl"},  # no source package: nothing to survey
    ]}
    ascend = {"files": [{"filename": "vllm_ascend-0.30.0rc2.tar.gz"}]}
    seen = []

    def urlopen(req, timeout):
        seen.append((req.full_url, req.headers.get("Accept")))
        return io.BytesIO(json.dumps(ascend if "ascend" in req.full_url else listing).encode())

    monkeypatch.setattr(engine_sources.urllib.request, "urlopen", urlopen)
    assert engine_sources.index_versions("vllm", "https://idx.example/simple") == ["0.33.0", "0.34.0"]
    assert engine_sources.index_versions("vllm-ascend", "https://idx.example/simple") == ["0.30.0rc2"]
    assert seen[0] == ("https://idx.example/simple/vllm/", engine_sources.SIMPLE_JSON)


def test_a_release_cached_for_fewer_files_is_fetched_again(tmp_path, monkeypatch):
    dest = tmp_path / "vllm-0.34.0"
    dest.mkdir()
    (dest / engine_sources.DONE).write_text(json.dumps({"file": "vllm-0.34.0.tar.gz", "sha256": "x"}))
    asked = []

    def entry(dist, version, index):
        asked.append(version)
        raise SourceError("stop here")
    monkeypatch.setattr(engine_sources, "_sdist_entry", entry)
    with pytest.raises(SourceError):
        engine_sources.fetch("vllm", "0.34.0", index="https://idx.example/simple", root=tmp_path)
    assert asked == ["0.34.0"]
    (dest / engine_sources.DONE).write_text(json.dumps({"files": sorted(engine_sources.wanted_files("vllm"))}))
    assert engine_sources.fetch("vllm", "0.34.0", index="https://idx.example/simple", root=tmp_path) == dest
