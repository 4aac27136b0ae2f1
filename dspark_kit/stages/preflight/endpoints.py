"""Preflight's look at servers the kit did not start: their /v1/models against the names the
kit's clients will send (pitfall 3: one verifier everywhere)."""

from __future__ import annotations

import json

from dspark_kit.findings import Finding
from dspark_kit.resolved import Resolved


def _pitfall3(level: str, message: str) -> Finding:
    return Finding(level, "pitfall-3", message, 3)


ENDPOINT_TIMEOUT_S = 5.0  # a server that takes longer to list its models is reported unreachable


def _model_ids(endpoint: str) -> tuple[list[str] | None, str]:
    """The ids `endpoint`'s /v1/models lists, in order; None and why when it cannot be read."""
    import urllib.error
    import urllib.request

    from dspark_kit.engines import openai_base_url

    url = openai_base_url(endpoint) + "/models"
    try:
        with urllib.request.urlopen(url, timeout=ENDPOINT_TIMEOUT_S) as r:
            body = json.loads(r.read())
        return [str(m.get("id")) for m in body.get("data") or [] if isinstance(m, dict)], url
    except urllib.error.HTTPError as e:
        return None, f"{url} answered HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError, AttributeError) as e:
        return None, f"{url} did not answer ({getattr(e, 'reason', e)})"


def endpoint_findings(res: Resolved) -> list[Finding]:
    """External servers against the names the kit's clients will send: speculators' trainer (and
    generate-offline-data) take the first id hidden_states.endpoint lists and refuse it unless it
    is the verifier path they were given (Resolved.served_names); regen asks each of
    regen.endpoints for its first id. Unreachable: a warning (preflight may run elsewhere)."""
    r = res.recipe
    out = []
    hs = r.hidden_states
    if hs.endpoint and (hs.mode == "online" or hs.backend != "local"):
        ids, where = _model_ids(hs.endpoint)
        if ids is None:
            out.append(_pitfall3("warning", f"hidden_states.endpoint: cannot check its model names: {where}"))
        elif not ids or ids[0] != res.verifier_path:
            names = " ".join(res.served_names("hidden-states"))
            out.append(_pitfall3("error", f"hidden_states.endpoint {hs.endpoint} lists {ids or 'no model'} first "
                                           f"in /v1/models, but the trainer refuses any first id but the verifier "
                                           f"path {res.verifier_path}: start that server with --served-model-name "
                                           f"{names}"))
    if r.regen.enabled:
        for endpoint in r.regen.endpoints:
            ids, where = _model_ids(endpoint)
            if ids is None:
                out.append(_pitfall3("warning", f"regen.endpoints {endpoint}: cannot check its model names: {where}"))
            elif not ids:
                out.append(_pitfall3("error", f"regen.endpoints {endpoint} lists no model in /v1/models: "
                                               "regen would have nothing to ask; start it with a model"))
            elif ids[0] not in (res.served_name, res.verifier_path, r.verifier.path):
                out.append(_pitfall3("warning", f"regen.endpoints {endpoint} serves {ids[0]} first (what regen "
                                                 f"asks for), not the verifier {res.served_name}: the draft learns "
                                                 "another model's replies unless it is the same model"))
    return out
