"""What a new recipe needs to know about a verifier, read from its config.json, tokenizer and chat
template (never its weights), and the rules that turn those facts into draft settings.

Used by `dspark-kit init`; the rules are the conventions docs/CONCEPTS.md explains:
target layer ids spread evenly from layer 1 to N-3, one per draft layer (#layer-ids), and the
mask token on the first spare embedding row past the tokenizer's vocabulary (#the-mask-token).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from dspark_kit.data import reasoning_formats

CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
WRAPPER_SUFFIX = "ForConditionalGeneration"  # multimodal wrapper: accepted when it nests a text_config


def language_model_config(cfg: dict) -> dict:
    """The language model's part of a verifier's config.json: a multimodal wrapper nests it under
    text_config, a plain LM is its own. A nested text_config often writes only what differs from its
    config class's defaults (Gemma-3's has no vocab_size, num_attention_heads or head_dim): those are
    filled in from the class's own signature, as transformers reads them."""
    nested = cfg.get("text_config")
    if not isinstance(nested, dict) or not nested:
        return cfg
    missing = [k for k in DEFAULTED if k not in nested]
    defaults = _signature_defaults(str(nested.get("model_type") or "")) if missing else {}
    return {**{k: defaults[k] for k in missing if k in defaults}, **nested}


# keys a nested text_config may leave to its class's defaults (literal values only: never a derived one)
DEFAULTED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "tie_word_embeddings")


@functools.cache
def _signature_defaults(model_type: str) -> dict:
    """The literal numeric defaults of transformers' own config class for `model_type` (its __init__
    signature; nothing instantiated, no remote code); {} for a model_type transformers does not know."""
    import inspect

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        return {}
    try:
        cls = CONFIG_MAPPING[model_type]
        params = inspect.signature(cls.__init__).parameters
    except (KeyError, ImportError, ValueError, TypeError):
        return {}
    def literal(key: str, value) -> bool:
        return isinstance(value, bool) if key == "tie_word_embeddings" else (
            isinstance(value, int) and not isinstance(value, bool))

    out = {k: p.default for k, p in params.items() if k in DEFAULTED and literal(k, p.default)}
    if not out:  # dataclass-style configs: class attributes
        out = {k: getattr(cls, k) for k in DEFAULTED if literal(k, getattr(cls, k, None))}
    return out


