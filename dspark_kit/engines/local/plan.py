"""Plan the local engine (our FastAPI server) from a recipe.

The served model ids matter: speculators' online trainer refuses a server whose
first /v1/models id differs from the verifier path it was given, so the server
answers to the names the stage decided for its role (`ServeInputs.served_names`;
hidden-states: the loadable verifier path first, then verifier.served_name).
"""

from __future__ import annotations

import sys

from dspark_kit.engines import API_KEY_ENV, Role, ServerPlan, tool_call_flags
from dspark_kit.engines.serve_inputs import ServeInputs


def plan_local(
    inputs: ServeInputs,
    role: Role,
    port: int,
    host: str | None = None,
    api_key: str | None = None,
    extra_args: list[str] | None = None,
) -> ServerPlan:
    """The local server's command for `role` on `port` (`host`: in place of serve.host)."""
    recipe = inputs.recipe
    host = host or recipe.serve.host
    argv = [
        sys.executable, "-m", "dspark_kit.engines.local.server",
        "--model", inputs.verifier_path, "--role", role, "--host", host, "--port", str(port),
        "--served-model-name", *inputs.served_names,
        "--device", inputs.device, "--dtype", inputs.dtype,
    ]
    notes: list[str] = []  # warnings
    decisions: list[str] = []  # what was decided and why
    if role == "hidden-states":
        argv += ["--layer-ids", ",".join(map(str, inputs.exported_layer_ids)),
                 "--storage-path", recipe.hidden_states.storage_path,
                 "--hidden-states-dtype", inputs.hidden_states_dtype]
    if role == "spec":
        spec = inputs.spec
        k, window = spec.k, spec.window
        argv += ["--draft", str(spec.checkpoint), "--num-speculative-tokens", str(k.value)]
        if window.value is not None:
            argv += ["--draft-window-size", str(window.value)]
        notes += [*k.notes, *window.notes]
        decisions += spec.decision_lines
    parser = recipe.serve.tool_call_parser
    if parser and role != "hidden-states":
        from dspark_kit.engines.local.tools import PARSERS

        if parser not in PARSERS:
            raise ValueError(f"serve.tool_call_parser {parser!r}: the local engine parses {', '.join(PARSERS)} "
                             "(Qwen3's format); set one of those, or serve.engine vllm")
        argv += tool_call_flags(parser, role)
    if recipe.serve.max_model_len is not None:  # vLLM's flag, enforced the same way (400)
        argv += ["--max-model-len", str(recipe.serve.max_model_len)]
    from dspark_kit.engines.local.server import check_extra_args

    extra = [*recipe.serve.extra_args, *(extra_args or [])]
    check_extra_args(extra)  # options the local engine has pass; others fail here, not silently
    argv += extra
    # the key travels in the environment, not argv, so `ps` does not show it
    env = {API_KEY_ENV: api_key} if api_key else {}
    return ServerPlan(argv=argv, host=host, port=port, env=env, notes=notes, decisions=decisions)
