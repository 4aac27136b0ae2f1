"""The embedded tiny verifiers' cache and shipped files: one per family (families.py), no hub.

`ensure_tiny_verifier(family=...)` returns a HF model directory (config.json,
model.safetensors, tokenizer files with the family's chat template) in the cache; a content
hash of the build settings names the entry (`tiny-<family>-<hash>`).

The package ships each family's built files (assets/tiny_verifier for Qwen3, ~3.7 MB;
assets/tiny_<family> for the others) and the first use copies them into the cache in well
under a second. Shipping them is what makes every machine decode with the same weights: the
build (tiny_builder.py) is deterministic for one set of CPU kernels only (the same seed on
AVX2 and on ATEN_CPU_CAPABILITY=default gives different weights), so a verifier built on each
machine would give each machine its own replies, rows and figures.
`python -m dspark_kit.data.tiny_verifier --ship [--family F]` rebuilds and re-ships one after a
change to its spec, template or the corpus (the shipped manifest records the spec hash, and a
fast test fails while the two disagree), and a slow test checks that a rebuild reaches the
shipped build's quality (its bytes differ across machines).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from filelock import FileLock

from dspark_kit.data import gguf_verifier
from dspark_kit.data.cache_lock import _acquire, lock_holder  # noqa: F401 (lock_holder: the lock tests)
from dspark_kit.data.families import BUILTINS, FAMILIES, QWEN3, Family
from dspark_kit.data.tiny_builder import DEFAULT_SPEC, TinySpec, spec_dict
from dspark_kit.progress import note
from dspark_kit.recipe import RecipeError

ASSETS = Path(__file__).parent / "assets"
CHAT_TEMPLATE = QWEN3.chat_template  # the Qwen3 families' template (tests render against it)


def cache_root() -> Path:
    return Path(os.environ.get("DSPARK_KIT_CACHE", Path.home() / ".cache" / "dspark-kit"))


def spec_hash(spec: TinySpec, family: Family = QWEN3) -> str:
    blob = json.dumps(spec_dict(spec), sort_keys=True) + family.chat_template
    blob += (ASSETS / "words.txt").read_text() + family.spec_extra()
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def resolve_verifier_path(path: str) -> str:
    """Map the recipe's verifier path to something transformers can load (a builtin:tiny-<family>
    is unpacked, or built, into the cache; a GGUF file, or a builtin one, is converted into it)."""
    if path in BUILTINS:
        return str(ensure_tiny_verifier(family=BUILTINS[path]))
    if gguf_verifier.is_gguf(path):
        return gguf_verifier.resolve_verifier_path(path)
    return _not_an_unknown_builtin(path)


def planned_verifier_path(path: str) -> str:
    """Where resolve_verifier_path will find the verifier, without building anything: plans
    (dry runs, `recipe show`) name the tiny verifier's (or a GGUF's) cache entry and never spend
    minutes building or converting."""
    if path in BUILTINS:
        return str(tiny_verifier_dir(family=BUILTINS[path]))
    if gguf_verifier.is_gguf(path):
        return gguf_verifier.planned_verifier_path(path)
    return _not_an_unknown_builtin(path)


def _not_an_unknown_builtin(path: str) -> str:
    if path.startswith("builtin:"):
        names = [*BUILTINS, *gguf_verifier.SHIPPED_GGUF]
        raise RecipeError(f"verifier.path: {path} is no embedded verifier; use one of {', '.join(names)}")
    return path


def planned_config(spec: TinySpec = DEFAULT_SPEC, family: Family = QWEN3) -> dict:
    """The parts of a tiny verifier's config.json a plan needs, before it is built (its size
    too; vocab_size is the spec's bound, the built one is the tokenizer's, a little smaller)."""
    return {"model_type": family.model_type, "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
            "vocab_size": family.planned_vocab(spec.vocab_size), "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.hidden_size // spec.num_heads,
            "intermediate_size": spec.intermediate_size, "tie_word_embeddings": spec.tie_embeddings,
            **{k: v for k, v in family.model_extra.items() if k != "rope_theta"}}


def tiny_verifier_dir(spec: TinySpec = DEFAULT_SPEC, root: Path | None = None, family: Family = QWEN3) -> Path:
    return (root or cache_root()) / f"{family.cache_prefix}-{spec_hash(spec, family)}"


SHIPPED = ASSETS / QWEN3.assets  # the Qwen3 build; shipped_dir(family) for each
SHIPPED_MANIFEST = "shipped.json"  # spec hash, sha256 per file, where and how the files were built
# A shipped file past PACK_OVER bytes is xz-packed (the gpt-oss verifier's 201,088-row embedding and
# tokenizer: ~230 MB, mostly repeated rows, ~5 MB packed); unpacking it into the cache is exact.
PACKED, PACK_OVER = ".xz", 16 << 20


def _pack(path: Path) -> None:
    import lzma

    with path.open("rb") as src, lzma.open(path.with_name(path.name + PACKED), "wb", preset=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    path.unlink()


def _unpack(packed: Path) -> None:
    import lzma

    with lzma.open(packed, "rb") as src, packed.with_name(packed.name[: -len(PACKED)]).open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    packed.unlink()


def shipped_dir(family: Family = QWEN3) -> Path:
    return ASSETS / family.assets


def shipped_manifest(folder: Path = SHIPPED) -> dict | None:
    try:
        return json.loads((folder / SHIPPED_MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def ensure_tiny_verifier(spec: TinySpec = DEFAULT_SPEC, root: Path | None = None, log=note,
                         build: bool = False, family: Family = QWEN3) -> Path:
    """The verifier's cache entry: the shipped files copied there when they are this spec's,
    else (or with `build`) built there. One process does it; others wait on the lock."""
    out = tiny_verifier_dir(spec, root, family)
    if (out / "model.safetensors").exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock, owner = FileLock(str(out) + ".lock"), Path(str(out) + ".lock.owner")
    _acquire(lock, owner, f"the tiny {family.name} verifier", log)
    try:
        return _materialize(spec, out, log, build, family)
    finally:
        owner.unlink(missing_ok=True)
        lock.release()


def _materialize(spec: TinySpec, out: Path, log, build: bool = False, family: Family = QWEN3) -> Path:
    """Under the lock: another process may have finished meanwhile."""
    if (out / "model.safetensors").exists():
        return out
    return _unpack_or_build(spec, out, log, build, family)


def _unpack_or_build(spec: TinySpec, out: Path, log, build: bool, family: Family = QWEN3) -> Path:
    """Unpack (or build) into a partial folder, then rename it into place, so a half-written entry
    never looks complete."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shipped = shipped_manifest(shipped_dir(family))
    if not build and shipped and shipped.get("spec_hash") == spec_hash(spec, family):
        shutil.copytree(shipped_dir(family), tmp, ignore=shutil.ignore_patterns("__init__.py", "__pycache__"))
        for packed in sorted(tmp.glob(f"*{PACKED}")):
            _unpack(packed)
        tmp.rename(out)
        log(f"tiny {'' if family is QWEN3 else family.name + ' '}verifier: the shipped build (made {shipped.get('built_on', '?')}) -> {out}")
        return out
    t0 = time.time()
    why = "--build" if build else "the shipped files are another spec's"
    log(f"building the tiny {family.name} verifier ({why}; 4 to 20 min on one thread, a line every 100 steps) -> {out}")
    _build_into(spec, tmp, log, family)
    tmp.rename(out)
    log(f"tiny verifier ready in {time.time() - t0:.0f}s")
    return out