def has_tokenizer_files(folder: Path) -> bool:
    """A model directory with a tokenizer beside its config (whether it loads is another question)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


class VerifierFactsError(ValueError):
    """The verifier cannot seed a recipe; one line naming what is missing and the fix."""


@dataclass(frozen=True)
class VerifierFacts:
    name: str  # as the user gave it (local dir, hub id or builtin:tiny-qwen3)
    location: str  # where the files were read (a local dir or the hub id)
    model_type: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int | None
    vocab_size: int  # embedding rows
    max_position_embeddings: int | None
    dtype: str | None
    remote_code: bool  # config.json names custom modeling code (auto_map); run only with --trust-remote-code
    tokenizer_len: int
    tokenizer_mask: tuple[int, str] | None  # the tokenizer's own mask token (id, text)
    reserved: tuple[tuple[int, str], ...]  # reserved special tokens the chat template never writes (id, text)
    unused: tuple[tuple[int, str], ...]  # other added tokens the chat template never writes (id, text)
    thinking_default: bool | None  # the template's mode when enable_thinking is not passed; None: no switch
    tokenizer: object  # the loaded tokenizer (token lengths of the data)
    layer_types: tuple[str, ...] | None = None  # config.json layer_types (hybrid attention), when given
    reasoning: object = None  # its reasoning format (data/reasoning_formats.py), from the template and model_type
    warnings: tuple[str, ...] = ()  # what looks wrong but does not stop a recipe


def _read_config(verifier: str, location: str) -> dict:
    local = Path(location).expanduser()
    if local.is_dir():
        path = local / "config.json"
        if not path.is_file():
            raise VerifierFactsError(f"--verifier {verifier}: no config.json in {local} "
                                     "(pass a Hugging Face model directory or hub id)")
    elif location.count("/") == 1 and not location.startswith(("/", ".", "~")):
        try:
            from huggingface_hub import hf_hub_download

            path = Path(hf_hub_download(location, "config.json"))
        except Exception as e:  # noqa: BLE001 - offline, gated, unknown repo: one line either way
            reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
            raise VerifierFactsError(f"--verifier {verifier}: no config.json (not a local directory, and the hub "
                                     f"or its cache has none: {reason})") from None
    else:
        raise VerifierFactsError(f"--verifier {verifier}: no config.json (no such directory; pass a Hugging "
                                 "Face model directory or a hub id like Qwen/Qwen3-8B)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise VerifierFactsError(f"--verifier {verifier}: {path} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise VerifierFactsError(f"--verifier {verifier}: {path} is not a JSON object")
    return cfg


def causal_lm_config(cfg: dict, verifier: str) -> tuple[str, dict]:
    """(architecture, the config section describing the language model); refuses anything else."""
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    model_type = str(cfg.get("model_type") or "?")
    for arch in archs:
        if arch.endswith(CAUSAL_LM_SUFFIXES):
            return arch, cfg
        if arch.endswith(WRAPPER_SUFFIX) and isinstance(cfg.get("text_config"), dict):
            return arch, language_model_config(cfg)
    if not archs:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], cfg
    what = ", ".join(archs) or "no architectures"
    raise VerifierFactsError(f"--verifier {verifier}: config.json describes {what} (model_type {model_type}), "
                             "not a causal LM; a DSpark draft speeds up a decoder-only LLM")


# other names configs use for the same numbers (GPT-2 style, some remote-code models)
ALIASES = {"num_hidden_layers": ("n_layer", "num_layers", "n_layers"), "hidden_size": ("n_embd", "d_model"),
           "vocab_size": ("n_vocab",)}


def _int(section: dict, key: str, verifier: str) -> int:
    value = section.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str) and value.strip().isdigit():
        raise VerifierFactsError(f"--verifier {verifier}: config.json {key} is the string {value!r}; write it "
                                 f"as a number ({key}: {value.strip()})")
    alias = next((a for a in ALIASES.get(key, ()) if isinstance(section.get(a), int)), None)
    if value is None and alias:
        raise VerifierFactsError(f"--verifier {verifier}: config.json names it {alias} ({section[alias]}), not "
                                 f"{key}, which vLLM and speculators read; add \"{key}\": {section[alias]} to it")
    raise VerifierFactsError(f"--verifier {verifier}: config.json has no usable {key} ({value!r}); add it")


REMOTE_CODE_FLAG = "--trust-remote-code"


def _module_files(auto_map) -> list[str]:
    """The Python files an `auto_map` names ("configuration_x.XConfig", ["tokenization_x.XTok", null],
    "org/repo--modeling_x.XModel" -> configuration_x.py, tokenization_x.py, modeling_x.py)."""
    refs = []
    for value in (auto_map or {}).values() if isinstance(auto_map, dict) else ():
        refs += [v for v in (value if isinstance(value, list | tuple) else [value]) if isinstance(v, str)]
    return sorted({ref.split("--")[-1].rsplit(".", 1)[0].replace(".", "/") + ".py" for ref in refs if "." in ref})


def _known_tokenizer(tcfg: dict) -> bool:
    name = tcfg.get("tokenizer_class")
    if not isinstance(name, str):
        return False
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    try:
        return tokenizer_class_from_name(name) is not None or tokenizer_class_from_name(name.removesuffix("Fast")) is not None
    except Exception:  # noqa: BLE001 - an unknown name reads as not known
        return False


@dataclass(frozen=True)
class CustomCode:
    """The code a model folder's auto_map names (config.json, tokenizer_config.json), and whether loading
    the folder needs it (transformers knows the model_type / tokenizer class itself: it is not run)."""

    files: tuple[str, ...]
    needed: tuple[str, ...]  # of files: those loading cannot do without
    missing: tuple[str, ...]  # of files: not in the folder


def custom_code(folder, cfg: dict | None = None) -> CustomCode:
    """What custom code the model folder `folder` names, read from its JSON files (nothing imported).
    As transformers decides it: a model_type it knows loads with its own classes, auto_map or not."""
    folder = Path(folder).expanduser()

    def read(name: str) -> dict:
        try:
            found = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    cfg = read("config.json") if cfg is None else cfg
    tcfg = read("tokenizer_config.json")
    model_files, tok_files = _module_files(cfg.get("auto_map")), _module_files(tcfg.get("auto_map"))
    needed: list[str] = []
    if model_files:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if cfg.get("model_type") not in CONFIG_MAPPING_NAMES:
            needed += model_files
    if tok_files and not _known_tokenizer(tcfg):
        needed += tok_files
    files = sorted({*model_files, *tok_files})
    return CustomCode(tuple(files), tuple(sorted(set(needed))),
                      tuple(f for f in files if folder.is_dir() and not (folder / f).is_file()))


def remote_code_refusal(folder, trust_remote_code: bool, cfg: dict | None = None, *,
                        flag: str = REMOTE_CODE_FLAG) -> str | None:
    """One line when the folder cannot load as asked: it needs its own Python code and `flag` is not
    given (nothing is run unasked), or it is given and a file its auto_map names is not there."""
    code = custom_code(folder, cfg)
    if code.needed and not trust_remote_code:
        return (f"{folder} needs its own Python code to load ({', '.join(code.needed)}, named by its auto_map; "
                f"transformers has no built-in class for it); nothing runs unasked: read the file(s), then pass "
                f"{flag} to run them")
    missing = [f for f in code.missing if trust_remote_code and f in code.needed]
    if missing:
        return (f"{folder}: its auto_map names {', '.join(missing)}, which is not in the folder; copy the model's "
                f"code file(s) beside config.json")
    return None


def _load_tokenizer(verifier: str, location: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(location, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - missing files, unknown class: one line
        reason = str(e).strip().splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise VerifierFactsError(f"--verifier {verifier}: cannot load its tokenizer ({reason})") from None


def template_text(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the default one renders chats
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) and template.strip() else None


def thinking_default(tokenizer) -> bool | None:
    """The thinking mode the chat template renders when enable_thinking is not passed (what a server
    answers with by default); None when the switch changes nothing."""
    chat = [{"role": "user", "content": "Hi"}]

    def prompt(**kwargs) -> str | None:
        try:
            return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception:  # noqa: BLE001 - a template that rejects the probe chat has no usable switch
            return None

    on, off = prompt(enable_thinking=True), prompt(enable_thinking=False)
    if on is None or off is None or on == off:
        return None
    return prompt() == on


def read_verifier_facts(verifier: str, location: str | None = None, trust_remote_code: bool = False) -> VerifierFacts:
    """Facts about `verifier` from the files at `location` (default: the name itself)."""
    location = location or verifier
    cfg = _read_config(verifier, location)
    arch, lm = causal_lm_config(cfg, verifier)
    sizes = {key: _int(lm, key, verifier) for key in ("num_hidden_layers", "hidden_size", "vocab_size")}  # before
    # the tokenizer: a config mistake is not a tokenizer error
    remote = bool(cfg.get("auto_map"))
    local = Path(location).expanduser()
    if local.is_dir() and not has_tokenizer_files(local):
        raise VerifierFactsError(f"--verifier {verifier}: {local} has no tokenizer ({' / '.join(TOKENIZER_FILES)}); "
                                 "copy the model's tokenizer files beside config.json")
    if local.is_dir():  # before anything loads: a folder's code runs only with --trust-remote-code
        refusal = remote_code_refusal(local, trust_remote_code, cfg)
        if refusal:
            raise VerifierFactsError(f"--verifier {verifier}: {refusal}")
    tok = _load_tokenizer(verifier, location, trust_remote_code)
    vocab, warnings = sizes["vocab_size"], []
    if len(tok) > vocab:
        raise VerifierFactsError(f"--verifier {verifier}: its tokenizer has {len(tok):,} tokens, more than the "
                                 f"embedding's vocab_size {vocab:,}: another model's tokenizer; copy the verifier's")
    if len(tok) < vocab // 2:
        warnings.append(f"the tokenizer has {len(tok):,} tokens against the embedding's vocab_size {vocab:,}: "
                        "another model's tokenizer? (a model's own fills its embedding but for padding rows)")
    template = template_text(tok)
    if template is None:
        raise VerifierFactsError(f"--verifier {verifier}: its tokenizer has no chat template; regen, prepare and "
                                 "bench render chats with it (use the instruct/chat model, or add "
                                 "chat_template.jinja)")
    mask_id = getattr(tok, "mask_token_id", None)
    dtype = lm.get("dtype") or lm.get("torch_dtype") or cfg.get("dtype") or cfg.get("torch_dtype")
    return VerifierFacts(
        name=verifier, location=location, model_type=str(lm.get("model_type") or cfg.get("model_type") or "?"),
        architecture=arch, num_layers=sizes["num_hidden_layers"],
        hidden_size=sizes["hidden_size"], num_attention_heads=lm.get("num_attention_heads"),
        vocab_size=sizes["vocab_size"], max_position_embeddings=lm.get("max_position_embeddings"),
        dtype=dtype if isinstance(dtype, str) else None, remote_code=remote, tokenizer_len=len(tok),
        tokenizer_mask=(mask_id, str(tok.mask_token)) if isinstance(mask_id, int) else None,
        reserved=reserved_specials(tok, template),
        unused=unused_specials(tok, template),
        thinking_default=thinking_default(tok), tokenizer=tok, warnings=tuple(warnings),
        layer_types=tuple(map(str, lm["layer_types"])) if isinstance(lm.get("layer_types"), list) else None,
        reasoning=reasoning_formats.of_template(template, lm.get("model_type") or cfg.get("model_type")),
    )


# ---- the rules -------------------------------------------------------------------


ATTENTION_TYPES = ("full_attention", "attention")  # layer_types entries that attend over the whole context


def dflash_layer_ids(num_layers: int, draft_layers: int, layer_types: list | None = None) -> tuple[list[int], str]:
    """(target layer ids, how they were chosen): one per draft layer, spread evenly from layer 1 to
    N-3 (one draft layer: the middle layer N // 2). 48 layers, 5 draft layers -> [1, 12, 23, 34, 45].
    A verifier too shallow for distinct ids in 1..N-3 spreads them over 1..N-1 instead, and never
    gets more ids than it has layers.

    Hybrid attention (config.json `layer_types` mixing linear_attention with full_attention, as
    Qwen3-Next and Qwen3.5): the ids are spread the same way over the residual streams *leaving* a
    full-attention layer (id f + 1 for full-attention layer f), never one that has passed only
    linear-attention layers since the last full one. Source: SpecForge's published EAGLE3 config for
    Qwen3-Coder-Next (sgl-project/SpecForge#494) reads the full-attention layers only, skipping the
    Gated DeltaNet ones; reading the stream just after a full-attention layer (rather than entering
    it) is this kit's choice: it is the first state in which exact attention over the whole context
    has been mixed in, which the draft (it has no context of its own but these states) needs.
    Sliding-window layer types (Gemma-3, gpt-oss) are not hybrid in this sense: every id stays a
    candidate."""
    n = num_layers
    if n < 2:
        raise VerifierFactsError(f"verifier has {n} layer(s): a draft needs at least 2 to read from")
    types = [str(t) for t in layer_types] if isinstance(layer_types, list) and len(layer_types) == n else None
    if types and any("linear" in t for t in types) and any(t in ATTENTION_TYPES for t in types):
        after = [f + 1 for f, t in enumerate(types) if t in ATTENTION_TYPES]
        inner = [i for i in after if 1 <= i <= n - 3] or [i for i in after if i <= n - 1]
        if inner:
            count = min(draft_layers, len(inner))
            picks = [inner[round(i * (len(inner) - 1) / (count - 1))] for i in range(count)] if count > 1 else [
                min(inner, key=lambda i: abs(i - n // 2))]
            return sorted(set(picks)), (f"hybrid attention ({len(after)} of {n} layers full attention): evenly over "
                                        "the states leaving a full-attention layer (docs/CONCEPTS.md#layer-ids)")
    if draft_layers == 1:
        return [n // 2], f"one draft layer: the middle layer N//2 of {n}"
    lo, hi = 1, n - 3
    if hi - lo + 1 < draft_layers:
        hi = n - 1
    count = min(draft_layers, hi - lo + 1)
    if count == 1:
        return [lo], f"{n} layers: room for one id"
    ids = [round(lo + i * (hi - lo) / (count - 1)) for i in range(count)]
    return ids, f"one per draft layer, evenly from 1 to {hi} ({'N-3' if hi == n - 3 else 'N-1'}) of {n} layers"


def reserved_specials(tok, template: str | None) -> tuple[tuple[int, str], ...]:
    """The tokenizer's reserved special tokens (Llama-3's <|reserved_special_token_N|>, gpt-oss's
    <|reserved_2000NN|>) that the chat template never writes, by id: placeholders a model is never
    trained on, so it never emits them."""
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    return tuple(sorted((i, t.content) for i, t in added.items()
                        if getattr(t, "special", False) and "reserved" in t.content.lower()
                        and t.content not in (template or "")))


def unused_specials(tok, template: str | None) -> tuple[tuple[int, str], ...]:
    """The tokenizer's added tokens (special or not, as StarCoder's `<repo_name>` ... `<empty_output>`
    in SmolLM2, which registers only its first three as special) that the chat template never writes
    and that are none of its named roles (bos, eos, pad, unk, ...), by id: a chat never carries them,
    so a chat model practically never emits them. Tokens named "reserved" are reserved_specials'."""
    added = getattr(tok, "added_tokens_decoder", {}) or {}
    named = {str(t) for t in (getattr(tok, "all_special_tokens", None) or [])}
    named |= {str(v) for v in (getattr(tok, "special_tokens_map", None) or {}).values() if isinstance(v, str)}
    return tuple(sorted((i, t.content) for i, t in added.items()
                        if t.content and "reserved" not in t.content.lower() and t.content not in (template or "")
                        and t.content not in named and t.content.strip() == t.content))


