"""What one training step holds in a device's memory, planned from the recipe and the verifier's
config alone (no model loaded), and whether it fits the device.

The trainer is speculators 0.9.0's (speculators/train/trainer.py and models/dflash, models/dspark):
  - master weights are float32 (its --hidden-states-dtype help: "Model master weights are always kept
    in fp32"); trainable ones get a float32 gradient and AdamW's two float32 moments (16 B per
    trainable parameter, 4 B per frozen one: embed_tokens, lm_head, verifier_lm_head). fsdp_shard
    divides all of them by the ranks, and adds the bf16 copy FSDP gathers (the root's frozen tables
    stay gathered, plus one layer at a time); DDP (several ranks, no fsdp_shard) adds a float32
    gradient bucket per trainable parameter.
  - a step is one packed sequence of S = data.seq_length tokens with A = train.max_anchors blocks of
    B = draft.block_size query tokens (Q = A x B; the keys are the S context tokens plus the Q
    block tokens, N = S + Q), computed under bf16 autocast (c = 2 bytes):
      context: fc(hidden states) and its norm over S tokens;
      per layer: norms, q/k/v (k/v over N tokens, repeated to every head for sdpa with a mask),
        the boolean attention mask sdpa is handed (Q x N), the MLP over Q tokens;
      logits: draft logits, Markov bias, the verifier's targets and the loss's float32 softmaxes over
        Q x V (V: the draft vocabulary) -- the largest term on a full vocabulary.
    With gradient checkpointing a layer keeps only its input (Q x H) for backward and recomputes
    the rest, one layer at a time, after the loss has been differentiated; that layer's key/value
    gradients and the float32 gradient into the context are held with it.
  - the hidden states a step reads: S x (target layers + 1) x H in bf16 (fp8 files are dequantized
    to bf16 by hs-connectors' reader before the step).
The per-element byte counts below (ACT_*) are read off that code; benchmarks/bench_memory.py
measures the plan against the peak RSS of a CPU training (docs/PERFORMANCE_ANALYSES.md#training-memory-issue-40).

The verifier's vLLM server (every role: hidden states, chat, spec) is planned per device from the
verifier's config (specdec/verifier_memory.py: weights per device under TP and the declared
quantization, the KV cache for max_model_len, a runtime margin) against its budget,
serve.gpu_memory_utilization x the device. Online mode: the hidden-state server holds that share of
its device (vLLM) or the verifier's weights (the kit's local engine); on the trainer's own devices it
adds to their peak.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_kit.recipe import DTYPE_BYTES, Recipe, RecipeError

GIB = 1024**3
C = 2  # bytes of a value under the trainer's bf16 autocast
F32 = 4
# bytes kept per element (read off speculators' forward; see the module docstring)
ACT_NORM = 10  # an RMSNorm: its float32 input copy and normalized float32 value, its bf16 output
ACT_ROPE = 4 * C  # x*cos, rotate_half(x), *sin, the sum
LOSS_EAGER = 32  # per Q x V element: logits+bias and targets (bf16), CE's and TV's float32 softmaxes, a grad
LOSS_FUSED = 12  # Triton kernels: bf16 logits, targets, and the float32 gradient
ASSUMED_HEAD_DIM = 128
# What a process holds beyond the step's tensors once it has taken an optimizer step. CPU: measured by
# benchmarks/bench_memory.py as the rise of the second step's peak over the first's, the same at every
# size (allocator arenas, the optimizer's first-step state). Accelerators: the CUDA/CANN context and the
# caching allocator's slack, assumed (not measured here: no accelerator on the machine that wrote this).
RUNTIME = {"cpu": 16 * 1024**2, "cuda": GIB, "npu": GIB}
RESIDENT = ("parameters", "hidden states", "fsdp gathered", "hidden-state server", "device runtime")  # before a step


@dataclass
class Shape:
    """The draft's shape (speculators builds its layers from the verifier's config)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # verifier vocabulary
    draft_vocab: int
    layers: int
    targets: int  # verifier layers the draft reads
    source: str


@dataclass
class Term:
    name: str
    bytes: int
    formula: str

    def line(self) -> str:
        return f"{self.name} {human(self.bytes)} = {self.formula}"


