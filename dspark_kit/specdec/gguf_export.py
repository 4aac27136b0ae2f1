"""`dspark-kit export CKPT DEST --layout gguf`: a kit draft, and its verifier, as GGUF files llama.cpp serves.

The conversion is llama.cpp's own: its `convert_hf_to_gguf.py` from the source tree `make llama-cpp`
unpacked (specdec/llamacpp_tree.py), run as a separate program, never a copy in the project. Its
DSpark converter (`conversion/qwen.py`, DSparkModel) reads the speculators layout the kit writes:
`transformer_layer_config` (merged to the top), `aux_hidden_state_layer_ids` (- 1 ->
`target_layer_ids`), `mask_token_id`, `block_size`, `draft_vocab_size` with `d2t`, the Markov and
confidence heads, and `sample_from_anchor`. It takes the tokenizer (and, for a full-vocabulary
draft, the output head) from the verifier's HF folder (`--target-model-dir`).

What the export adds:
- `sample_from_anchor` written explicitly (the kit's anchor rule, specdec/anchor.py): the converter
  reads a missing key as *false* for the speculators layout, the opposite of how the kit trains.
- A draft the converter would refuse, or convert into something llama.cpp cannot serve, is refused
  first in one line naming the key (a layer config other than speculators' qwen3 or llama,
  `markov_head_type` not vanilla, a reduced vocabulary without its `d2t`).
- DEST/verifier.gguf beside DEST/draft.gguf: the verifier's GGUF file itself when it is one (a
  symlink), else converted from its HF folder by the same converter.
- A round trip: the written draft GGUF read back with gguf-py's reader, every value the converter
  carries compared with the checkpoint (block size, mask token, target layers, sample_from_anchor,
  Markov rank, confidence head); a mismatch fails the export and nothing is left at DEST.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dspark_kit.rundir import failed_gguf_convert_log, gguf_convert_log
from dspark_kit.specdec.anchor import KEY, anchor_layout, layout_of
from dspark_kit.specdec.checkpoints import CONFIG, WEIGHTS
from dspark_kit.specdec.llamacpp_tree import gguf_reader, require_converter

DRAFT_GGUF = "draft.gguf"
VERIFIER_GGUF = "verifier.gguf"
OUTTYPES = ("f32", "f16", "bf16", "q8_0")  # the converter's --outtype values that fit a draft
ARCH = "dflash"  # the GGUF architecture llama.cpp's DSpark drafts carry (gguf-py MODEL_ARCH.DFLASH)


class GgufExportError(ValueError):
    """One line naming the key (or file) and the fix."""


# speculators 0.9.0's DSpark draft layers are Qwen3's (Qwen3DFlashDecoderLayer, q/k norms included) for
# either draft.arch: the arch picks only the config class that carries the verifier's sizes. llama.cpp's
# converter builds Qwen3 layers too and writes the same draft GGUF, byte for byte, for both
# (tests/test_llamacpp_real.py); a layer config of another family is not a layout it knows.
SPECULATORS_LAYER_CONFIGS = ("qwen3", "llama")


def servable_problem(cfg: dict, where: str) -> str | None:
    """Why llama.cpp (b11434) cannot convert or serve this speculators-layout draft, in one line; None: it can."""
    if layout_of(cfg) != "speculators":
        return (f"{where}: speculators_model_type is {cfg.get('speculators_model_type')!r}, expected 'dspark' "
                "(a checkpoint the kit trained or imported)")
    layer = cfg.get("transformer_layer_config") or {}
    if layer.get("model_type") not in SPECULATORS_LAYER_CONFIGS:
        return (f"{where}: transformer_layer_config.model_type is {layer.get('model_type')!r}; llama.cpp's DSpark "
                "converter builds Qwen3 layers, as speculators' DSpark drafts are (draft.arch qwen3 or llama)")
    if (mht := cfg.get("markov_head_type", "vanilla")) != "vanilla":
        return (f"{where}: markov_head_type is {mht!r}; llama.cpp's converter takes only 'vanilla' "
                "(retrain with the vanilla Markov head)")
    for key in ("block_size", "mask_token_id", "aux_hidden_state_layer_ids"):
        if cfg.get(key) is None:
            return f"{where}: no {key} in {CONFIG}; llama.cpp's converter needs it (not a complete DSpark draft)"
    vocab, draft_vocab = layer.get("vocab_size"), cfg.get("draft_vocab_size")
    if isinstance(draft_vocab, int) and isinstance(vocab, int) and draft_vocab > vocab:
        return f"{where}: draft_vocab_size {draft_vocab} exceeds transformer_layer_config.vocab_size {vocab}"
    if anchor_layout(cfg).sample_from_anchor is None:
        return f"{where}: {anchor_layout(cfg).problem()}"
    return None


def _has_tensor(ckpt: Path, name: str) -> bool:
    from safetensors import safe_open

    with safe_open(str(ckpt / WEIGHTS), "pt") as f:
        return any(k == name or k.endswith("." + name) for k in f.keys())  # noqa: SIM118 (safe_open is not a dict)


def gguf_config(cfg: dict) -> dict:
    """The config the converter reads: the checkpoint's, with sample_from_anchor explicit."""
    return {**cfg, KEY: bool(anchor_layout(cfg).sample_from_anchor)}