def mask_token_choice(vocab_size: int, tokenizer_len: int, tokenizer_mask: tuple[int, str] | None,
                      reserved: tuple[tuple[int, str], ...] = (), unused: tuple[tuple[int, str], ...] = (),
                      emitted: frozenset[int] | set[int] = frozenset()) -> tuple[int, str]:
    """(mask_token_id, where it came from): the first spare embedding row, len(tokenizer), when the
    embedding has one; else the tokenizer's own mask token; else the first reserved special token
    (a full vocabulary, as Llama-3's); else the last added token the chat template never writes
    (unused_specials: SmolLM2's StarCoder tokens) and the verifier never emitted (`emitted`: the
    token ids of its regenerated replies, when known); else refused."""
    if vocab_size > tokenizer_len:
        return tokenizer_len, (f"first spare embedding row: len(tokenizer) {tokenizer_len} < "
                               f"vocab_size {vocab_size}")
    if tokenizer_mask is not None:
        return tokenizer_mask[0], (f"the tokenizer's mask token {tokenizer_mask[1]} (the embedding has no spare "
                                   f"row: vocab_size {vocab_size}, len(tokenizer) {tokenizer_len})")
    if reserved:
        return reserved[0][0], (f"the reserved special token {reserved[0][1]}: the embedding has no spare row "
                                f"(vocab_size {vocab_size}, len(tokenizer) {tokenizer_len}) and the tokenizer no "
                                "mask token; a reserved token is never trained on and the chat template never "
                                "writes it, so the verifier never emits it")
    spare = [(i, text) for i, text in unused if i not in emitted]
    if spare:
        i, text = spare[-1]
        seen = " nor did the verifier emit it in its regenerated replies" if emitted else ""
        return i, (f"the added token {text} (id {i}), the last of {len(spare)} added tokens the chat template "
                   f"never writes{seen}: the embedding has no spare row (vocab_size {vocab_size}, len(tokenizer) "
                   f"{tokenizer_len}), the tokenizer no mask token and no reserved token; a chat never carries "
                   "it, so the verifier practically never emits it (preflight checks regen's replies)")
    raise VerifierFactsError(f"mask token: the embedding has no spare row (vocab_size {vocab_size} <= "
                             f"len(tokenizer) {tokenizer_len}) and the tokenizer has no mask token; pass "
                             "--mask-token-id with a reserved special token id the verifier never emits")