@dataclass
class DevicePlan:
    role: str
    terms: list[Term]
    capacity: int | None
    capacity_source: str

    @property
    def peak(self) -> int:
        return sum(t.bytes for t in self.terms)

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.peak <= self.capacity

    def head(self) -> str:
        room = (f"of {human(self.capacity)} ({self.capacity_source})" if self.capacity is not None
                else f"(device memory unknown: {self.capacity_source})")
        verdict = {True: "fits", False: "does NOT fit", None: "not checked"}[self.fits]
        return f"memory: {self.role}: planned peak {human(self.peak)} {room}: {verdict}"


@dataclass
class MemoryPlan:
    shape: Shape
    seq_length: int
    max_anchors: int
    block_size: int
    ranks: int
    gradient_checkpointing: bool
    fsdp_shard: bool
    trainer: DevicePlan
    training_bytes: int  # what the step adds over an idle process: params..activations (the measured part)
    server: DevicePlan | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def step_bytes(self) -> int:
        """What a step adds to a process that holds the model and the step's batch: gradients,
        optimizer state, activations and logits (benchmarks/bench_memory.py measures this part)."""
        return sum(t.bytes for t in self.trainer.terms if t.name not in RESIDENT)

    def lines(self) -> list[str]:
        out = [self.trainer.head(), *(f"  {t.line()}" for t in self.trainer.terms)]
        if self.server is not None:
            out += [self.server.head(), *(f"  {t.line()}" for t in self.server.terms)]
        out += [f"  {n}" for n in self.notes]
        return out

    def as_dict(self) -> dict:
        def dev(d: DevicePlan | None):
            return None if d is None else {"role": d.role, "peak": d.peak, "capacity": d.capacity, "fits": d.fits,
                                           "terms": {t.name: t.bytes for t in d.terms}}
        return {"trainer": dev(self.trainer), "server": dev(self.server), "training_bytes": self.training_bytes,
                "gradient_checkpointing": self.gradient_checkpointing, "fsdp_shard": self.fsdp_shard,
                "ranks": self.ranks, "seq_length": self.seq_length, "max_anchors": self.max_anchors}


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


# ---- the draft's shape ----------------------------------------------------------


