"""Preflight checks on the machines: multi-node reachability and shared storage (pitfall 11), the
hidden-state transport and dtype, storage for offline hidden states, the verifier's files and
its fit in memory, and the training memory plan (memory.py).

A floor of stages/ like its package: may import stages/preflight/context.py, its sibling
memory.py, stages/plan.py and the layers below; never a stage folder or checks.py (the registry
imports this).
"""

from __future__ import annotations

from pathlib import Path

from dspark_kit.data.gguf_verifier import is_gguf
from dspark_kit.findings import Finding
from dspark_kit.recipe import RecipeError
from dspark_kit.specdec.verifier_facts import has_tokenizer_files
from dspark_kit.stages.preflight.context import _Context, _read_json, pitfall

NODE_LOCAL_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def _node_local(path: str | Path) -> bool:
    p = str(Path(path).resolve()) if Path(path).is_absolute() else str(path)
    return any(p == d or p.startswith(d + "/") for d in NODE_LOCAL_DIRS)


def check_multinode(ctx: _Context) -> list[Finding]:
    """Across nodes: the rendezvous must be reachable from every node, storage shared by all."""
    from dspark_kit.distributed.rendezvous import rendezvous_for

    recipe, out = ctx.recipe, []
    t, hs = recipe.train, recipe.hidden_states
    rdzv = rendezvous_for(recipe, ctx.res.train_device.value)  # an explicit device: as written
    out += [pitfall(11, "error", e) for e in rdzv.errors]
    out += [pitfall(11, "warning", w) for w in rdzv.warnings]
    if t.nnodes == 1 or t.nodes_same_host:
        return out
    # One extraction server for every node (hidden_states.endpoint): it writes files on its own
    # machine that trainers / generate-offline-data on the other nodes read by path. (Without an
    # endpoint every node starts its own server, which reads and writes on the same machine.)
    served = hs.mode == "online" or hs.backend == "vllm"
    if served and hs.endpoint:
        from urllib.parse import urlparse

        from dspark_kit.distributed.rendezvous import master_is_loopback

        host = urlparse(hs.endpoint if "//" in hs.endpoint else f"http://{hs.endpoint}").hostname or ""
        if master_is_loopback(host):
            out.append(pitfall(11, "error", f"hidden_states.endpoint {hs.endpoint} is loopback with train.nnodes "
                                            f"{t.nnodes}: trainers on other nodes would ask themselves; use the "
                                            "server's address every node can reach, or unset it so each node "
                                            "starts its own server"))  # fmt: skip
    if served and hs.endpoint and hs.transport == "file" and not hs.storage_shared and _node_local(hs.storage_path):
        out.append(pitfall(11, "error", f"hidden_states.storage_path {hs.storage_path} is node-local with train.nnodes "
                                        f"{t.nnodes} and one extraction server ({hs.endpoint}) for every node: a "
                                        "trainer on another node cannot read the files it writes there; use shared "
                                        "storage mounted at the same path on every node (e.g. /mnt/cephfs/...) and "
                                        "set hidden_states.storage_shared: true, or unset hidden_states.endpoint "
                                        "so each node starts its own server"))  # fmt: skip
    if _node_local(ctx.run.root):
        out.append(pitfall(11, "warning", f"work dir {ctx.run.root} is node-local with train.nnodes {t.nnodes}: every "
                                          "node reads prepared/ from it and a restart resumes from its checkpoints; "
                                          "put the run on storage every node mounts at the same path"))  # fmt: skip
    return out


def check_transport(ctx: _Context) -> list[Finding]:
    """hidden_states.transport mooncake: a combination it serves, and a master someone runs."""
    from dspark_kit.distributed.hs_transport import transport_problems

    return [pitfall(11, "error", p) for p in transport_problems(ctx.recipe, ctx.res.mooncake)]


def check_hidden_dtype(ctx: _Context) -> list[Finding]:
    """hidden_states.dtype fp8 needs hs-connectors' fp8 connector here (Resolved.hidden_states_out_dtype)."""
    try:
        ctx.res.hidden_states_out_dtype  # noqa: B018 - the decision raises its own one line
    except RecipeError as e:
        return [Finding("error", "hidden-states-dtype", str(e))]
    return []


def check_storage(ctx: _Context) -> list[Finding]:
    """Offline hidden states must fit where they go (the plan: resolved/storage_plan.py)."""
    from dspark_kit.resolved.storage_plan import human, plan_storage

    if ctx.recipe.hidden_states.mode != "offline":
        return []
    plan = plan_storage(ctx.res)
    if plan.fits is not False:
        return []
    return [Finding("error", "storage", f"offline hidden states need ~{human(plan.needed)} more in {plan.dest}, "
                                        f"which has {human(plan.free)} free: free space there, lower data.limit, "
                                        "or set hidden_states.mode: online with serve.devices apart from "
                                        "train.devices (the trainer asks a server; nothing is written ahead)")]  # fmt: skip


