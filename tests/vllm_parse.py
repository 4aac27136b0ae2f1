"""Run with .venv-vllm's python (vLLM's CPU build): check kit-generated commands with vLLM's own code.

stdin: JSON list of {"id": str, "argv": [...], "engine_config": bool}. `argv` is a command as the
kit plans it: `vllm serve MODEL ...` (CUDA / Ascend) or `PY -m vllm.entrypoints.openai.api_server
--model MODEL ...` (CPU build). Each is parsed the way its launcher parses it:
`vllm serve` through vLLM's own `serve` subcommand parser (positional model tag), the module form
through `make_arg_parser(FlexibleArgumentParser())`; then `AsyncEngineArgs.from_cli_args`, and with
engine_config also `create_engine_config()` (loads the model's and the draft's config.json and
validates the speculative config, up to the device's model-runner checks).

stdout: one JSON list of {"id", "stage": "parse" | "engine_args" | "engine_config" | "ok",
"error": one line or null, "speculative_config": dict or null, "model": str, "served_model_name":
str, list or null (as the engine args hold it)}; "stage" names the step that failed ("ok" when all
passed).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())[:2000]


def parse(argv: list[str]):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if argv[:2] == ["vllm", "serve"]:
        from vllm.entrypoints.cli.serve import ServeSubcommand

        top = FlexibleArgumentParser(prog="vllm")
        sub = top.add_subparsers(dest="subparser")
        ServeSubcommand().subparser_init(sub)
        args = top.parse_args(argv[1:])
        if getattr(args, "model_tag", None):
            args.model = args.model_tag
        return args
    i = argv.index("-m")
    return make_arg_parser(FlexibleArgumentParser()).parse_args(argv[i + 2:])


def check(item: dict) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs

    out = {"id": item["id"], "stage": "parse", "error": None, "speculative_config": None, "model": None,
           "served_model_name": None}
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parse(item["argv"])
    except SystemExit:  # argparse prints "error: unrecognized arguments: ..." and exits 2
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        out["error"] = lines[-1] if lines else "argparse exited"
        return out
    except Exception as e:  # noqa: BLE001
        out["error"] = _one_line(e)
        return out
    out["stage"] = "engine_args"
    try:
        engine_args = AsyncEngineArgs.from_cli_args(args)
    except Exception as e:  # noqa: BLE001
        out["error"] = _one_line(e)
        return out
    out["model"] = engine_args.model
    out["served_model_name"] = engine_args.served_model_name
    spec = engine_args.speculative_config
    out["speculative_config"] = spec if isinstance(spec, dict) or spec is None else str(spec)
    if item.get("engine_config"):
        out["stage"] = "engine_config"
        try:
            engine_args.create_engine_config()
        except Exception as e:  # noqa: BLE001
            out["error"] = _one_line(e)
            return out
    out["stage"] = "ok"
    return out


def main() -> int:
    items = json.load(sys.stdin)
    results = [check(item) for item in items]
    sys.stdout.write("\n@@RESULTS@@" + json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
