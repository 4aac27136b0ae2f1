"""`make compat --check`: the committed table and docs/COMPAT.md are what the released sources say.

Fetches each listed release's source package from the package index into
$DSPARK_KIT_CACHE/engine-src (once per machine; about a minute cold, a second warm)."""

from __future__ import annotations

import pytest

from dspark_kit.compat import engine_table

pytestmark = pytest.mark.slow


def test_committed_table_matches_the_released_sources(capsys):
    code = engine_table.main(["--check"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "up to date" in out.out