def check_memory(ctx: _Context) -> list[Finding]:
    """On CPU the verifier sits in this machine's memory for regen's server, hidden states and eval:
    a verifier that does not fit fails the first stage, after minutes of loading."""
    res = ctx.res
    if res.train_device.value != "cpu" or ctx.verifier_config is None:
        return []
    fit = res.verifier_fit("cpu")
    if fit.value is not False:
        return []
    return [Finding("error", "verifier-memory", f"train.device cpu: {fit.source}; on CPU regen, hidden states and "
                                                "eval hold it in memory: run on an accelerator (train.device cuda "
                                                "or npu; `dspark-kit init --target-device cuda|npu` writes such a recipe) "
                                                "or choose a smaller verifier.path")]


def _looks_like_a_path(path: str) -> bool:
    """A local path as typed (absolute, ./, ../, ~); else a hub id (org/name) or a builtin."""
    return path.startswith(("/", "./", "../", "~"))


def check_verifier(ctx: _Context) -> list[Finding]:
    """The verifier can load, told from its files alone (nothing is loaded): the path exists, its
    weights and every shard its index names are there, and a tokenizer sits beside them. On a
    recipe for another machine's accelerator these are warnings: the files are checked there."""
    typed = ctx.recipe.verifier.path
    where = Path(ctx.verifier_path).expanduser()
    if not where.is_dir() and not _looks_like_a_path(typed):
        return []  # a hub id (or the tiny verifier before its build)
    if is_gguf(typed) and not where.is_dir():
        return []  # a GGUF file (it is here: its path was resolved), converted on first use
    found: list[tuple[str, str]] = []
    relative = not typed.startswith("builtin:") and not Path(typed).is_absolute() and not _looks_like_a_path(typed)
    if relative and where.is_dir():
        # a recipe's relative path found beside the recipe is absolute by now: this one is only in the
        # shell's directory, and would load from another directory as a hub id
        found = [("verifier-relative", (f"verifier.path {typed}: not beside the recipe file, only in the current "
                                        f"directory ({where.resolve()}); a relative path is read from the recipe "
                                        "file's folder: write it absolute or relative to the recipe"))]
    elif not where.is_dir():
        found.append(("verifier-missing", (f"verifier.path {typed}: no such directory here; fix the path "
                                           "(a hub id is written org/name)")))
    else:
        if not (where / "config.json").is_file():
            found.append(("verifier-config", (f"verifier.path {where} has no config.json; point it at the "
                                               "model's directory (the one holding config.json)")))
        present = [name for name in WEIGHT_FILES if (where / name).is_file()]
        if not present and not any(where.glob("*.safetensors")):
            found.append(("verifier-weights", (f"verifier.path {where} holds no weights (config only: no "
                                                f"{' / '.join(WEIGHT_FILES[:2])}); download the full model")))
        for index in (name for name in present if name.endswith(".index.json")):
            shards = set((_read_json(where / index) or {}).get("weight_map", {}).values())
            missing = sorted(sh for sh in shards if not (where / sh).is_file())
            if missing:
                found.append(("verifier-shards", (f"{where / index} names {len(missing)} shard(s) that are not "
                                                   f"there ({', '.join(missing[:3])}); finish the download")))
        from dspark_kit.specdec.verifier_facts import remote_code_refusal

        refusal = remote_code_refusal(where, ctx.recipe.verifier.trust_remote_code,
                                      flag="verifier.trust_remote_code: true (init --trust-remote-code)")
        if refusal:
            found.append(("verifier-code", refusal))
        if not has_tokenizer_files(where):
            found.append(("verifier-tokenizer", (f"verifier.path {where} has no tokenizer (tokenizer.json / "
                                                  "tokenizer_config.json); copy the model's tokenizer files")))
    if found and not ctx.res.train_device_here:
        device = ctx.res.train_device.value
        return [Finding("warning", code, f"{message} (the recipe runs on {device}, not here: preflight there "
                                         "makes this an error)") for code, message in found]
    return [Finding("error", code, message) for code, message in found]


def check_train_memory(ctx: _Context) -> list[Finding]:
    """The training memory plan against each device's memory (preflight_memory)."""
    from dspark_kit.stages.preflight.memory import memory_findings

    return memory_findings(ctx.res)
