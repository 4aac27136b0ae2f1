"""The tiny verifier ships built (data/assets/tiny_verifier): every machine decodes with the same weights.

The build is deterministic for one set of CPU kernels only (AVX-512, AVX2 and ATEN_CPU_CAPABILITY=default
give different weights from the same seed), so the files are shipped and the builder is the record of
how they were made: a rebuild must reach the shipped build's quality, not its bytes."""

from __future__ import annotations

import hashlib
import json

import pytest

from dspark_kit.data import tiny_verifier as tiny
from dspark_kit.data.families import FAMILIES

MANIFEST = json.loads((tiny.SHIPPED / tiny.SHIPPED_MANIFEST).read_text())
# A rebuild's held-out loss may exceed the shipped one by this much (relative): measured across
# kernels, AVX-512 0.212 vs ATEN_CPU_CAPABILITY=default (see the closing note of the issue that shipped it).
# It may be lower by any amount: "as good as" is one-sided. Measured on a CPU with AMX (AVX-512 kernels
# too): 0.1362 against the shipped 0.212, by today's builder and by the one that shipped it alike.
HELDOUT_BAND = 0.15


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_shipped_files_are_this_specs_build(name):
    """A change to the spec, the chat template or the corpus needs a re-ship (its spec hash moves)."""
    family = FAMILIES[name]
    shipped = tiny.shipped_manifest(tiny.shipped_dir(family))
    assert shipped and shipped["spec_hash"] == tiny.spec_hash(tiny.TinySpec(), family), (
        f"the tiny {name} verifier's spec, template or corpus changed: run `python -m dspark_kit.data.tiny_verifier "
        f"--ship --family {name}` and commit dspark_kit/data/assets/{family.assets}")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_shipped_file_is_the_one_the_manifest_records(name):
    """Each file as shipped; an xz-packed one (gpt-oss's 201,088-row files) by its packed digest."""
    folder = tiny.shipped_dir(FAMILIES[name])
    manifest = tiny.shipped_manifest(folder)
    packed = manifest.get("packed", {})
    on_disk = {p.name for p in folder.iterdir() if p.is_file() and p.name != tiny.SHIPPED_MANIFEST}
    assert on_disk == {f + tiny.PACKED if f + tiny.PACKED in packed else f for f in manifest["files"]}
    for file, digest in [*((f, d) for f, d in manifest["files"].items() if f + tiny.PACKED not in packed),
                         *packed.items()]:
        assert hashlib.sha256((folder / file).read_bytes()).hexdigest() == digest, file


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_plans_parameter_count_is_the_shipped_models(name):
    """The memory plan sizes a server by param_count(config.json): every expert of an MoE counted."""
    import lzma
    import struct

    from dspark_kit.specdec.verifier_facts import param_count

    folder = tiny.shipped_dir(FAMILIES[name])
    packed = folder / f"model.safetensors{tiny.PACKED}"
    with lzma.open(packed) if packed.exists() else (folder / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    stored = sum(_numel(v["shape"]) for k, v in header.items() if k != "__metadata__")
    norms = sum(_numel(v["shape"]) for k, v in header.items() if k.endswith("norm.weight"))
    assert param_count(json.loads((folder / "config.json").read_text())) == stored - norms


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.slow
def test_first_use_unpacks_the_shipped_build(tmp_path):
    said: list[str] = []
    out = tiny.ensure_tiny_verifier(root=tmp_path, log=said.append)
    assert out == tiny.tiny_verifier_dir(root=tmp_path)
    assert len(said) == 1 and said[0].startswith("tiny verifier: the shipped build (made ")
    for name, digest in MANIFEST["files"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest, name
    assert not out.with_name(out.name + ".partial").exists()
    assert tiny.ensure_tiny_verifier(root=tmp_path, log=said.append) == out and len(said) == 1  # cached


@pytest.mark.slow
def test_a_rebuild_on_this_machine_reaches_the_shipped_quality():
    """The builder still makes a verifier as good as the shipped one, on whatever kernels this machine
    runs. Its build is remembered in the kit's cache per spec and kernels (`make test` starts it in the
    background while it installs, as the cold verifier build used to run)."""
    out = tiny.ensure_tiny_verifier(root=tiny.rebuild_check_root(), build=True)
    built = json.loads((out / "build.json").read_text())
    assert built["spec_hash"] == MANIFEST["spec_hash"]
    assert built["heldout_loss"] <= (1 + HELDOUT_BAND) * MANIFEST["heldout_loss"], built
    assert built["final_loss"] <= 1.3 * MANIFEST["final_loss"], built  # its last training steps: as one-sided
