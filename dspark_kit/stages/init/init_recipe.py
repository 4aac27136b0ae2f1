"""`dspark-kit init`: a complete recipe for your own verifier, every derived value commented.

Reads the verifier's config.json, tokenizer and chat template (never the weights) through
specdec.verifier_facts, optionally samples the data's token lengths (data.lengths), and
writes a recipe in which each derived key carries a YAML comment saying where it came from.
Values that are a choice rather than a fact come from a device profile: on CPU the tiny
demo recipe's (recipes/tiny-cpu.yaml), on accelerators the reference Ascend run's
(recipes/qwen3-30b-a3b-ultrachat-ascend.yaml, docs/ASCEND.md). The file is validated as a
recipe before it is renamed into place; on any error nothing is written.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dspark_kit import atomic
from dspark_kit.recipe import RecipeError, load_recipe
from dspark_kit.recipe.schema import (
    DEFAULT_HIDDEN_STATES_PORT,
    DEFAULT_RDZV_PORT,
    DEFAULT_SERVE_PORT,
    FREE_PORT,
)
from dspark_kit.rundir import BEST_CHECKPOINT
from dspark_kit.stages.init.commented_yaml import CommentedYaml

ENGINE_BY_DEVICE = {"cpu": "local", "cuda": "vllm", "npu": "vllm-ascend"}
DEFAULT_ACCELERATORS = 4  # the reference run's four NPUs: train on 0,1, serve on 2,3 with TP 2
SAMPLE_ROWS = 256  # conversations read to measure data.seq_length
SEQ_ROUND = 256

# What is a choice, not a fact about the verifier: the demo's values on CPU (tests check they match
# recipes/tiny-cpu.yaml), the reference Ascend run's on accelerators.
CPU_PROFILE = {
    "draft": {"block_size": 4, "num_layers": 1, "markov_rank": 32},
    "data": {"source": "builtin:tiny-chat", "limit": 256, "seq_length": 256, "num_workers": 1},
    "regen": {"concurrency": 8, "max_tokens": 64},
    "train": {"epochs": 8, "lr": 0.003, "max_anchors": 64, "num_workers": 0, "train_data_ratio": 0.875},
    "serve": {"port": FREE_PORT, "hidden_states_port": FREE_PORT},  # as the demo: never collides
    "bench": {"num_prompts": 8, "concurrency": 4, "max_tokens": 48},
    "eval": {"num_prompts": 8, "max_new_tokens": 48},
}
# A real model on CPU (recipes/smollm2-135m-cpu.yaml's choices; tests check they match): the kit's
# instruction set, replies long enough for an instruct model's answers, one draft layer reading three
# verifier layers, a reduced draft vocabulary (its head is most of a small draft's cost on CPU).
REAL_CPU_PROFILE = {
    "draft": {"block_size": 4, "num_layers": 1, "target_layers": 3, "markov_rank": 64, "draft_vocab_size": 8192},
    "data": {"source": "builtin:instructions", "limit": 320, "num_workers": 1, "keep_truncated": True},
    "regen": {"concurrency": 16, "engine": "fastest", "repeated_prompts": "drop"},
    "train": {"epochs": 2, "lr": 0.002, "max_anchors": 32, "num_workers": 0, "train_data_ratio": 0.9},
    "serve": {"port": FREE_PORT, "hidden_states_port": FREE_PORT},
    # sized for a CPU check: a float32 step of a 135M model reads its 540 MB of weights (~0.1 s on 2
    # cores), and eval decodes each set five times (the fixed K and three confidence cut-offs)
    "bench": {"num_prompts": 8, "concurrency": 4, "max_tokens": 64},
    "eval": {"num_prompts": 8, "max_new_tokens": 64, "categories": ["humaneval"]},
}
# An instruct model's reply to the kit's instructions (length hints up to "two short paragraphs"):
# SmolLM2-135M-Instruct's greedy replies, measured (docs/PERFORMANCE.md), fit 256 tokens but for a few
REAL_REPLY_TOKENS = 256
ACCELERATOR_PROFILE = {
    "draft": {"block_size": 8, "num_layers": 5, "markov_rank": 256},
    "data": {"source": "ultrachat", "limit": 20000, "seq_length": 8192, "num_workers": 8},
    "regen": {"concurrency": 64},
    "train": {"epochs": 2, "lr": 0.0003, "max_anchors": 256, "num_workers": 4, "train_data_ratio": 0.9},
    "serve": {"port": DEFAULT_SERVE_PORT, "hidden_states_port": DEFAULT_HIDDEN_STATES_PORT},
    "bench": {"num_prompts": 10, "concurrency": 10, "max_tokens": 1024},
    "eval": {"num_prompts": 8, "max_new_tokens": 64},
}


class InitError(ValueError):
    """`init` cannot write a recipe; one line naming the flag and the fix."""


@dataclass
class InitOptions:
    verifier: str
    output: Path
    data: str | None = None
    device: str = "auto"  # cpu | cuda | npu | auto (this machine's)
    nodes: int = 1
    num_devices: int | None = None  # accelerators per node (default: visible here, else 4)
    thinking: bool | None = None  # None: from the chat template
    mask_token_id: int | None = None
    master_addr: str | None = None
    force: bool = False
    device_memory_gib: float | None = None  # one training device's memory (default: this machine's device)
    trust_remote_code: bool = False  # run the Python files the verifier folder's auto_map names


@dataclass
class NewRecipe:
    path: Path
    text: str
    derived: list[tuple[str, str, str]] = field(default_factory=list)  # (key, value, where from)
    warnings: tuple[str, ...] = ()  # what looks wrong in the verifier but does not stop the recipe
    memory: list[str] = field(default_factory=list)  # the training memory plan of the written recipe


def _where(opts: InitOptions):
    """The verifier's loadable path and the device, decided as every command decides them (Resolved)."""
    from dspark_kit.recipe import Recipe
    from dspark_kit.resolved import Resolved

    if opts.device not in ("auto", "cpu", "cuda", "npu"):
        raise InitError(f"--target-device {opts.device!r}: expected cpu, cuda, npu or auto")
    res = Resolved(Recipe.model_validate({"verifier": {"path": opts.verifier}, "train": {"device": opts.device}}))
    return res.verifier_path, res.train_device.value


