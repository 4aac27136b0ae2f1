"""Stage 3, train: the recipe -> the real `speculators train` invocation.

We never re-implement training. `build_train_args` turns the recipe into
speculators' own flags (DSpark's settings where speculators' defaults differ:
loss, optimizer, max anchors, logger, full-attention indices set
explicitly; docs/CONCEPTS.md#speculators-on-cpu-and-npu), and `launch_plan` wraps them in the process launcher: a single
process or torchrun. Every process runs `dspark_kit.compat.train_entry`, which
applies the device layer + patches and then calls speculators' train main.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dspark_kit.devices import train_flags
from dspark_kit.engines import LaunchPlan, openai_base_url
from dspark_kit.progress import STANDALONE, Reporter
from dspark_kit.recipe import Recipe, RecipeError
from dspark_kit.resolved import Resolved, device_env
from dspark_kit.rundir import BEST_CHECKPOINT, RunDir, epoch_dirs
from dspark_kit.specdec.checkpoints import set_aside_incomplete_checkpoints
from dspark_kit.stages.plan import Process, StagePlan


def _override(flags: list[str], name: str, value: str) -> list[str]:
    """Set `--name value` in a flag list, replacing a device default."""
    if name in flags:
        i = flags.index(name)
        return flags[:i] + [name, value] + flags[i + 2 :]
    return flags + [name, value]


def online_generation_flags() -> list[str]:
    """What the installed speculators reads besides --vllm-endpoint/--on-missing generate.

    --on-generate delete: the seed passes it; speculators 0.9 ignores it with a
    FutureWarning (its files are always deleted after loading), so only older
    versions get it. --max-consecutive-generation-failures 1: a row whose hidden
    states never arrive (no hidden_states_path, token ids that differ from the
    row) stops training naming the row, instead of being dropped from the epoch.
    """
    from dspark_kit.compat.versions import speculators_reads

    flags = ["--on-generate", "delete"] if speculators_reads("train", "--on-generate") else []
    if speculators_reads("train", "--max-consecutive-generation-failures"):
        flags += ["--max-consecutive-generation-failures", "1"]
    return flags


# recipe key -> the installed speculators train flag (TrainerArgs in speculators/train/config/schema.py)
MEMORY_FLAGS = {"gradient_checkpointing": "--gradient-checkpointing", "fsdp_shard": "--fsdp-shard"}


def memory_flags(recipe: Recipe) -> list[str]:
    """train.gradient_checkpointing / train.fsdp_shard as speculators' flags; a release that lacks
    one is refused in one line (it would fail on an unknown flag after the verifier has loaded)."""
    from dspark_kit.compat.versions import speculators_option

    out = []
    for key, flag in MEMORY_FLAGS.items():
        if not getattr(recipe.train, key):
            continue
        if speculators_option("train", flag) == "absent":
            raise RecipeError(f"train.{key}: the installed speculators train has no {flag} (speculators 0.9.0 "
                              f"added it); upgrade speculators or set train.{key}: false")
        out.append(flag)
    return out


def build_train_args(
    recipe: Recipe,
    workdir: Path,
    *,
    verifier_path: str,
    num_hidden_layers: int,
    device: str,
    hidden_states_dtype: str,
    hidden_states_endpoint: str | None = None,
    mooncake=None,
) -> list[str]:
    """speculators train flags for this recipe (without the launcher); `hidden_states_dtype`
    (Resolved.hidden_states_out_dtype): fp8 files are read through hs-connectors' fp8 backend;
    `mooncake` (hs_transport.Mooncake, online): hidden states come through that store, not files."""
    d, t = recipe.draft, recipe.train
    paths = RunDir.at(workdir)
    args = [
        "--verifier-name-or-path", verifier_path,
        "--data-path", str(paths.prepared),
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
    args += memory_flags(recipe)
    if t.init_from:
        args = from_pretrained(args, recipe, t.init_from, num_hidden_layers, paths.init_vocab)
    if recipe.verifier.trust_remote_code:
        args += ["--trust-remote-code"]
    if hidden_states_dtype == "fp8":  # hs-connectors' reader for fp8 files: dequantizes to bf16
        args += ["--hidden-states-backend", "fp8"]
    if recipe.hidden_states.mode == "online":
        if not hidden_states_endpoint:
            raise ValueError("hidden_states.mode online needs a hidden-state server endpoint "
                             "(set hidden_states.endpoint or let `train` start one)")
        args += ["--vllm-endpoint", openai_base_url(hidden_states_endpoint), "--on-missing", "generate"]
        args += online_generation_flags()
        if mooncake is not None:
            args += mooncake.trainer_flags()
    else:
        args += ["--on-missing", "raise"]
    device_flags = train_flags(device)
    if d.attn_impl != "auto":
        device_flags = _override(device_flags, "--draft-attn-impl", d.attn_impl)
    if t.loss_implementation != "auto":
        device_flags = _override(device_flags, "--loss-implementation", t.loss_implementation)
    return args + device_flags + list(t.extra_args)


# speculators' decoder-shaping flags: --from-pretrained defines the draft and refuses them
SHAPING_FLAGS = {"--draft-arch": 1, "--num-layers": 1, "--sliding-window": 1, "--full-attention-indices": None}


def from_pretrained(args: list[str], recipe: Recipe, init_from: str, num_hidden_layers: int,
                    vocab_dir: Path) -> list[str]:
    """train.init_from: speculators' --from-pretrained (fine-tunes that draft's weights) in place
    of the flags that shape a new draft; a draft that does not fit the recipe is a ValueError. A
    reduced-vocabulary draft keeps its own token mapping (--d2t-path/--t2d-path into `vocab_dir`,
    which run() writes from its weights): speculators would otherwise map its lm_head rows through
    the mapping built from the new data's token counts."""
    from dspark_kit.specdec.checkpoints import (
        init_from_problem,
        init_vocab_files,
        init_vocab_mapping,
    )

    problem = init_from_problem(init_from, recipe, recipe.target_layer_ids(num_hidden_layers))
    if problem:
        raise ValueError(problem)
    out, i = [], 0
    while i < len(args):
        if args[i] in SHAPING_FLAGS:
            n = SHAPING_FLAGS[args[i]]
            i += 1
            if n is None:  # a list: every value up to the next flag
                while i < len(args) and not args[i].startswith("--"):
                    i += 1
            else:
                i += n
            continue
        out.append(args[i])
        i += 1
    out += ["--from-pretrained", str(Path(init_from).expanduser())]
    if init_vocab_mapping(Path(init_from).expanduser()):
        files = init_vocab_files(vocab_dir)
        out += ["--d2t-path", str(files["d2t"]), "--t2d-path", str(files["t2d"])]
    return out