@dataclass(frozen=True)
class Expected:
    """What the draft GGUF must carry, from the checkpoint."""

    block_size: int
    mask_token_id: int
    target_layers: list[int]  # llama.cpp's extract layer ids = the speculators aux ids
    sample_from_anchor: bool
    markov_rank: int | None
    confidence_head: bool


def expected(cfg: dict, ckpt: Path) -> Expected:
    return Expected(int(cfg["block_size"]), int(cfg["mask_token_id"]), [int(i) for i in cfg["aux_hidden_state_layer_ids"]],
                    bool(anchor_layout(cfg).sample_from_anchor), cfg.get("markov_rank"),
                    _has_tensor(ckpt, "confidence_head.proj.weight"))


def read_draft_gguf(path: Path) -> dict:
    """The DSpark values a draft GGUF carries, read with gguf-py's reader: block_size, mask_token_id,
    target_layers, sample_from_anchor, has_confidence_head, markov_rank (markov_w1's rank dim)."""
    reader = gguf_reader()(str(path))

    def value(key: str):
        field = reader.fields.get(key)
        if field is None:
            return None
        v = field.contents()
        return v

    tensors = {t.name: [int(x) for x in t.shape] for t in reader.tensors}
    w1 = tensors.get("markov_w1.weight") or tensors.get("markov_w1")
    return {"architecture": value("general.architecture"), "block_size": value(f"{ARCH}.block_size"),
            "mask_token_id": value("tokenizer.ggml.mask_token_id"), "target_layers": value(f"{ARCH}.target_layers"),
            "sample_from_anchor": value(f"{ARCH}.sample_from_anchor"),
            "has_confidence_head": value(f"{ARCH}.has_confidence_head"),
            "markov_rank": min(w1) if w1 else None, "tensors": tensors}


def round_trip_problems(got: dict, want: Expected) -> list[str]:
    """Each value the GGUF carries differently from the checkpoint, as 'key: gguf X, checkpoint Y'."""
    pairs = [("block_size", got["block_size"], want.block_size),
             ("mask_token_id", got["mask_token_id"], want.mask_token_id),
             ("target_layers", list(got["target_layers"] or []), want.target_layers),
             ("sample_from_anchor", got["sample_from_anchor"], want.sample_from_anchor),
             ("has_confidence_head", got["has_confidence_head"], want.confidence_head),
             ("markov_rank", got["markov_rank"], want.markov_rank)]
    return [f"{k}: gguf {g!r}, checkpoint {w!r}" for k, g, w in pairs if g != w]


def convert_with_llamacpp(src: Path, target_dir: Path | None, outfile: Path, outtype: str, log: Path,
                          keep: Path | None = None) -> None:
    """llama.cpp's converter on an HF folder (`--target-model-dir` for a draft); its output in `log`
    (`keep`: where a failure's message says the log will be kept)."""
    script = require_converter()
    argv = [sys.executable, str(script), str(src), "--outtype", outtype, "--outfile", str(outfile)]
    if target_dir is not None:
        argv += ["--target-model-dir", str(target_dir)]
    with open(log, "a") as out:
        out.write("$ " + " ".join(argv) + "\n")
        out.flush()
        # the tree's own gguf-py, the one its converter was written with (NO_LOCAL_GGUF would skip it)
        env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
        rc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if rc != 0:
        tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()][-1:]
        raise GgufExportError(f"llama.cpp's converter failed on {src} (rc {rc}): {tail[0] if tail else ''} "
                              f"(its output: {keep or log})")


