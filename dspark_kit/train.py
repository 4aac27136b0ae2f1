"""Stage 3, train: the recipe -> the real `speculators train` invocation.

We never re-implement training. `build_train_args` turns the recipe into
speculators' own flags (with the DSpark defaults the seed guide insists on:
loss, optimizer, max anchors, logger, full-attention indices set
explicitly), and `launch_plan` wraps them in the process launcher: a single
process or torchrun. Every process runs `dspark_kit.train_entry`, which
applies the device layer + patches and then calls speculators' train main.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dspark_kit.devices import npu_env, train_flags, visible_devices_env
from dspark_kit.engines import openai_base_url
from dspark_kit.recipe import Recipe


@dataclass
class TrainPaths:
    workdir: Path

    @property
    def data(self) -> Path:
        return self.workdir / "prepared"

    @property
    def checkpoints(self) -> Path:
        return self.workdir / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell_line(self) -> str:
        from dspark_kit.engines import shell_line

        return shell_line(self.argv, self.env)


def _override(flags: list[str], name: str, value: str) -> list[str]:
    """Set `--name value` in a flag list, replacing a device default."""
    if name in flags:
        i = flags.index(name)
        return flags[:i] + [name, value] + flags[i + 2 :]
    return flags + [name, value]


def build_train_args(
    recipe: Recipe,
    workdir: Path,
    *,
    verifier_path: str,
    num_hidden_layers: int,
    device: str,
    hidden_states_endpoint: str | None = None,
) -> list[str]:
    """speculators train flags for this recipe (without the launcher)."""
    d, t = recipe.draft, recipe.train
    paths = TrainPaths(Path(workdir))
    args = [
        "--verifier-name-or-path", verifier_path,
        "--data-path", str(paths.data),
        "--save-path", str(paths.checkpoints),
        "--log-dir", str(paths.logs),
        "--speculator-type", "dspark",
        "--draft-arch", d.arch,
        "--num-layers", str(d.num_layers),
        "--block-size", str(d.block_size),
        "--max-anchors", str(t.max_anchors),
        "--total-seq-len", str(recipe.data.seq_length),
        "--target-layer-ids", *map(str, recipe.target_layer_ids(num_hidden_layers)),
        "--sliding-window", str(d.sliding_window),
        "--markov-rank", str(d.markov_rank),
        "--markov-head-type", d.markov_head_type,
        "--enable-confidence-head" if d.confidence_head else "--no-enable-confidence-head",
        "--confidence-head-with-markov" if d.confidence_head_with_markov else "--no-confidence-head-with-markov",
        "--confidence-head-alpha", str(t.confidence_head_alpha),
        "--loss-fn", json.dumps(t.loss, separators=(", ", ": ")),
        "--optimizer", t.optimizer,
        "--lr", str(t.lr),
        "--epochs", str(t.epochs),
        "--checkpoint-freq", f"{t.checkpoint_freq:g}",
        "--seed", str(t.seed),
        "--num-workers", str(t.num_workers),
        "--train-data-ratio", str(t.train_data_ratio),
    ]
    if t.logger != "none":  # speculators' "no logger" is its default; "none" is not a handler name
        args += ["--logger", t.logger]
    if recipe.full_attention_indices:
        args += ["--full-attention-indices", *map(str, recipe.full_attention_indices)]
    if d.mask_token_id is not None:
        args += ["--mask-token-id", str(d.mask_token_id)]
    if d.draft_vocab_size is not None:
        args += ["--draft-vocab-size", str(d.draft_vocab_size)]
    if t.max_steps is not None:
        args += ["--max-steps", str(t.max_steps)]
    if recipe.verifier.trust_remote_code:
        args += ["--trust-remote-code"]
    if recipe.hidden_states.mode == "online":
        if not hidden_states_endpoint:
            raise ValueError("hidden_states.mode online needs a hidden-state server endpoint "
                             "(set hidden_states.endpoint or let `train` start one)")
        args += ["--vllm-endpoint", openai_base_url(hidden_states_endpoint),
                 "--on-missing", "generate", "--on-generate", "delete"]
    else:
        args += ["--on-missing", "raise"]
    device_flags = train_flags(device)
    if d.attn_impl != "auto":
        device_flags = _override(device_flags, "--draft-attn-impl", d.attn_impl)
    if t.loss_implementation != "auto":
        device_flags = _override(device_flags, "--loss-implementation", t.loss_implementation)
    return args + device_flags + list(t.extra_args)


def launch_plan(recipe: Recipe, train_args: list[str], device: str) -> LaunchPlan:
    """One process, or torchrun when train.nproc > 1 or train.nnodes > 1."""
    t = recipe.train
    entry = ["-m", "dspark_kit.train_entry", "--dspark-device", device]
    if t.nproc > 1 or t.nnodes > 1:
        argv = [sys.executable, "-m", "torch.distributed.run",
                f"--nproc_per_node={t.nproc}", f"--nnodes={t.nnodes}", f"--node_rank={t.node_rank}",
                f"--master_addr={t.master_addr}", f"--master_port={t.master_port}",
                *entry, *train_args]
    else:
        argv = [sys.executable, *entry, *train_args]
    env = visible_devices_env(device, t.devices)
    if device == "npu":
        env.update(npu_env())
    return LaunchPlan(argv, env)


def node_plans(recipe: Recipe, train_args: list[str], device: str) -> list[LaunchPlan]:
    """One launch plan per node (multi-node dry runs print them all)."""
    plans = []
    for rank in range(recipe.train.nnodes):
        r = recipe.model_copy(deep=True)
        r.train.node_rank = rank
        plans.append(launch_plan(r, train_args, device))
    return plans


def run_training(plan: LaunchPlan, log_path: Path) -> int:
    """Run the plan, teeing output to `log_path`; returns the exit code."""
    import subprocess

    log_path.parent.mkdir(parents=True, exist_ok=True)
    from dspark_kit.lifecycle import die_with_parent_preexec, install_signal_handlers
    from dspark_kit.redact import redact_text

    env = {**os.environ, **plan.env, "PYTHONUNBUFFERED": "1"}
    install_signal_handlers()  # SIGTERM to the kit unwinds through the except below
    with log_path.open("a") as log, subprocess.Popen(
        plan.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=die_with_parent_preexec(),  # noqa: PLW1509 - SIGKILL of the kit ends training too
    ) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                line = redact_text(line)  # the trainer echoes its argv: no key in the log or the terminal
                log.write(line)
                sys.stderr.write(line)
        except BaseException:  # Ctrl-C / SIGTERM to the kit: stop the trainer (torchrun forwards it)
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
        return proc.wait()


def set_aside_incomplete_checkpoints(checkpoints: Path) -> list[Path]:
    """Rename epoch dirs a killed run left half-written, so speculators resumes from a whole one.

    speculators writes an epoch's model, optimizer and scheduler state in place
    and `training_state.json` last; an epoch dir without it was cut off mid-save
    and would crash the resume (a truncated optimizer file). It is kept, renamed
    `incomplete-<epoch>`, which speculators' epoch scan ignores.
    """
    moved = []
    for d in sorted(Path(checkpoints).glob("[0-9]*")):
        if d.is_dir() and not d.is_symlink() and d.name.isdigit() and not (d / "training_state.json").exists():
            target = d.with_name(f"incomplete-{d.name}")
            n = 1
            while target.exists():
                target, n = d.with_name(f"incomplete-{d.name}-{n}"), n + 1
            d.rename(target)
            moved.append(target)
    return moved


def read_val_metrics(checkpoints: Path) -> dict | None:
    """val metrics of the best (else latest) checkpoint, as speculators saved them."""
    best = checkpoints / "checkpoint_best"
    cands = [best] if best.exists() else sorted(
        (p for p in checkpoints.glob("[0-9]*") if p.is_dir()), key=lambda p: int(p.name))[-1:]
    for c in cands:
        f = c / "val_metrics.json"
        if f.exists():
            return {"checkpoint": str(c.resolve()), **json.loads(f.read_text())}
    return None