def launch_plan(recipe: Recipe, train_args: list[str], device: str, rdzv=None) -> LaunchPlan:
    """One process, or torchrun when train.nproc > 1 or train.nnodes > 1.

    The rendezvous (addresses, backend, network interface) is decided by
    `dspark_kit.distributed.rendezvous`; its errors (loopback across nodes, no interface)
    stop the plan here rather than leave node 1 waiting forever.
    """
    from dspark_kit.distributed.rendezvous import rendezvous_for, require

    t = recipe.train
    entry = ["-m", "dspark_kit.compat.train_entry", "--dspark-device", device]
    rdzv = require(rdzv or rendezvous_for(recipe, device))
    if t.nproc > 1 or t.nnodes > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", *rdzv.torchrun_args(t.node_rank), *entry, *train_args]
    else:
        argv = [sys.executable, *entry, *train_args]
    env = device_env(device, t.devices)
    env.update(rdzv.socket_env)
    env.update(rdzv.elastic_env)
    return LaunchPlan(argv, env)


def node_plans(recipe: Recipe, train_args: list[str], device: str, rdzv=None) -> list[LaunchPlan]:
    """One launch plan per node (multi-node dry runs print them all), from one rendezvous decision."""
    from dspark_kit.distributed.rendezvous import rendezvous_for

    rdzv = rdzv or rendezvous_for(recipe, device)
    plans = []
    for rank in range(recipe.train.nnodes):
        r = recipe.model_copy(deep=True)
        r.train.node_rank = rank
        plans.append(launch_plan(r, train_args, device, rdzv))
    return plans


_EPOCH = re.compile(r"Training epoch (\d+)/(\d+) (started|completed)")
_STEP = re.compile(r"global_step[=': ]+(\d+)")
_EPOCH_BAR = re.compile(r"Epoch \d+:.*?\| *\d+/(\d+) ")  # the trainer's own epoch bar: "... 42/42 [00:30<..."