def _build_into(spec: TinySpec, folder: Path, log, family: Family = QWEN3) -> dict:
    """The build itself (tiny_builder.py), and what the manifest records of it."""
    import platform

    import torch

    from dspark_kit.data.tiny_builder import build_tokenizer, heldout_loss, train_tiny_model

    t0 = time.time()
    tok = build_tokenizer(spec, family)
    tok.save_pretrained(folder)
    model, losses = train_tiny_model(spec, tok, log=log, family=family)
    model.save_pretrained(folder)
    (folder / "dspark_kit_tiny.json").write_text(json.dumps(spec_dict(spec), indent=1))
    record = {"spec_hash": spec_hash(spec, family), "final_loss": round(sum(losses[-100:]) / len(losses[-100:]), 4),
              "heldout_loss": round(heldout_loss(model, tok, spec, family=family), 4),
              "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "machine": platform.machine(), "build_seconds": round(time.time() - t0)}
    (folder / "build.json").write_text(json.dumps(record, indent=1))
    return record


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ship(spec: TinySpec = DEFAULT_SPEC, log=note, family: Family = QWEN3) -> Path:
    """Rebuild the verifier and replace the package's shipped files with it (a maintainer's
    command after changing the spec, template or corpus; the manifest says where it was made)."""
    dest = shipped_dir(family)
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return _install_shipped(tmp, _build_into(spec, tmp, log, family), family)


def _install_shipped(tmp: Path, record: dict, family: Family = QWEN3) -> Path:
    """A finished build (its folder and build record) becomes the package's shipped files."""
    import datetime

    dest = shipped_dir(family)
    record["built_on"] = f"{datetime.date.today()} ({record['machine']}, {record['cpu_capability']} kernels)"
    record["files"] = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}  # as unpacked
    for big in [p for p in sorted(tmp.iterdir()) if p.is_file() and p.stat().st_size > PACK_OVER]:
        _pack(big)
    record["packed"] = {p.name: _sha256(p) for p in sorted(tmp.glob(f"*{PACKED}"))}  # as shipped
    (tmp / SHIPPED_MANIFEST).write_text(json.dumps(record, indent=1) + "\n")
    old = dest.with_name(dest.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    return dest


def rebuild_check_root() -> Path:
    """Where this machine's own rebuild is kept (per CPU kernels: the build is deterministic for one
    set only), for the test that compares its quality with the shipped build's."""
    import torch

    return cache_root() / "rebuild-check" / torch.backends.cpu.get_cpu_capability()


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m dspark_kit.data.tiny_verifier",
                                 description="A tiny verifier: unpack it into the cache (default), "
                                             "build it from its recipe, or rebuild and re-ship it.")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--build-into", type=Path, metavar="ROOT",
                     help="build it (never unpack) into the cache folder ROOT; prints its build.json")
    how.add_argument("--rebuild-check", action="store_true",
                     help="build it into this machine's rebuild-check folder (the slow quality test reads it)")
    how.add_argument("--ship", action="store_true",
                     help="rebuild and replace the package's shipped files (after a spec/template/corpus change)")
    ap.add_argument("--family", choices=sorted(FAMILIES), default=QWEN3.name,
                    help="which tiny verifier (default qwen3)")
    a = ap.parse_args(argv)
    family = FAMILIES[a.family]
    if a.ship:
        print(ship(family=family))
    elif a.build_into or a.rebuild_check:
        out = ensure_tiny_verifier(root=a.build_into or rebuild_check_root(), build=True, family=family)
        print((out / "build.json").read_text())
    else:
        print(ensure_tiny_verifier(family=family))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