def draft_arch(model_type: str) -> tuple[str, str]:
    """(speculators' draft architecture, why): llama for Llama-family verifiers, qwen3 for the Qwen
    family, and qwen3 for anything else, said so (the draft's own layers need not match the verifier)."""
    if model_type.startswith("llama"):
        return "llama", f"verifier model_type {model_type}"
    if model_type.startswith("qwen"):
        return "qwen3", f"verifier model_type {model_type}"
    return "qwen3", (f"verifier model_type {model_type} has no draft architecture of its own in speculators: "
                     "a Qwen3-style draft (it reads the verifier's hidden states, not its layers)")


def verifier_config(verifier: str) -> dict | None:
    """The verifier's config: a local config.json, else the HF cache; never the network.

    None only when there is no config here; a config that exists but cannot be read raises
    (ValueError naming the file), so a broken verifier is not mistaken for a missing one."""
    import json
    from pathlib import Path

    path = Path(verifier).expanduser() / "config.json"
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"verifier {verifier}: {path} is not valid JSON ({e})") from e
    if Path(verifier).expanduser().is_absolute() or verifier.count("/") != 1:
        return None  # not a hub id: nothing cached to look at
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(verifier, local_files_only=True).to_dict()
    except OSError:  # not in the HF cache here (transformers raises OSError for a missing file)
        return None