def _tiny(verifier: str) -> bool:
    """A builtin tiny verifier: the tiny demo's profile fits it (a real model gets REAL_CPU_PROFILE)."""
    from dspark_kit.data.families import family_of_builtin

    return family_of_builtin(verifier) is not None


def _split_devices(n: int, heads: int | None) -> tuple[list[int], list[int]]:
    """(trainer ids, server ids) on one node: the server gets the largest power of two up to half the
    devices that divides the attention heads (its tensor-parallel size), the trainer the rest."""
    if n == 1:
        return [0], [0]
    tp = 1
    while tp * 2 <= n // 2 and (heads is None or heads % (tp * 2) == 0):
        tp *= 2
    return list(range(n - tp)), list(range(n - tp, n))


def _ids(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def _seq_length(opts: InitOptions, facts, profile: dict, thinking: bool) -> tuple[int, str]:
    max_pos = facts.max_position_embeddings
    cap = f"; cap: max_position_embeddings {max_pos}" if max_pos else ""
    if opts.data is None and profile is REAL_CPU_PROFILE:  # the builtin prompts + the reply budget
        from dspark_kit.data.lengths import sample_lengths

        s = sample_lengths(profile["data"]["source"], facts.tokenizer, thinking, SAMPLE_ROWS)
        seq = -(-(s.p99 + REAL_REPLY_TOKENS) // SEQ_ROUND) * SEQ_ROUND
        how = (f"p99 of {s.rows} {profile['data']['source']} prompts in its chat template = {s.p99} tokens, plus "
               f"regen.max_tokens {REAL_REPLY_TOKENS}, rounded up to {SEQ_ROUND}{cap}")
    elif opts.data is None:
        seq = profile["data"]["seq_length"]
        how = f"profile default (no --data to measure){cap}"
    else:
        from dspark_kit.data.lengths import sample_lengths

        s = sample_lengths(opts.data, facts.tokenizer, thinking, SAMPLE_ROWS)
        seq = max(SEQ_ROUND, -(-s.p99 // SEQ_ROUND) * SEQ_ROUND)
        how = (f"p99 of {s.rows} sampled chats = {s.p99} tokens (median {s.p50}, longest {s.longest}), "
               f"rounded up to {SEQ_ROUND}{cap}{s.skipped_note()}")
    if max_pos and seq > max_pos:
        seq = max_pos
    return seq, how


def _master_addr(opts: InitOptions) -> tuple[str, str]:
    if opts.master_addr:
        return opts.master_addr, "--master-addr"
    from dspark_kit.distributed.rendezvous import this_machine_address

    addr = this_machine_address()
    if addr is None:
        raise InitError(f"--nodes {opts.nodes}: this machine has no non-loopback address; pass --master-addr "
                        "with node 0's address every node can reach")
    return addr, "this machine's address: run init on node 0, or pass --master-addr"


@dataclass
class _Decided:
    """Every value derived from the verifier, the data and the machine, with where it came from."""

    opts: InitOptions
    facts: Any  # specdec.verifier_facts.VerifierFacts
    device: str
    profile: dict
    thinking: bool
    thinking_from: str
    seq: int
    seq_from: str
    mask: int
    mask_from: str
    targets: list[int]
    targets_from: str
    n_dev: int = 0
    n_dev_from: str = ""
    train_ids: list[int] = field(default_factory=list)
    serve_ids: list[int] = field(default_factory=list)
    memory: dict = field(default_factory=dict)  # train settings the memory plan chose so training fits
    memory_lines: list[str] = field(default_factory=list)

    @property
    def accel(self) -> bool:
        return self.device != "cpu"

    @property
    def max_model_len(self) -> int:
        """serve.max_model_len: the training length on an accelerator (2x on CPU), capped by the
        verifier's own limit."""
        max_len = self.seq if self.accel else 2 * self.seq
        limit = self.facts.max_position_embeddings
        return min(max_len, limit) if limit else max_len

    def reply_budget(self, wanted: int) -> tuple[int, str | None]:
        """A request's max_tokens that leaves a quarter of serve.max_model_len for the prompt (a prompt
        plus max_tokens past max_model_len is a 400: every request, when they are equal)."""
        room = self.max_model_len * 3 // 4
        return (wanted, None) if wanted <= room else (room, f"3/4 of serve.max_model_len {self.max_model_len}")


def _decide(opts: InitOptions) -> _Decided:
    from dspark_kit.specdec import verifier_facts as vf

    if opts.nodes < 1:
        raise InitError(f"--nodes {opts.nodes}: must be >= 1")
    location, device = _where(opts)
    profile = ACCELERATOR_PROFILE if device != "cpu" else CPU_PROFILE if _tiny(opts.verifier) else REAL_CPU_PROFILE
    try:
        facts = vf.read_verifier_facts(opts.verifier, location, trust_remote_code=opts.trust_remote_code)
        if opts.mask_token_id is not None:
            if not 0 <= opts.mask_token_id < facts.vocab_size:
                raise InitError(f"--mask-token-id {opts.mask_token_id}: outside the embedding [0, {facts.vocab_size})")
            mask, mask_from = opts.mask_token_id, "--mask-token-id"
        else:
            mask, mask_from = vf.mask_token_choice(facts.vocab_size, facts.tokenizer_len, facts.tokenizer_mask,
                                               facts.reserved, facts.unused)
        draft = profile["draft"]
        targets, targets_from = vf.dflash_layer_ids(facts.num_layers, draft.get("target_layers", draft["num_layers"]),
                                                     list(facts.layer_types or []) or None)
        if "target_layers" in draft:
            targets_from = (f"{draft['target_layers']} verifier layers for {draft['num_layers']} draft layer(s) "
                            f"(a real model: more of its depth than one layer): {targets_from}")
    except vf.VerifierFactsError as e:
        raise InitError(str(e)) from None
    always = facts.reasoning is not None and facts.reasoning.always  # Harmony: every reply reasons, no switch
    thinking = (always or bool(facts.thinking_default)) if opts.thinking is None else opts.thinking
    thinking_from = ("--thinking" if opts.thinking else "--no-thinking") if opts.thinking is not None else (
        f"the verifier always reasons ({facts.reasoning.name}: no switch; vLLM --reasoning-parser "
        f"{facts.reasoning.parser})" if always else
        "the chat template has no enable_thinking switch" if facts.thinking_default is None else
        f"the chat template's default: enable_thinking unset renders as {str(facts.thinking_default).lower()}")
    try:
        seq, seq_from = _seq_length(opts, facts, profile, thinking)
    except ValueError as e:
        raise InitError(str(e)) from None
    d = _Decided(opts, facts, device, profile, thinking, thinking_from, seq, seq_from, mask, mask_from,
                 targets, targets_from)
    if d.accel:
        d.n_dev, d.n_dev_from = _num_devices(opts, device)
        d.train_ids, d.serve_ids = _split_devices(d.n_dev, facts.num_attention_heads)
    return d


def _verifier_data_regen(w: CommentedYaml, d: _Decided) -> None:
    opts, facts, profile = d.opts, d.facts, d.profile
    w.section("verifier", f"{facts.architecture}, read from config.json, tokenizer and chat template")
    local = Path(opts.verifier).expanduser()
    if local.is_dir() or local.is_file():  # absolute (a folder or a GGUF file): the same from any directory
        w.key("path", str(local.resolve()), "" if local.is_absolute() else f"--verifier {opts.verifier}, made absolute")
    else:
        w.key("path", opts.verifier)
    w.key("thinking", d.thinking, f"{d.thinking_from} (docs/PITFALLS.md, pitfall 4)",
          show="chat template" if opts.thinking is None else "flag")
    w.key("trust_remote_code", opts.trust_remote_code,
          "--trust-remote-code: the folder's own code (auto_map) runs" if opts.trust_remote_code else
          "config.json names code (auto_map) that is not needed: transformers knows the model" if facts.remote_code
          else "config.json has no auto_map", show="--trust-remote-code" if opts.trust_remote_code else None)
    dtype = (facts.dtype if facts.dtype in ("bfloat16", "float16") else "bfloat16") if d.accel else "float32"
    w.key("dtype", dtype, f"config.json dtype {facts.dtype}" if d.accel else "CPU: float32 (bf16 is slow there)")
    w.key("num_hidden_layers", facts.num_layers, f"config.json (hidden size {facts.hidden_size}); lets dry runs "
                                                 "plan where the model is absent")
    w.section("data")
    source = opts.data or profile["data"]["source"]
    if opts.data and Path(opts.data).expanduser().exists():
        source = str(Path(opts.data).expanduser().resolve())
    w.key("source", source, "--data" if opts.data else "no --data: the profile's chats (pass --data FILE.jsonl)")
    w.key("limit", profile["data"]["limit"], "rows regenerated and trained (profile)")
    shown = "p99 of the data" + ("; unusable rows skipped (see its comment)" if "skipped" in d.seq_from else "")
    real = "prompts' p99 + regen.max_tokens" if profile is REAL_CPU_PROFILE else "profile (no --data)"
    w.key("seq_length", d.seq, d.seq_from, show=shown if opts.data else real)
    w.key("num_workers", profile["data"]["num_workers"])
    if "keep_truncated" in profile["data"]:
        w.key("keep_truncated", profile["data"]["keep_truncated"],
              "a reply regen.max_tokens cut trains up to where the verifier stopped: the long answers are the "
              "ones cut, and a draft trained without them drafts long answers worst (measured on SmolLM2)")
    w.section("regen", "on-policy replies from the verifier itself (docs/PITFALLS.md, pitfall 3)")
    w.key("endpoints", [], "empty: the run starts a chat server; list several servers to shard")
    if "engine" in profile["regen"]:
        w.key("engine", profile["regen"]["engine"], "vLLM's CPU build when installed (it batches requests), else "
                                                    "serve.engine; the stage says which ran")
    w.key("concurrency", profile["regen"]["concurrency"])
    real = profile is REAL_CPU_PROFILE and opts.data is None
    wanted = REAL_REPLY_TOKENS if real else profile["regen"].get("max_tokens", d.seq)
    max_tokens, capped = d.reply_budget(wanted)
    why = ("an instruct model's reply to the builtin instructions (regen says so when over 5% are cut)" if real
           else "profile" if "max_tokens" in profile["regen"] else "= data.seq_length")
    w.key("max_tokens", max_tokens, capped or why)
    w.key("temperature", 0.0, "greedy: the draft learns what greedy serving accepts")
    if "repeated_prompts" in profile["regen"]:
        w.key("repeated_prompts", profile["regen"]["repeated_prompts"],
              "a prompt asked twice is sent once: greedy regen would write the same reply again, a duplicate "
              "row that makes validation read high")
    w.key("seed", 42)


def _hidden_states_draft(w: CommentedYaml, d: _Decided) -> None:
    from dspark_kit.specdec.verifier_facts import draft_arch

    w.section("hidden_states")
    if d.accel and len(set(d.train_ids) | set(d.serve_ids)) > 1:
        w.key("mode", "online", "the trainer asks an extraction server on serve.devices (no files on disk)")
        w.key("backend", "vllm")
    elif d.accel:
        w.key("mode", "offline", "one device: the extraction server runs before training, not beside it")
        w.key("backend", "vllm")
    else:
        w.key("mode", "offline", "CPU: computed in-process with transformers")
        w.key("backend", "local")
    w.key("target_layer_ids", d.targets, f"{d.targets_from} (docs/CONCEPTS.md#layer-ids)", show=d.targets_from)
    if d.accel:
        w.key("storage_path", "/tmp/hidden_states", "the server and the trainer share a node")
    which = "reference run" if d.accel else "tiny demo" if d.profile is CPU_PROFILE else "real-model CPU profile"
    w.section("draft", f"block size and layers: the {which}'s")
    arch, arch_from = draft_arch(d.facts.model_type)
    w.key("arch", arch, arch_from)
    w.key("block_size", d.profile["draft"]["block_size"], "trained slots; K <= block_size", show=which)
    w.key("num_layers", d.profile["draft"]["num_layers"], show=which)
    w.key("mask_token_id", d.mask, f"{d.mask_from} (docs/CONCEPTS.md#the-mask-token)",
          show=d.mask_from.split(":")[0])
    w.key("markov_rank", d.profile["draft"]["markov_rank"])
    reduced = d.profile["draft"].get("draft_vocab_size")
    if reduced and reduced < d.facts.vocab_size:
        w.key("draft_vocab_size", reduced, f"the {reduced} most frequent tokens of the regenerated replies, of "
                                           f"{d.facts.vocab_size}: the draft's head is most of its cost on CPU")
    w.key("confidence_head", True)
    w.key("attention", "full", "every layer trained with full attention (docs/PITFALLS.md, pitfall 2)")
    npu = d.device == "npu"
    w.key("attn_impl", "sdpa" if npu else "auto", "NPU: no flex attention" if npu else "flex attention on CUDA, sdpa on CPU")


def _train(w: CommentedYaml, d: _Decided) -> None:
    opts, profile = d.opts, d.profile
    w.section("train")
    for key in ("epochs", "lr"):
        w.key(key, profile["train"][key])
    w.key("optimizer", "adamw", "set explicitly: speculators defaults to muon")
    w.key("loss", {"ce": 0.7, "tv": 0.3})
    fit = "the memory plan: the profile's value does not fit one training device"
    w.key("max_anchors", d.memory.get("max_anchors", profile["train"]["max_anchors"]),
          fit if "max_anchors" in d.memory else "")
    if d.memory.get("gradient_checkpointing"):
        w.key("gradient_checkpointing", True, fit.replace("value does", "settings do"))
    if d.memory.get("fsdp_shard"):
        w.key("fsdp_shard", True, fit.replace("value does", "settings do"))
    if opts.device_memory_gib is not None:
        w.key("device_memory_gib", opts.device_memory_gib, "--device-memory-gib", show="--device-memory-gib")
    w.key("logger", "tensorboard")
    given = opts.device != "auto"
    w.key("device", d.device, "--target-device" if given else "this machine's device",
          show="--target-device" if given else "this machine")
    w.key("nproc", max(1, len(d.train_ids)), "one process per training device")
    if d.accel:
        w.key("devices", _ids(d.train_ids), f"{d.n_dev} devices per node ({d.n_dev_from}): the trainer's share",
              show=f"{len(d.train_ids)} of {d.n_dev} devices")
    for key in ("num_workers", "train_data_ratio"):
        w.key(key, profile["train"][key])
    w.key("seed", 42)
    if opts.nodes > 1:
        addr, addr_from = _master_addr(opts)
        w.key("nnodes", opts.nodes, "--nodes: one recipe; node K runs train with --set train.node_rank=K (docs/MULTINODE.md)",
              show="--nodes")
        w.key("master_addr", addr, addr_from, show=addr_from.split(":")[0])
        w.key("master_port", DEFAULT_RDZV_PORT)
        w.key("rdzv_backend", "auto", "c10d across nodes: elastic, restarts resume from the last epoch")
        w.key("max_restarts", 0, "raise to survive a worker failure")


def _serve_bench_eval(w: CommentedYaml, d: _Decided) -> None:
    facts, profile = d.facts, d.profile
    w.section("serve")
    w.key("engine", ENGINE_BY_DEVICE[d.device], f"device {d.device}", show=f"device {d.device}")
    w.key("port", profile["serve"]["port"])
    w.key("hidden_states_port", profile["serve"]["hidden_states_port"])
    if d.accel:
        heads = facts.num_attention_heads
        w.key("tensor_parallel_size", len(d.serve_ids),
              "the serving devices" + (f" (divides {heads} attention heads)" if heads else ""))
        w.key("devices", _ids(d.serve_ids), "the serving engine's share, tensor parallel over them",
              show=f"{len(d.serve_ids)} of {d.n_dev} devices, TP {len(d.serve_ids)}")
        npu = d.device == "npu"
        w.key("gpu_memory_utilization", 0.85 if npu else 0.9)
        w.key("enforce_eager", npu, "vLLM-Ascend: eager, as the reference run" if npu else "")
    max_len = d.max_model_len
    w.key("max_model_len", max_len, ("= data.seq_length; longer contexts need a draft window "
                                     "(docs/CONCEPTS.md#long-context)") if d.accel else "2x data.seq_length")
    w.key("checkpoint", BEST_CHECKPOINT)
    w.key("num_speculative_tokens", "auto", "the tune's K, else the trained slots "
                                            "(docs/CONCEPTS.md#k-and-the-draft-window)", show="decided at serve time")
    w.key("draft_window_size", "auto", "the tune's window, else the training window; none on CUDA vLLM",
          show="decided at serve time")
    for section in ("bench", "eval"):
        w.section(section)
        for key, value in profile[section].items():
            if section == "bench" and key == "max_tokens":
                value, capped = d.reply_budget(value)
                w.key(key, value, capped or "")
            else:
                w.key(key, value)


def _fit_memory(d: _Decided, text: str) -> None:
    """Settings that make training fit one device (the cheapest first: gradient checkpointing, a
    smaller max_anchors, fsdp_shard, shorter sequences), from the memory plan of the recipe `text`."""
    import yaml

    from dspark_kit.recipe import recipe_from_dict
    from dspark_kit.resolved import Resolved
    from dspark_kit.resolved.memory_plan import plan_for

    try:
        res = Resolved(recipe_from_dict(yaml.safe_load(text)), planning=True)
        plan = plan_for(res)
    except (RecipeError, OSError, ValueError):
        return  # the dry run says why it is not planned
    if plan.trainer.fits is not False:
        d.memory_lines = plan.lines()
        return
    ckpt = {"gradient_checkpointing": True}
    a = plan.max_anchors
    tries = [ckpt, {**ckpt, "max_anchors": a // 2}, {**ckpt, "max_anchors": a // 4}]  # at most a quarter before fsdp
    sharded = {**ckpt, "fsdp_shard": True} if plan.ranks > 1 else ckpt
    if plan.ranks > 1:
        tries.append(sharded)
    anchors = a // 8
    while anchors >= 8:
        tries.append({**sharded, "max_anchors": anchors})
        anchors //= 2
    seq = plan.seq_length // 2
    while seq >= 256:
        tries.append({**sharded, "seq_length": seq})
        seq //= 2
    for changes in tries:
        fitted = plan_for(res, **changes)
        if fitted.trainer.fits:
            d.memory, d.memory_lines = changes, fitted.lines()
            if "seq_length" in changes:
                d.seq, d.seq_from = changes["seq_length"], "the memory plan: longer rows do not fit one training device"
            return
    d.memory_lines = plan.lines()  # nothing fits: init's own preflight names the device


def derive(opts: InitOptions) -> NewRecipe:
    """The recipe text and the derived-value table for `opts` (nothing written); training settings
    are then changed until the recipe's memory plan fits one training device."""
    d = _decide(opts)
    new = _render(opts, d)
    _fit_memory(d, new.text)
    if d.memory:
        new = _render(opts, d)
    new.memory = d.memory_lines
    return new


def _render(opts: InitOptions, d: _Decided) -> NewRecipe:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", opts.output.stem).strip("-") or "my-verifier"
    w = CommentedYaml()
    w.top("name", name, "from the output file name")
    w.top("workdir", f"runs/{name}", "on storage every node mounts at the same path" if opts.nodes > 1 else "")
    for part in (_verifier_data_regen, _hidden_states_draft, _train, _serve_bench_eval):
        part(w, d)
    profile = ("the reference Ascend run's profile." if d.accel else "the tiny demo's profile (recipes/tiny-cpu.yaml)."
               if d.profile is CPU_PROFILE else "the real-model CPU profile (recipes/smollm2-135m-cpu.yaml).")
    header = [f"# Written by `dspark-kit init --verifier {opts.verifier}` from its config.json, tokenizer and chat",
              f"# template. Derived values say where they came from; the rest is {profile}",
              f"# Next: dspark-kit preflight -r {opts.output}   then   dspark-kit run {opts.output}"]
    facts = d.facts
    derived = [("verifier", f"{facts.num_layers} layers, hidden {facts.hidden_size}",
                f"config.json ({facts.architecture})"), *w.derived]
    return NewRecipe(opts.output, "\n".join([*header, *w.lines]) + "\n", derived, facts.warnings)


def _num_devices(opts: InitOptions, device: str) -> tuple[int, str]:
    if opts.num_devices is not None:
        if opts.num_devices < 1:
            raise InitError(f"--num-devices {opts.num_devices}: must be >= 1")
        return opts.num_devices, "--num-devices"
    from dspark_kit.devices import visible_count

    seen = visible_count(device)
    if seen:
        return seen, f"the {device} devices visible here"
    return DEFAULT_ACCELERATORS, f"none visible here: the reference run's {DEFAULT_ACCELERATORS}; --num-devices N"


def write_new_recipe(opts: InitOptions) -> NewRecipe:
    """Derive, validate as a recipe, then write atomically; an existing file needs --overwrite."""
    out = opts.output
    if out.is_dir():
        raise InitError(f"--out {out}: is a directory; pass a file such as recipes/my-verifier.yaml")
    if out.exists() and not opts.force:
        raise InitError(f"--out {out}: exists; pass --overwrite to replace it")
    new = derive(opts)
    with tempfile.TemporaryDirectory() as tmp:  # the text itself must load: no unknown key, valid values
        check = Path(tmp) / out.name
        check.write_text(new.text)
        try:
            recipe = load_recipe(check, require_run_keys=True)
        except RecipeError as e:
            raise InitError(f"internal: the derived recipe does not load ({e})") from None
    _own_preflight(recipe, opts)
    atomic.write_text(out, new.text)
    return new


def _own_preflight(recipe, opts: InitOptions) -> None:
    """init writes only what its own preflight passes: what the verifier and this machine rule out is
    refused here, with the init flag that changes it (probes skipped: they are about installed code)."""
    from dspark_kit.resolved import Resolved
    from dspark_kit.stages.preflight.checks import run_preflight

    res = Resolved(recipe, planning=True)
    errors = [f for f in run_preflight(res, probes=False, checkpoints=False, storage=False) if f.level == "error"]
    if not errors:  # the storage plan tokenizes a data sample: only for a recipe nothing else refuses
        errors = [f for f in run_preflight(res, probes=False, checkpoints=False) if f.level == "error"]
    if not errors:
        return
    f = errors[0]
    if f.code == "verifier-memory":
        where = "--target-device cpu" if opts.device == "cpu" else "this machine (cpu: no GPU or NPU seen)"
        raise InitError(f"{where}: {f.message.split('; ')[0].removeprefix('train.device cpu: ')}; pass "
                        "--target-device cuda or npu to write a recipe for an accelerator machine, or a smaller --verifier")
    if f.code == "storage" and recipe.train.devices == recipe.serve.devices:
        need = f.message.removeprefix("offline hidden states ").split(":")[0]  # "need ~X more in DIR, which has Y free"
        one = "--num-devices 1" if opts.num_devices else "one device visible here"
        raise InitError(f"{one}: the extraction server cannot run beside the trainer on one device, and "
                        f"offline hidden states {need}; pass --num-devices 2 or more (online hidden states), or "
                        "--data with fewer chats")
    raise InitError(f"the recipe would fail its own preflight ({f.code}): {f.message}")