def export_gguf(ckpt: Path, dest: Path, verifier_dir: Path, verifier_gguf: Path | None = None,
                outtype: str = "f16", verifier_outtype: str = "f16") -> dict:
    """DEST/draft.gguf (+ DEST/verifier.gguf, DEST/convert.log) from a kit checkpoint; returns a summary."""
    ckpt, dest, verifier_dir = Path(ckpt), Path(dest), Path(verifier_dir).expanduser()
    where = f"export {ckpt} --layout gguf"
    if outtype not in OUTTYPES or verifier_outtype not in OUTTYPES:
        raise GgufExportError(f"{where}: --outtype {outtype}: one of {', '.join(OUTTYPES)}")
    if dest.exists():
        raise GgufExportError(f"{where}: {dest} exists; pass a new folder")
    if not (ckpt / CONFIG).is_file() or not (ckpt / WEIGHTS).is_file():
        raise GgufExportError(f"{where}: expected {CONFIG} and {WEIGHTS} in {ckpt} (a checkpoint folder)")
    if not (verifier_dir / CONFIG).is_file():
        raise GgufExportError(f"{where}: --verifier {verifier_dir} has no {CONFIG}; the converter takes the "
                              "tokenizer from the verifier's HF folder")
    if verifier_gguf is not None and not Path(verifier_gguf).is_file():
        raise GgufExportError(f"{where}: --verifier-gguf {verifier_gguf} is not a file")
    cfg = json.loads((ckpt / CONFIG).read_text())
    if (why := servable_problem(cfg, where)) is not None:
        raise GgufExportError(why)
    vocab, draft_vocab = cfg["transformer_layer_config"].get("vocab_size"), cfg.get("draft_vocab_size")
    if isinstance(draft_vocab, int) and draft_vocab < (vocab or 0) and not _has_tensor(ckpt, "d2t"):
        raise GgufExportError(f"{where}: draft_vocab_size {draft_vocab} < vocab_size {vocab} but {WEIGHTS} has no "
                              "d2t map; llama.cpp's converter needs it")
    want = expected(cfg, ckpt)
    require_converter()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        staged = tmp / "draft-hf"
        staged.mkdir()
        (staged / CONFIG).write_text(json.dumps(gguf_config(cfg), indent=2, sort_keys=True) + "\n")
        (staged / WEIGHTS).symlink_to((ckpt / WEIGHTS).resolve())
        log = gguf_convert_log(tmp)
        keep = failed_gguf_convert_log(dest)
        convert_with_llamacpp(staged, verifier_dir.resolve(), tmp / DRAFT_GGUF, outtype, log, keep)
        got = read_draft_gguf(tmp / DRAFT_GGUF)
        bad = round_trip_problems(got, want)
        if bad:
            raise GgufExportError(f"{where}: the draft GGUF does not carry the checkpoint's values: {'; '.join(bad)}")
        if verifier_gguf is not None:
            (tmp / VERIFIER_GGUF).symlink_to(Path(verifier_gguf).resolve())
            verifier_from = f"{Path(verifier_gguf).resolve()} (the verifier's own GGUF)"
        else:
            convert_with_llamacpp(verifier_dir.resolve(), None, tmp / VERIFIER_GGUF, verifier_outtype, log, keep)
            verifier_from = f"converted from {verifier_dir} ({verifier_outtype})"
        shutil.rmtree(staged)
        tmp.rename(dest)
    except BaseException:
        if gguf_convert_log(tmp).exists():  # the converter's output outlives the failed export
            shutil.copyfile(gguf_convert_log(tmp), failed_gguf_convert_log(dest))
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"draft": str(dest / DRAFT_GGUF), "verifier": str(dest / VERIFIER_GGUF), "verifier_from": verifier_from,
            "outtype": outtype, "block_size": want.block_size, "mask_token_id": want.mask_token_id,
            "target_layers": want.target_layers, "sample_from_anchor": want.sample_from_anchor,
            "markov_rank": want.markov_rank, "confidence_head": want.confidence_head,
            "log": str(gguf_convert_log(dest))}


def recorded_verifier(ckpt: Path) -> Path:
    """The verifier folder a checkpoint records (speculators_config.verifier.name_or_path), when it is one here."""
    from dspark_kit.specdec.checkpoints import stored_verifier

    try:
        cfg = json.loads((Path(ckpt) / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise GgufExportError(f"export {ckpt} --layout gguf: cannot read {CONFIG} ({e})") from None
    name = stored_verifier(cfg)
    if not name or not (Path(name).expanduser() / CONFIG).is_file():
        raise GgufExportError(f"export {ckpt} --layout gguf: the checkpoint records verifier {name!r}, not a local HF "
                              "folder; pass --verifier DIR")
    return Path(name).expanduser()