def num_layers_of(cfg: dict | None) -> int | None:
    if not cfg:
        return None
    n = language_model_config(cfg).get("num_hidden_layers")
    return n if isinstance(n, int) else None


def param_count(cfg: dict | None) -> int | None:
    """Parameters of a decoder-only LM from its config alone (dense or MoE), close enough to size it:
    embeddings (+ an untied head), attention, MLP or experts (routed + shared + router) per layer."""
    if not cfg:
        return None
    c = language_model_config(cfg)
    try:
        h, layers, vocab = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["vocab_size"])
        heads = int(c.get("num_attention_heads") or 1)
        kv = int(c.get("num_key_value_heads") or heads)
        hd = int(c.get("head_dim") or h // heads)
        inter = int(c.get("intermediate_size") or 4 * h)
    except (KeyError, TypeError, ValueError):
        return None
    attn = h * hd * (2 * heads + 2 * kv)  # q, o; k, v
    if c.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3): low-rank q and a shared key/value latent
        r, rope = int(c["kv_lora_rank"]), int(c.get("qk_rope_head_dim") or 0)
        nope, v, qr = int(c.get("qk_nope_head_dim") or hd), int(c.get("v_head_dim") or hd), int(c.get("q_lora_rank") or 0)
        q = (h * qr + qr * heads * (nope + rope)) if qr else h * heads * (nope + rope)
        attn = q + h * (r + rope) + r * heads * (nope + v) + heads * v * h
    if c.get("attention_bias") is True:  # a bias on q, k, v and o (gpt-oss)
        attn += hd * (heads + 2 * kv) + h
    experts = int(c.get("num_experts") or c.get("n_routed_experts") or c.get("num_local_experts") or 0)
    moe_inter = int(c.get("moe_intermediate_size") or inter)
    shared = int(c.get("shared_expert_intermediate_size") or 0) or moe_inter * int(c.get("n_shared_experts") or 0)
    dense_layers = min(layers, int(c.get("first_k_dense_replace") or 0)) if experts else layers
    sparse = experts * 3 * h * moe_inter + 3 * h * shared + h * experts
    if c.get("model_type") == "gpt_oss":  # attention sinks (one per head), expert and router biases
        attn += heads
        sparse += experts * (2 * moe_inter + h) + experts
    total = layers * attn + dense_layers * 3 * h * inter + (layers - dense_layers) * sparse
    heads_out = 1 if c.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)) else 2
    return total + heads_out * vocab * h


def plan_tokenizer(path, trust_remote_code: bool = False):
    """The verifier's tokenizer for plans and checks (the storage plan's sample, preflight): the fast
    tokenizer straight from tokenizer.json when the folder has one and needs no remote code. It is the
    class AutoTokenizer builds from that file in transformers 5 (TokenizersBackend: same ids, special
    tokens and chat template), without the import of torch AutoTokenizer brings (2-4 s of every dry
    run). Anything else goes through AutoTokenizer, as the stages load it."""
    folder = Path(path).expanduser()
    if not trust_remote_code and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
