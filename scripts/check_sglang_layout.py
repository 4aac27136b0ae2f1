"""Check `dspark-kit export --layout sglang` against SGLang's own config-reading code, without a GPU.

SGLang's package does not import on a machine without its kernels, so this reads the functions
that parse a DSpark draft's config out of an unpacked SGLang wheel (`pip download --no-deps sglang`,
then unzip it) and runs them, unmodified, on the exported config.json as transformers loads it
(SGLang's get_config is transformers' AutoConfig): `parse_dflash_draft_config` and
`get_dflash_attention_sliding_window_size` (speculative/dflash_utils.py), `parse_dspark_draft_config`
and `get_dspark_sample_from_anchor` (speculative/dspark_components/dspark_config.py), and the
Markov/confidence head builders' config reads (models/dspark.py). Nothing of SGLang's is copied
into the kit; the wheel stays where the user put it.

    python scripts/check_sglang_layout.py SGLANG_DIR EXPORTED_DRAFT [KIT_CHECKPOINT]

Prints what SGLang reads, and exits 1 when it differs from the kit checkpoint (when given).
msgspec (an SGLang dependency) must be importable.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

WANTED = {
    "srt/speculative/dflash_utils.py": ("DEFAULT_DFLASH_MASK_TOKEN", "_cfg_get", "_get_text_config",
                                        "_get_dflash_config", "is_nemotron_35_draft_config", "_parse_optional_int",
                                        "DFlashDraftConfig", "build_target_layer_ids", "parse_dflash_draft_config",
                                        "get_dflash_layer_types", "get_dflash_attention_sliding_window_size"),
    "srt/speculative/dspark_components/dspark_config.py": ("SUPPORTED_DSPARK_MARKOV_HEAD_TYPES",
                                                           "get_dspark_sample_from_anchor", "DSparkDraftConfig",
                                                           "_get_nested_config", "_get_dspark_config",
                                                           "parse_dspark_draft_config"),
}


def _load(sglang: Path) -> dict:
    """SGLang's own definitions, executed from its source in one namespace."""
    import dataclasses
    import types
    import typing
    from collections.abc import Sequence
    from numbers import Integral

    import msgspec

    module = types.ModuleType("sglang_layout_check")  # dataclasses look their module up
    sys.modules[module.__name__] = module
    ns = module.__dict__
    ns.update({"dataclass": dataclasses.dataclass, "msgspec": msgspec, "Sequence": Sequence, "Integral": Integral,
               **{n: getattr(typing, n) for n in ("Any", "List", "Optional", "Tuple")}})
    for rel, names in WANTED.items():
        tree = ast.parse((sglang / rel).read_text())
        found = {}
        for node in tree.body:
            name = getattr(node, "name", None)
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
                name = node.targets[0].id
            if name in names:
                found[name] = node
        missing = set(names) - set(found)
        if missing:
            raise SystemExit(f"{rel}: {sorted(missing)} not found in this SGLang")
        exec(compile(ast.Module(body=[found[n] for n in names], type_ignores=[]), str(sglang / rel), "exec"), ns)  # noqa: S102 - SGLang's own definitions, run as they are
    return ns


def sglang_reads(sglang: Path, draft: Path) -> dict:
    from transformers import AutoConfig

    ns = _load(sglang)
    cfg = AutoConfig.from_pretrained(str(draft))  # what SGLang's get_config returns for it
    flash = ns["parse_dflash_draft_config"](draft_hf_config=cfg)
    spark = ns["parse_dspark_draft_config"](draft_hf_config=cfg)
    markov_rank = int(getattr(cfg, "markov_rank", 0))  # models/dspark.py build_markov_head / build_confidence_head
    return {
        "architectures": list(cfg.architectures), "num_hidden_layers": flash.num_hidden_layers,
        "block_size": spark.gamma, "target_layer_ids": spark.target_layer_ids, "mask_token_id": spark.mask_token_id,
        "markov_rank": spark.markov_rank, "markov_head_type": spark.markov_head_type,
        "sample_from_anchor": ns["get_dspark_sample_from_anchor"](cfg),
        "sliding_window_left": ns["get_dflash_attention_sliding_window_size"](cfg),
        "head_markov_rank": markov_rank, "head_markov_type": str(getattr(cfg, "markov_head_type", "vanilla")).lower(),
        "enable_confidence_head": bool(getattr(cfg, "enable_confidence_head", True)),
        "confidence_head_with_markov": bool(getattr(cfg, "confidence_head_with_markov", markov_rank > 0)),
        "hidden_size": int(cfg.hidden_size), "vocab_size": int(cfg.vocab_size),
    }


def expected(kit: Path) -> dict:
    """What the kit checkpoint was trained as, in SGLang's terms."""
    c = json.loads((kit / "config.json").read_text())
    layer = c["transformer_layer_config"]
    types = layer.get("layer_types") or []
    return {
        "architectures": ["Qwen3DSparkModel"], "num_hidden_layers": layer["num_hidden_layers"],
        "block_size": c["block_size"], "target_layer_ids": [i - 1 for i in c["aux_hidden_state_layer_ids"]],
        "mask_token_id": c["mask_token_id"], "markov_rank": c["markov_rank"], "markov_head_type": c["markov_head_type"],
        "sample_from_anchor": c["sample_from_anchor"],
        "sliding_window_left": layer["sliding_window"] - 1 if "sliding_attention" in types else None,
        "head_markov_rank": c["markov_rank"], "head_markov_type": c["markov_head_type"],
        "enable_confidence_head": c["enable_confidence_head"],
        "confidence_head_with_markov": c["confidence_head_with_markov"],
        "hidden_size": layer["hidden_size"], "vocab_size": layer["vocab_size"],
    }


def main(argv: list[str]) -> int:
    import argparse

    doc = __doc__.strip().split("\n\n")
    parser = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sglang_dir", type=Path, help="an unpacked SGLang wheel (its folder, or the sglang/ inside)")
    parser.add_argument("exported_draft", type=Path, help="the folder `dspark-kit export --layout sglang` wrote")
    parser.add_argument("kit_checkpoint", type=Path, nargs="?",
                        help="the kit checkpoint it came from: compare what SGLang reads with it (exit 1 on a difference)")
    args = parser.parse_args(argv)
    sglang = args.sglang_dir / "sglang" if (args.sglang_dir / "sglang").is_dir() else args.sglang_dir
    got = sglang_reads(sglang, args.exported_draft)
    print(json.dumps({"sglang_reads": got}, sort_keys=True))
    if args.kit_checkpoint is not None:
        want = expected(args.kit_checkpoint)
        bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
        print(json.dumps({"differs (sglang, kit)": bad} if bad else {"agrees": sorted(want)}, sort_keys=True))
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
