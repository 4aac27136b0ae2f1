"""`llama-server` plans (serve.engine llama.cpp): the verifier alone (role chat) or verifier + DSpark draft (role spec).

llama.cpp b11434 (`make llama-cpp`, specdec/llamacpp_tree.py) serves GGUF files: the verifier's
(`-m`) and the draft's (`-md`), which `dspark-kit export CKPT DEST --layout gguf` writes with
llama.cpp's own converter. Its DSpark path (`--spec-type draft-dspark`) drafts one block per
step with the Markov head chained in-graph and verifies it in the target's own kernels:

    llama-server -m T.gguf -md D.gguf --spec-type draft-dspark --spec-draft-n-max K
                 [--spec-draft-p-min P] -t THREADS -c CTX -np SLOTS --jinja

The confidence cut-off is `--spec-draft-p-min P` in b11434: llama.cpp's own speculative-decoding doc (its docs folder) calls it
`--spec-draft-conf-min`, but its argument parser (common/arg.cpp) has no such flag and refuses it; for a
DSpark draft `p_min` > 0 cuts the block at the first position whose confidence-head output is below P
(common/speculative.cpp), and the server refuses a draft without a confidence head then.

What maps: K -> `--spec-draft-n-max` (llama.cpp clamps it to the trained block); adaptive
verification -> `--spec-draft-p-min P` (a block is cut at the first position whose confidence is
below P); parallel slots -> `-np` (regen.concurrency for chat, bench.concurrency for spec, at most MAX_SLOTS) and
serve.max_model_len x slots -> `-c` (llama.cpp splits the context among its slots); serve.seed -> `--seed`. `--metrics` exports its counters
(`llamacpp:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`,
per position too), which bench reads as vLLM's (engines/prom.py). llama.cpp has no draft window: a
window the recipe asks for is one note, never passed or dropped silently. Role hidden-states is
not served (the kit extracts hidden states with the local engine or vLLM).

Plain values in, a ServerPlan out (no recipe, no resolver): `LlamaCppServe` carries them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dspark_kit.engines import ServerPlan
from dspark_kit.specdec.llamacpp_tree import require_server, server_binary

ENGINE = "llama.cpp"
API_KEY_ENV = "LLAMA_API_KEY"
MAX_SLOTS = 8  # parallel slots at most: more requests wait in llama-server's queue (a CPU gains little past this)  # llama-server reads its API key from here when --api-key is not given
WINDOW_NOTE = ("llama.cpp has no draft window: the window of {window} tokens ({source}) is not applied "
               "(llama-server drafts from the whole context); set serve.draft_window_size off to silence this")


class LlamaCppPlanError(ValueError):
    """One line naming the setting and the fix."""


@dataclass(frozen=True)
class LlamaCppServe:
    """What a llama-server plan needs, decided by the caller."""

    role: str  # chat | spec
    verifier_gguf: str
    host: str
    port: int
    served_name: str
    draft_gguf: str | None = None  # role spec
    k: int | None = None  # --spec-draft-n-max
    conf_min: float | None = None  # --spec-draft-p-min (adaptive verification)
    ctx_size: int | None = None  # -c: the KV size all slots share (serve.max_model_len x slots); None: the model's
    threads: int | None = None  # -t; None: the machine's CPU count
    parallel: int = 1  # -np: parallel slots
    seed: int | None = None
    window: int | None = None  # the draft window asked for (never passed: a note)
    window_source: str = ""
    extra_args: tuple[str, ...] = ()
    decisions: tuple[str, ...] = field(default_factory=tuple)


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan_llamacpp(p: LlamaCppServe, check_built: bool = True) -> ServerPlan:
    """The llama-server command for `p`; `check_built` False plans without the binary (--dry-run elsewhere)."""
    if p.role not in ("chat", "spec"):
        raise LlamaCppPlanError(f"--engine llama.cpp --role {p.role}: llama.cpp serves roles chat and spec; extract "
                                "hidden states with serve.engine local or vllm")
    binary = str(require_server() if check_built else server_binary())
    threads = p.threads or default_threads()
    argv = [binary, "-m", p.verifier_gguf, "--alias", p.served_name, "--host", p.host, "--port", str(p.port),
            "-t", str(threads), "-np", str(p.parallel), "--jinja", "--metrics"]
    if p.ctx_size is not None:
        argv += ["-c", str(p.ctx_size)]
    if p.seed is not None:
        argv += ["--seed", str(p.seed)]
    notes: list[str] = []
    decisions = list(p.decisions)
    if p.role == "spec":
        if not p.draft_gguf or p.k is None:
            raise LlamaCppPlanError("--engine llama.cpp --role spec: needs the draft GGUF and K "
                                    "(`dspark-kit export CKPT DEST --layout gguf` writes the draft)")
        argv += ["-md", p.draft_gguf, "--spec-type", "draft-dspark", "--spec-draft-n-max", str(p.k),
                 "-td", str(threads)]
        if p.conf_min is not None:
            argv += ["--spec-draft-p-min", f"{p.conf_min:g}"]
        if p.window is not None:
            notes.append(WINDOW_NOTE.format(source=p.window_source or "draft window", window=p.window))
    argv += list(p.extra_args)
    decisions.append(f"threads {threads}" + (" (serve.cpu_threads)" if p.threads else " (the CPUs this process may use; "
                                                                              "serve.cpu_threads sets it)"))
    return ServerPlan(argv=argv, host=p.host, port=p.port, notes=notes, decisions=decisions)