def draft_shape(recipe: Recipe, verifier_config: dict | None, num_hidden_layers: int | None,
                hidden_size: int | None) -> Shape:
    """From the verifier's config.json (as speculators' create_transformer_layer_config reads it);
    without one, from verifier.hidden_size / vocab_size with Qwen3's attention geometry assumed."""
    from dspark_kit.specdec.verifier_facts import language_model_config

    d = recipe.draft
    c = language_model_config(verifier_config or {})
    h = c.get("hidden_size") or hidden_size
    vocab = c.get("vocab_size") or recipe.verifier.vocab_size
    if h is None or vocab is None:
        missing = "verifier.hidden_size" if h is None else "verifier.vocab_size"
        raise RecipeError(f"{missing}: no config.json for the verifier on this machine; set {missing} to plan "
                          "training memory (or run where the verifier is)")
    if c.get("hidden_size") and c.get("vocab_size"):
        source = "the verifier's config.json"
        head_dim = int(c.get("head_dim") or h // int(c["num_attention_heads"]))
        heads, kv = int(c["num_attention_heads"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
        if h % heads and h % head_dim == 0:  # speculators' own fix-up of an odd geometry
            heads = h // head_dim
        inter = int(c.get("intermediate_size") or 3 * h)  # MoE: speculators' 3 x hidden fallback
    else:
        head_dim = ASSUMED_HEAD_DIM if h % ASSUMED_HEAD_DIM == 0 else h // max(1, h // 64)
        heads = max(1, h // head_dim)
        kv = max(1, heads // 8)
        inter = 3 * h
        source = (f"verifier.hidden_size/vocab_size (no config.json here: {heads} heads of {head_dim}, {kv} kv "
                  f"heads, intermediate 3 x hidden assumed)")
    layers = num_hidden_layers
    targets = len(recipe.target_layer_ids(layers)) if layers else len(recipe.hidden_states.target_layer_ids or [0] * 3)
    return Shape(int(h), int(inter), int(heads), int(kv), int(head_dim), int(vocab),
                 int(d.draft_vocab_size or vocab), d.num_layers, targets, source)


def param_counts(s: Shape, recipe: Recipe) -> tuple[int, int, int, int]:
    """(trainable, frozen, one layer's, the root's gathered frozen tables) parameter counts."""
    d = recipe.draft
    h, nhd, kvd = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    layer = h * nhd + 2 * h * kvd + nhd * h + 3 * h * s.intermediate + 2 * h + 2 * s.head_dim
    r = d.markov_rank
    markov = 0
    if r:
        markov = s.vocab * r + r * s.draft_vocab
        markov += {"vanilla": 0, "gated": (h + r) * r + r, "rnn": (2 * r + h) * 3 * r}[d.markov_head_type]
    conf = (h + (r if d.confidence_head_with_markov else 0) + 1) if d.confidence_head else 0
    trainable = s.targets * h * h + s.layers * layer + 3 * h + markov + conf
    frozen = s.vocab * h + 2 * s.draft_vocab * h + h  # embed_tokens, lm_head, verifier_lm_head, verifier_norm
    return trainable, frozen, layer, frozen


# ---- the plan -------------------------------------------------------------------


def _layer_bytes(s: Shape, seq: int, q: int) -> tuple[int, int, str]:
    """(activations one draft layer keeps for backward, those over the N keys alone, the formula)."""
    h, nhd, kvd, n = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, seq + q
    per_q = h * (2 * ACT_NORM + 4 * C) + nhd * (2 * C + ACT_NORM + ACT_ROPE) + s.intermediate * 4 * C
    per_n = kvd * (2 * C + ACT_NORM + ACT_ROPE) + 2 * nhd * C  # k, v (+ norm, rope), repeated to every head
    mask = q * n  # the boolean mask sdpa is handed per layer
    total = q * per_q + n * per_n + mask
    return total, n * per_n, f"Q {q} x {per_q} B + N {n} x {per_n} B + mask Q x N x 1 B"


def plan_memory(recipe: Recipe, shape: Shape, *, device: str, capacity: int | None, capacity_source: str,
                server: DevicePlan | None = None, server_on_trainer: int = 0, **changes) -> MemoryPlan:
    """The plan for `recipe`, or for it with train/data settings changed (the fixes preflight weighs):
    changes may set gradient_checkpointing, fsdp_shard, max_anchors, seq_length, nproc."""
    t = recipe.train
    ckpt = changes.get("gradient_checkpointing", t.gradient_checkpointing)
    fsdp = changes.get("fsdp_shard", t.fsdp_shard)
    anchors = changes.get("max_anchors", t.max_anchors)
    seq = changes.get("seq_length", recipe.data.seq_length)
    ranks = changes.get("nproc", t.nproc) * t.nnodes
    s, b = shape, recipe.draft.block_size
    q = anchors * b
    trainable, frozen, layer_params, root = param_counts(s, recipe)
    shard = ranks if fsdp and ranks > 1 else 1
    terms = [
        Term("parameters", F32 * (trainable + frozen) // shard,
             f"({trainable:,} trainable + {frozen:,} frozen) x fp32 {F32} B" + (f" / {shard} ranks" if shard > 1 else "")),
        Term("gradients", F32 * trainable // shard, f"{trainable:,} x fp32 {F32} B" + (f" / {shard}" if shard > 1 else "")),
        Term("optimizer", 2 * F32 * trainable // shard,
             f"AdamW 2 moments x {trainable:,} x fp32 {F32} B" + (f" / {shard}" if shard > 1 else "")),
    ]
    if shard > 1:
        terms.append(Term("fsdp gathered", C * (root + layer_params),
                          f"bf16 {C} B x (root's tables {root:,} + one layer {layer_params:,})"))
    elif ranks > 1:
        terms.append(Term("ddp buckets", F32 * trainable, f"{trainable:,} x fp32 {F32} B (gradient buckets)"))
    hs_layers = s.targets + 1
    files = recipe.hidden_states.dtype
    arrive = {"fp8": "fp8 files/transfers dequantized to bf16 before the step",
              "float32": "float32 files/transfers cast to bf16 by the loader"}.get(files, "bf16 as written")
    terms.append(Term("hidden states", seq * hs_layers * s.hidden * C,
                      f"S {seq} x {hs_layers} layers x hidden {s.hidden} x bf16 {C} B ({arrive})"))
    context = seq * s.hidden * (C + ACT_NORM) + q * (seq + q)  # fc output and its norm; the boolean block mask
    terms.append(Term("context", context, f"S {seq} x hidden {s.hidden} x {C + ACT_NORM} B (fc, norm) + "
                                          f"bool mask Q {q} x N {seq + q}"))
    one_layer, keys, layer_formula = _layer_bytes(s, seq, q)
    loss_b = LOSS_EAGER if _eager_loss(recipe, device) else LOSS_FUSED
    logits = q * s.draft_vocab * loss_b + q * s.hidden * ACT_NORM
    logits_formula = (f"Q {q} (max_anchors {anchors} x block {b}) x draft vocab {s.draft_vocab:,} x {loss_b} B "
                      f"({'eager' if loss_b == LOSS_EAGER else 'fused'} loss) + final norm")
    if ckpt:
        kept = s.layers * q * s.hidden * C
        # backward recomputes one layer and holds its gradients: those of the keys/values, and the float32
        # gradient flowing into the context (fc output)
        recompute = one_layer + keys + seq * s.hidden * F32
        terms.append(Term("layers (checkpointed)", kept + max(logits, recompute),
                          f"{s.layers} layer inputs Q {q} x hidden {s.hidden} x {C} B + max(logits, one layer "
                          f"recomputed in backward with its key and context gradients: {human(recompute)} = "
                          f"{layer_formula} + {human(keys)} + S x hidden x {F32} B)"))
        terms.append(Term("logits", 0, logits_formula + f" = {human(logits)}, counted in the max above"))
    else:
        terms.append(Term("layers", s.layers * one_layer, f"{s.layers} x ({layer_formula})"))
        terms.append(Term("logits", logits, logits_formula))
    runtime = RUNTIME.get(device.partition(":")[0], 0)
    if device.startswith("cpu"):
        terms.append(Term("runtime", runtime, "measured on CPU: what the process gains at its first optimizer step "
                                              "beyond the step's tensors (benchmarks/bench_memory.py)"))
    else:
        terms.append(Term("device runtime", runtime, f"{device} context and allocator slack (assumed, not measured)"))
    training = sum(x.bytes for x in terms)
    if server_on_trainer:
        terms.append(Term("hidden-state server", server_on_trainer, "its share of this device (same device ids)"))
    trainer = DevicePlan(f"each of {ranks} training rank(s) on {device}", terms, capacity, capacity_source)
    plan = MemoryPlan(s, seq, anchors, b, ranks, ckpt, fsdp, trainer, training, server)
    plan.notes.append(f"shape from {s.source}: hidden {s.hidden}, intermediate {s.intermediate}, {s.heads} heads x "
                      f"{s.head_dim} ({s.kv_heads} kv), {s.layers} draft layers reading {s.targets} verifier layers")
    return plan


def _eager_loss(recipe: Recipe, device: str) -> bool:
    from dspark_kit.devices import train_flags

    impl = recipe.train.loss_implementation
    if impl != "auto":
        return impl == "eager"
    flags = train_flags(device)
    return "--loss-implementation" in flags and flags[flags.index("--loss-implementation") + 1] == "eager"


def capacity_of(recipe: Recipe, device: str, here: bool) -> tuple[int | None, str]:
    """One training device's memory: train.device_memory_gib, else this machine's device."""
    if recipe.train.device_memory_gib is not None:
        return int(recipe.train.device_memory_gib * GIB), "train.device_memory_gib"
    if not here:
        return None, f"no {device} here; set train.device_memory_gib"
    from dspark_kit.devices import device_memory_bytes

    found = device_memory_bytes(device)
    return (found, f"this machine's {device}") if found else (None, "unreadable here; set train.device_memory_gib")


# ---- what makes a plan fit, cheapest first --------------------------------------


def fixes(recipe: Recipe, plan: MemoryPlan, plan_with) -> list[tuple[str, MemoryPlan]]:
    """The cheapest changes in order -- gradient checkpointing, a smaller max_anchors, fsdp_shard,
    shorter sequences -- each with the plan it gives (`plan_with(**changes)` replans); the later
    ones keep checkpointing on."""
    out: list[tuple[str, MemoryPlan]] = []
    ckpt = {"gradient_checkpointing": True}
    if not plan.gradient_checkpointing:
        out.append(("train.gradient_checkpointing: true", plan_with(**ckpt)))
    anchors = plan.max_anchors // 2
    while anchors > 1 and not plan_with(**ckpt, max_anchors=anchors).trainer.fits:
        anchors //= 2
    if 1 <= anchors < plan.max_anchors:
        out.append((f"train.max_anchors: {anchors}", plan_with(**ckpt, max_anchors=anchors)))
    if not plan.fsdp_shard:
        nproc = recipe.train.nproc if plan.ranks > 1 else 2
        out.append(("train.fsdp_shard: true" + ("" if plan.ranks > 1 else " with train.nproc: 2 (two devices)"),
                    plan_with(**ckpt, fsdp_shard=True, nproc=nproc)))
    seq = plan.seq_length // 2
    while seq > 64 and not plan_with(**ckpt, seq_length=seq).trainer.fits:
        seq //= 2
    if seq < plan.seq_length:
        out.append((f"data.seq_length: {seq}", plan_with(**ckpt, seq_length=seq)))
    return out


def fixes_line(recipe: Recipe, plan: MemoryPlan, plan_with) -> str:
    """The fixes as one clause: 'a -> 12.0 GiB (fits); b -> ...'."""
    parts = [f"{fix} -> {human(p.trainer.peak)} ({'fits' if p.trainer.fits else 'still over'})"
             for fix, p in fixes(recipe, plan, plan_with)]
    return "; ".join(parts) if parts else "none left (every fix is on); use a device with more memory"


# ---- from a Resolved: the one function every command asks -------------------------


def plan_for(res, **changes) -> MemoryPlan:
    """The training memory plan of `res` (a Resolved), or of it with `changes` (see plan_memory).
    Raises RecipeError when the verifier's shape is unknown here."""
    recipe = res.recipe
    device = res.train_device.value
    try:
        layers = res.num_hidden_layers
    except RecipeError:
        layers = None
    shape = draft_shape(recipe, res.verifier_config, layers, res.hidden_size)
    capacity, source = capacity_of(recipe, device, res.train_device_here)
    server, on_trainer = _server(res, device, capacity)
    return plan_memory(recipe, shape, device=device, capacity=capacity, capacity_source=source,
                       server=server, server_on_trainer=on_trainer, **changes)


def _server(res, device: str, capacity: int | None) -> tuple[DevicePlan | None, int]:
    """The plan of the server holding the verifier (online hidden states on the local engine: its
    weights; vLLM in any role: verifier_server_plan), and its share of the trainer's own device when
    `train` starts it beside the trainer (online mode; serve.devices overlapping train.devices, or
    either unset, on one machine)."""
    recipe = res.recipe
    hs, serve = recipe.hidden_states, recipe.serve
    online = hs.mode == "online" and not hs.endpoint
    if online and hs.backend == "local":
        from dspark_kit.specdec.verifier import param_count

        params = param_count(res.verifier_config)
        if params is None:
            return None, 0
        dtype = res.hidden_states_dtype.value
        weights = params * DTYPE_BYTES[dtype]
        plan = DevicePlan(f"hidden-state server (local engine, on {device})",
                          [Term("verifier weights", weights, f"{params:,} parameters x {dtype} {DTYPE_BYTES[dtype]} B")],
                          capacity, "the training device")
        return plan, weights
    util = serve.gpu_memory_utilization
    share = int(util * capacity) if capacity is not None else 0
    ids = serve.devices
    plan = verifier_server_plan(res, device, capacity)
    if plan is None or not online:
        return plan, 0
    train_ids = recipe.train.devices
    overlap = (ids is None or train_ids is None
               or bool(set(ids.split(",")) & set(train_ids.split(",")))) and device != "cpu"
    return plan, share if overlap else 0


def server_roles(recipe: Recipe) -> list[str]:
    """The roles a vLLM server holding the verifier plays in this recipe (each loads the same weights
    with serve.tensor_parallel_size)."""
    hs, serve = recipe.hidden_states, recipe.serve
    roles = ["hidden states"] if hs.backend == "vllm" and not hs.endpoint else []
    if serve.engine in ("vllm", "vllm-ascend"):
        roles += (["chat (regen)"] if not recipe.regen.endpoints else []) + ["spec (serve)"]
    return roles


def server_max_model_len(recipe: Recipe, cfg: dict | None) -> tuple[int, str]:
    from dspark_kit.specdec.verifier_facts import language_model_config

    if recipe.serve.max_model_len:
        return recipe.serve.max_model_len, "serve.max_model_len"
    limit = language_model_config(cfg or {}).get("max_position_embeddings")
    if isinstance(limit, int):
        return limit, "serve.max_model_len unset: vLLM's default, the verifier's max_position_embeddings"
    return recipe.data.seq_length, "data.seq_length"


def verifier_server_plan(res, device: str, capacity: int | None, **changes) -> DevicePlan | None:
    """One device of a vLLM server holding the verifier (every role it plays: hidden states, chat,
    spec): its weights per device, the KV cache for max_model_len and the sequences it serves at once,
    and a runtime margin (specdec/verifier_memory.py), against serve.gpu_memory_utilization of the
    device. `changes` may set tensor_parallel_size, max_model_len (the fixes preflight weighs)."""
    from dspark_kit.specdec.verifier_memory import server_parts

    recipe = res.recipe
    roles = server_roles(recipe)
    cfg = res.verifier_config
    if not roles or device.startswith("cpu"):
        return None
    tp = changes.get("tensor_parallel_size", recipe.serve.tensor_parallel_size)
    if not cfg:
        return DevicePlan(f"verifier server on vLLM ({', '.join(roles)}; TP {tp})",
                          [Term("verifier weights", 0, "not counted: no config.json for the verifier on this machine")],
                          None, "not planned without the verifier's config.json; preflight where the verifier is")
    max_len, len_from = server_max_model_len(recipe, cfg)
    max_len = changes.get("max_model_len", max_len)
    online = recipe.hidden_states.mode == "online" and "hidden states" in roles
    seqs = max(1, recipe.train.nproc * recipe.train.nnodes) if online else 1
    try:
        dtype = res.serve_dtype.value
    except (RecipeError, ValueError):
        dtype = recipe.verifier.dtype
    parts = server_parts(cfg, dtype if dtype in DTYPE_BYTES else "bfloat16", tp, max_len, seqs,
                         device.partition(":")[0])
    util = recipe.serve.gpu_memory_utilization
    budget = int(util * capacity) if capacity is not None else None
    where = (f"serve.gpu_memory_utilization {util:g} x {human(capacity)}" if capacity is not None
             else "device memory unknown; set train.device_memory_gib")
    terms = [Term(p.name, p.bytes, p.formula) for p in parts]
    return DevicePlan(f"verifier server on vLLM ({', '.join(roles)}; TP {tp}, max_model_len {max_len}: {len_from})",
                      terms, budget, where)


def server_fixes(res, device: str, capacity: int | None, plan: DevicePlan) -> str:
    """What makes the verifier server fit, each with what it plans per device: more devices at a
    larger TP, offline extraction on every device, a smaller max_model_len."""
    recipe = res.recipe
    tp = recipe.serve.tensor_parallel_size
    out = []
    for bigger in (2 * tp, 4 * tp, 8 * tp):
        p = verifier_server_plan(res, device, capacity, tensor_parallel_size=bigger)
        if p is not None and p.fits:
            out.append(f"serve.tensor_parallel_size {bigger} ({bigger} devices: {human(p.peak)} per device, fits)")
            break
    else:
        out.append(f"more devices: even TP {8 * tp} does not fit (a multi-node server, or devices with more memory)")
    devices = {*(recipe.train.devices or "").split(","), *(recipe.serve.devices or "").split(",")} - {""}
    if recipe.hidden_states.mode == "online" and len(devices) > tp:
        p = verifier_server_plan(res, device, capacity, tensor_parallel_size=len(devices))
        if p is not None:
            out.append(f"hidden_states.mode offline (extraction before training, on all {len(devices)} devices at "
                       f"TP {len(devices)}: {human(p.peak)} per device, {'fits' if p.fits else 'still over'})")
    kv = next(t for t in plan.terms if t.name == "KV cache")
    if plan.capacity is not None and kv.bytes:
        room = plan.capacity - (plan.peak - kv.bytes)
        current = server_max_model_len(recipe, res.verifier_config)[0]
        fit_len = int(current * room / kv.bytes) if room > 0 else 0
        if fit_len >= 256:
            out.append(f"serve.max_model_len {fit_len // 256 * 256} (the KV cache is {human(kv.bytes)} at {current})")
    return "; ".join(out)


def plan_lines(res) -> list[str]:
    """The plan as a dry run's comment lines (a line saying why when it cannot be planned here)."""
    try:
        return [f"# {line}" for line in res.memory_plan.lines()]
    except (RecipeError, OSError, ValueError) as e:
        return [f"# memory: not planned ({e})"]