class TrainProgress:
    """Moves the train stage's line from what the trainer logs: the bar counts optimizer steps
    ("120/480 step", with rate and ETA) and the detail says the epoch. Steps per epoch are learned
    from the trainer's epoch bar or when the first epoch completes; until then the line shows the
    epoch and step with no ETA. (An ETA from whole epochs grew between them: the rate fell every
    second no epoch completed.) A resumed run's first logged step jumps the count, not the rate."""

    def __init__(self, bar):
        self.bar = bar
        self.epochs: int | None = None
        self.epoch = 0
        self.per_epoch: int | None = None
        self.done = 0  # steps done (global_step + 1 of the last logged step)
        self.epoch_start = 0
        self.total: int | None = None

    def feed(self, line: str) -> None:
        if m := _EPOCH.search(line):
            self.epochs, self.epoch = int(m.group(2)), int(m.group(1))
            if m.group(3) == "started":
                self.epoch_start = self.done
            elif self.per_epoch is None and self.done > self.epoch_start:
                # global steps at the end of epoch N are N epochs' worth: right for a resumed run too,
                # whose first epoch here is partial (counted from its start it gave 794 of 878 steps)
                self._per_epoch(self.done // self.epoch)
        elif m := _STEP.search(line):
            step = int(m.group(1)) + 1
            if step > self.done:
                self.bar.advance(step - self.done)
                self.done = step
        elif (m := _EPOCH_BAR.search(line)) and self.per_epoch is None:
            self._per_epoch(int(m.group(1)))
        else:
            return
        if self.total is None and self.per_epoch and self.epochs:
            self.total = self.epochs * self.per_epoch
            self.bar.total(self.total)
        self.bar.describe(f"epoch {self.epoch}/{self.epochs}" if self.epochs else "starting")

    def _per_epoch(self, steps: int) -> None:
        self.per_epoch = steps


STOP_GRACE_S = 30.0  # SIGTERM lets speculators save an "interrupted" checkpoint; then SIGKILL


def run_training(plan: LaunchPlan, log_path: Path,
                 watch: Callable[[], str | None] | None = None,
                 reporter: Reporter = STANDALONE) -> tuple[int, str | None]:
    """Run the plan with its output in `log_path` (and on the console when `reporter` echoes child
    output: a stage command, `run -v`; else its epochs move `reporter`'s bar); returns (exit code,
    why the server it needs is gone, or None): processes.run_logged, with the trainer's progress.

    speculators answers SIGTERM by saving an "interrupted" checkpoint and often exits 0: a
    returned reason means the training is unfinished whatever the exit code.
    """
    from dspark_kit import processes

    echo = reporter.echo_children
    with contextlib.nullcontext() if echo else reporter.bar("train", None, "step") as bar:
        progress = TrainProgress(bar)
        return processes.run_logged(plan.argv, {**os.environ, **plan.env}, log_path, watch=watch, echo=echo,
                                    on_line=None if echo else progress.feed, grace_s=STOP_GRACE_S)


def training_failure(code: int, log_path: Path, since: int = 0, endpoint: str | None = None) -> str:
    """The train stage's error for exit `code`: the refusal line when a fix probe failed, the
    prepared row whose hidden states never arrived from `endpoint` (online). Without the stage's
    name: whoever reports the error names the stage (`dspark-kit train`: "train: ..."; `run`:
    its "x train failed" line).

    `since`: the log's size before this run (train.log is appended to across runs).
    """
    from dspark_kit.compat.train_entry import REFUSAL_PREFIX
    from dspark_kit.logs import failed_row, log_since

    text = log_since(log_path, since)
    for line in text.splitlines():
        if line.startswith(REFUSAL_PREFIX):
            return line[len(REFUSAL_PREFIX):]
    row = failed_row(text, _BREAKER)
    if row is not None:
        where = f" from {endpoint}" if endpoint else ""
        return f"hidden states for prepared row {row[0]}{where} failed: {row[1]}; see {log_path}"
    if _FUSED_UNDER_COMPILE.search(text):
        return ("speculators' fused (Triton) loss failed inside torch.compile (seen with torch 2.11 and "
                "speculators 0.9.0 on CUDA); train with the eager loss: --set train.loss_implementation=eager; "
                f"see {log_path}")
    return f"speculators train exited with {code}; see {log_path}"


# torch.compile tracing speculators' fused loss kernels fails (dynamo traces the Triton autotune
# configs of losses/fused.py); measured on an H200 with torch 2.11.0+cu130, where eager trains
_FUSED_UNDER_COMPILE = re.compile(r"speculators_dot_losses_dot_fused.*tracked for mutation|"
                                  r"tracked for mutation.*speculators_dot_losses_dot_fused")

# speculators' data-generation circuit breaker (tripped at once by --max-consecutive-generation-failures 1)
_BREAKER = re.compile(r"circuit breaker tripped.*?file index (\d+) \(attempt [^)]*\): (.*)")


def read_val_metrics(checkpoints: Path) -> dict | None:
    """val metrics of the best (else latest) checkpoint, as speculators saved them."""
    best = checkpoints / BEST_CHECKPOINT
    cands = [best] if best.exists() else epoch_dirs(checkpoints)[-1:]
    for c in cands:
        f = c / "val_metrics.json"
        if f.exists():
            return {"checkpoint": str(c.resolve()), **json.loads(f.read_text())}
    return None


# ---- the stage ---------------------------------------------------------------


def plan(res: Resolved) -> StagePlan:
    """The hidden-state server and Mooncake master train starts (online mode), and the exact
    training command(s), one per node with the rendezvous decision (raises RecipeError or
    RuntimeError when unplannable)."""
    from dspark_kit.distributed.rendezvous import rendezvous_for
    from dspark_kit.engines import shell_line

    recipe, hs = res.recipe, res.recipe.hidden_states
    lines: list[str] = []
    processes: list[Process] = []
    endpoint = hs.endpoint
    if hs.mode == "online" and not hs.endpoint:  # train starts the extraction server itself
        from dspark_kit.stages.server_plan import server_plan

        server = server_plan(res, "hidden-states")
        endpoint = server.base_url
        if res.mooncake is not None:
            from dspark_kit.engines.servers import mooncake_master_plan

            mc = res.mooncake
            master = mooncake_master_plan(mc)
            if mc.start_on_node == recipe.train.node_rank:
                processes.append(Process("mooncake master", master))
            lines += [*mc.node_lines(), "# mooncake master (node 0)", shell_line(master.argv, {})]
        processes.append(Process("hidden-state server", server))
        lines += ["# hidden-state server train starts (online mode)", server.shell_line()]
    device = res.train_device.value
    args = build_train_args(recipe, res.run.root, verifier_path=res.verifier_path, device=device,
                            hidden_states_dtype=res.hidden_states_out_dtype.value,
                            num_hidden_layers=res.num_hidden_layers, hidden_states_endpoint=endpoint,
                            mooncake=res.mooncake)
    rdzv = rendezvous_for(recipe, device)
    trainers = node_plans(recipe, args, device, rdzv)
    if res.mooncake is not None and hs.mode == "online":
        for t in trainers:
            t.env.update(res.mooncake.env())  # the address this node's trainer joins the store as
    processes += [Process("trainer", t, node=i) for i, t in enumerate(trainers)]
    from dspark_kit.resolved.memory_plan import plan_lines as memory_lines

    lines += memory_lines(res)  # before the command(s): a dry run's last line stays the trainer's
    if len(trainers) == 1:
        lines.append(trainers[0].shell_line())
    else:
        lines += [f"# {rdzv.summary()}", *(f"# warning: {w}" for w in rdzv.warnings)]
        lines.append("# on node K run `dspark-kit train --set train.node_rank=K` (or its line below): it resolves "
                     "that node's own interface" + (" and address (--local-addr); node 0 hosts the c10d store"
                                                    if rdzv.backend == "c10d" else ""))
        here = "" if rdzv.same_host else " (this machine)"
        lines += [line for i, t in enumerate(trainers)
                  for line in (f"# node {i}{here if i == rdzv.this_rank else ''}", t.shell_line())]
    inputs = {"prepared": str(res.run.prepared), "verifier": res.verifier_path}
    if hs.mode == "offline":
        inputs["hidden_states"] = str(res.run.hidden_states)
    elif endpoint:
        inputs["hidden_states_endpoint"] = endpoint
    staged = StagePlan.of(res, "train", lines, processes, inputs, {"checkpoints": str(res.run.checkpoints)})
    if recipe.train.nnodes > 1:  # the run waits on and watches this decision, not a second reading of the host
        staged.details["rendezvous"] = rdzv.as_dict()
    return staged


def run(res: Resolved, plan: StagePlan, reporter: Reporter = STANDALONE) -> dict:
    from contextlib import ExitStack

    from dspark_kit.distributed.rendezvous import (
        MasterWatch,
        Rendezvous,
        store_failure,
        wait_for_store,
    )
    from dspark_kit.logs import log_since
    from dspark_kit.specdec.checkpoints import adopt_interrupted, init_vocab_files, write_init_vocab
    from dspark_kit.stages.manifest import update_manifest
    from dspark_kit.stages.preflight.checks import enforce

    recipe, run = res.recipe, res.run
    enforce(res, "train", log=reporter.note)
    for d in set_aside_incomplete_checkpoints(run.checkpoints):
        reporter.note(f"train: {d.name} was cut off mid-save by an earlier run; kept aside, resuming from the last whole epoch")
    if (adopted := adopt_interrupted(run.checkpoints)) is not None:
        reporter.note(f"train: {adopted}")
    t0 = time.time()
    trainer = next(p for p in plan.processes if p.role == "trainer" and p.node == recipe.train.node_rank).launch
    # the plan's decision (from_pretrained): a reduced-vocabulary draft's own mapping, in the files it names
    if recipe.train.init_from and str(init_vocab_files(run.init_vocab)["d2t"]) in trainer.argv:
        write_init_vocab(Path(recipe.train.init_from).expanduser(), run.init_vocab)
        reporter.note(f"train: train.init_from's own draft vocabulary mapping kept ({run.init_vocab}), not one "
                      "built from this run's token counts")
    recorded = plan.details.get("rendezvous")
    rdzv = Rendezvous.from_dict(recorded) if recorded else None  # the plan's decision: the host is not re-read
    if rdzv is not None:
        wait_for_store(rdzv)  # node K > 0: node 0's store answers within rdzv_timeout, else one line
    with ExitStack() as stack:
        endpoint = None  # offline: nothing to watch
        master, server = plan.process("mooncake master"), plan.process("hidden-state server")
        if master is not None:  # before the server that joins it (transport mooncake)
            from dspark_kit.engines.servers import started

            stack.enter_context(started(master.server, run.mooncake_log, recipe.serve.startup_timeout))
        if server is not None or (recipe.hidden_states.mode == "online" and recipe.hidden_states.endpoint):
            from dspark_kit.stages.server_plan import hidden_state_server

            # the one started here, or the recipe's endpoint: both watched while training uses them
            endpoint = stack.enter_context(hidden_state_server(res, server.server if server else None))
        update_manifest(run.root, recipe, "train", resolved=res, argv=trainer.argv, env=trainer.env)
        run.logs.mkdir(parents=True, exist_ok=True)
        log = run.train_log
        since = log.stat().st_size if log.exists() else 0
        store = MasterWatch(rdzv) if rdzv is not None else None  # node 0's rendezvous store, from node K
        watches = [w for w in (endpoint.gone if endpoint else None, store.gone if store and store.active else None)
                   if w is not None]
        code, gone = run_training(trainer, log, watch=_first_reason(watches) if watches else None, reporter=reporter)
    if gone and store is not None and store.silent_since is not None:
        raise RuntimeError(gone)  # names the lost master and the fix
    if gone:
        raise RuntimeError(f"{gone}; training stopped. Rerun the same command to resume (from the checkpoint "
                           "speculators saves when stopped, else the last whole epoch)")
    if code != 0:
        lost = store_failure(log_since(log, since), rdzv) if rdzv is not None else None
        raise RuntimeError(lost or training_failure(code, log, since, endpoint.url if endpoint else None))
    if (stopped := stopped_from_outside(run.checkpoints)) is not None:
        raise RuntimeError(stopped)
    metrics = read_val_metrics(run.checkpoints) or {}
    return {"seconds": round(time.time() - t0, 1), **metrics}


def stopped_from_outside(checkpoints: Path) -> str | None:
    """Why a trainer that exited 0 did not finish, or None: speculators answers a SIGINT or SIGTERM
    from outside the kit (a `kill`, a scheduler's pre-emption) by saving `interrupted` and exiting 0,
    so exit 0 alone would record an unfinished training as done, and a rerun would skip it. Any
    `interrupted` save there is this run's: run() adopts or sets aside an earlier one before training."""
    from dspark_kit.specdec.checkpoints import INTERRUPTED

    saved = Path(checkpoints) / INTERRUPTED
    if not saved.is_dir() or saved.is_symlink():
        return None
    return (f"the trainer was stopped by a signal before its last epoch and exited 0 (speculators saved "
            f"{saved}); training is unfinished. Rerun the same command to resume from that save")


def _first_reason(watches):
    """One watch from several: the first reason any of them gives."""
    return lambda: next((why for w in watches if (why := w()) is not None), None)
