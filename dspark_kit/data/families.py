"""The verifier families the kit builds tiny verifiers of, and the rules that differ per family.

One record per family (`FAMILIES`) says everything the kit assumes of that family's format:
its model config shape (config class, MoE terms), its tokenizer's special tokens and their
order, its chat template (written from the family's documented format), its generation config
(eos ids), its reasoning format and the vLLM parser that splits it, its stop tokens, its
tool-call format and the mask-token rule its vocabulary needs. The builder
(`tiny_builder.py`), the cache (`tiny_verifier.py`), the recipes and the tests read it here.

- **qwen3** (dense) and **qwen3-moe** share Qwen3's ChatML template with the `<think>` switch
  (`enable_thinking`), hermes tool calls, `<|im_end|>` as end of turn, and a spare embedding
  row past the tokenizer for the mask token (the tokenizer's own `<|MASK|>`).
- **gpt-oss**: Harmony (`<|start|>role<|message|>..<|end|>`; a reply is the analysis channel, then
  `<|start|>assistant<|channel|>final<|message|>..<|return|>`), the o200k_harmony tokenizer with
  Harmony's special tokens at their real ids (built from the installed Harmony encoding, not
  trained: vLLM renders gpt-oss chats in Harmony itself, so the ids must be the real ones), a
  201,088-row vocabulary exactly the tokenizer's size (mask token: a reserved special token), and
  history the template rewrites (analysis dropped, `<|return|>` written `<|end|>`), so only a
  conversation's last reply is trained.
- **llama3**: Llama-3-Instruct's header format (`<|begin_of_text|>`, `<|start_header_id|>role
  <|end_header_id|>\n\n`, content, `<|eot_id|>`), no thinking, and a vocabulary exactly the
  tokenizer's size, as Llama-3's own: no spare row, so the mask token is a reserved special
  token (`<|reserved_special_token_0|>`), which the model never saw in training and so never emits.

Layer 1 (data): imports nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dspark_kit.data.reasoning_formats import HARMONY, NONE, THINK, ReasoningFormat

# Qwen3's template, reduced to what the tiny model needs: reasoning comes from
# `reasoning_content` when it is a string, else from inline <think>..</think>
# (split as Qwen3 splits it); reasoning of assistant turns before the last user
# turn is dropped from history, the final assistant turn always
# carries a (possibly empty) think block, and enable_thinking=false pre-fills
# an empty one -- so, as with Qwen3, multi-turn history renders differently
# from the incremental render.
QWEN3_TEMPLATE = (
    # tools (OpenAI's `tools`): Qwen3's system block; a conversation without them renders as before
    "{%- if tools -%}{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, '"
    " + '\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if tools and loop.first and m.role == 'system' -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content if m.content is string else '' -%}{%- set reasoning = '' -%}"
    "{%- if m.reasoning_content is string -%}{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\\n' + content -}}{%- endif -%}"
    # each call as Qwen3 writes it (Hermes format: what vLLM's `--tool-call-parser hermes` reads back)
    "{%- for call in (m.tool_calls or []) -%}{%- set f = call.function if call.function else call -%}"
    "{%- if not loop.first or content -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' -}}"
    "{{- f.arguments if f.arguments is string else (f.arguments | tojson) -}}{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}{{- '<|im_end|>\\n' -}}"
    # tool results: consecutive ones share one user turn, as in Qwen3
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN3_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|MASK|>")
# As in Qwen3's tokenizer, <think>/</think> are added tokens (always one id) but NOT special:
# servers decode replies with skip_special_tokens=True (vLLM's default), and the think block
# must survive in the reply text exactly as with the production verifier.
QWEN3_NOT_SPECIAL = ("<think>", "</think>")


# Meta-Llama-3-8B-Instruct's template as published (BOS first, a header per turn, content
# trimmed, <|eot_id|> ending every turn; no system prompt by default, no thinking).
LLAMA3_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' -%}"
    "{%- if loop.index0 == 0 -%}{%- set content = bos_token + content -%}{%- endif -%}"
    "{{- content -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
# Llama-3's pre-tokenizer split (numbers in runs of up to three digits)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# In Llama-3's order after the BPE merges (ids 128000.. there, len(bpe).. here), a few reserved ones kept
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")


@dataclass(frozen=True)
class Family:
    name: str  # the recipe's builtin:tiny-<name>
    model_type: str
    architecture: str
    config_class: str  # transformers' config class
    chat_template: str
    split_regex: str
    specials: tuple[str, ...]  # in id order
    # "start": the specials are ids 0.. (Qwen's tiny build); "end": after the BPE merges (Llama-3)
    specials_at: str
    eos: str  # the tokenizer's eos_token
    pad: str
    end_of_turn: str  # the token that ends an assistant turn (trained in the loss mask)
    assistant_prefix: str  # the text the template opens an assistant reply with
    stop_tokens: tuple[str, ...]  # generation_config.eos_token_id: any of them ends a reply
    bos: str | None = None
    mask: str | None = None  # the tokenizer's own mask token
    not_special: tuple[str, ...] = ()  # added tokens that stay in decoded text
    additional_special: tuple[str, ...] = ()
    reasoning: ReasoningFormat = NONE  # how replies carry reasoning, and vLLM's parser for it
    tool_call_parser: str | None = None  # vLLM's --tool-call-parser for the template's tool calls
    draft_arch: str = "qwen3"
    # "spare-row": the embedding is rounded up past the tokenizer and the mask token sits there;
    # "reserved": the embedding is the tokenizer's size, the mask is a reserved special token
    mask_rule: str = "spare-row"
    reserved_mask: str | None = None
    model_extra: dict = field(default_factory=dict)  # config terms past the dense shape (MoE)
    # "corpus": a byte-level BPE trained on the tiny corpus; "harmony": the installed Harmony
    # encoding's o200k_harmony vocabulary, every id the real one (tiny_harmony.py)
    tokenizer_source: str = "corpus"
    # whether a history turn renders as the model generated it (ChatML, Llama-3: every reply is
    # trained); Harmony drops history's analysis and writes <|return|> as <|end|>: last reply only
    history_trained: bool = True
    server_env: dict = field(default_factory=dict)  # environment a vLLM server of it needs (Harmony's date)

    @property
    def reasoning_parser(self) -> str | None:
        """vLLM's --reasoning-parser for the family's reasoning format."""
        return self.reasoning.parser

    @property
    def builtin(self) -> str:
        return f"builtin:tiny-{self.name}"

    @property
    def cache_prefix(self) -> str:
        return f"tiny-{self.name}"

    @property
    def assets(self) -> str:
        """The shipped build's folder under data/assets."""
        return "tiny_verifier" if self.name == "qwen3" else f"tiny_{self.name.replace('-', '_')}"

    def spec_extra(self) -> str:
        """What a build's spec hash adds for this family (nothing for qwen3: its hash predates families)."""
        if self.name == "qwen3":
            return ""
        extra = repr((self.name, self.model_type, self.config_class, self.split_regex, self.specials,
                      self.specials_at, self.eos, self.bos, self.mask, sorted(self.model_extra.items())))
        if self.tokenizer_source != "corpus":  # (the families before it hash as they did)
            extra += repr((self.tokenizer_source, self.history_trained, self.stop_tokens, self.end_of_turn))
        return extra

    def planned_vocab(self, spec_vocab: int) -> int:
        """vocab_size a plan assumes before the build: the spec's bound, or Harmony's real one."""
        return 201_088 if self.tokenizer_source == "harmony" else spec_vocab

    def embedding_rows(self, tokenizer_len: int) -> int:
        """vocab_size of the built model: rounded up to 64 (spare rows, as Qwen's) or exactly the tokenizer's."""
        return ((tokenizer_len + 63) // 64) * 64 if self.mask_rule == "spare-row" else tokenizer_len


QWEN3 = Family(
    name="qwen3", model_type="qwen3", architecture="Qwen3ForCausalLM", config_class="Qwen3Config",
    chat_template=QWEN3_TEMPLATE, split_regex=QWEN_SPLIT, specials=QWEN3_SPECIALS, specials_at="start",
    eos="<|im_end|>", pad="<|endoftext|>", end_of_turn="<|im_end|>", assistant_prefix="<|im_start|>assistant\n",
    stop_tokens=("<|im_end|>",), mask="<|MASK|>", not_special=QWEN3_NOT_SPECIAL, additional_special=("<|im_start|>",),
    reasoning=THINK, tool_call_parser="hermes",
)
# Qwen3-30B-A3B's shape, scaled down: every layer sparse, top-k of the experts with normalized
# router weights (8 experts of width 96, top-2: ~4.7 MB of experts in fp32, shipped).
QWEN3_MOE = Family(
    **{**QWEN3.__dict__, "name": "qwen3-moe", "model_type": "qwen3_moe", "architecture": "Qwen3MoeForCausalLM",
       "config_class": "Qwen3MoeConfig",
       "model_extra": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
                       "decoder_sparse_step": 1, "norm_topk_prob": True, "mlp_only_layers": []}},
)
LLAMA3 = Family(
    name="llama3", model_type="llama", architecture="LlamaForCausalLM", config_class="LlamaConfig",
    chat_template=LLAMA3_TEMPLATE, split_regex=LLAMA3_SPLIT, specials=LLAMA3_SPECIALS, specials_at="end",
    eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", bos="<|begin_of_text|>", end_of_turn="<|eot_id|>",
    assistant_prefix="<|start_header_id|>assistant<|end_header_id|>\n\n",
    stop_tokens=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
    draft_arch="llama", mask_rule="reserved",
    reserved_mask="<|reserved_special_token_0|>", model_extra={"rope_theta": 500000.0},
)

# Harmony as vLLM renders a chat for gpt-oss (entrypoints/openai/parser/harmony_utils.py) and
# gpt-oss's published template writes it: the system message (identity, knowledge cutoff, date,
# reasoning effort, channels), a system prompt as the developer's instructions, history replies as
# their final channel ending <|end|> (analysis dropped), the last reply (a training render) with its
# analysis and <|return|>. The date is fixed (HARMONY_DATE) and vLLM is pinned to it
# (VLLM_SYSTEM_START_DATE), so every render is the same on every day.
HARMONY_DATE = "2025-06-28"
HARMONY_SYSTEM = ("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                  "Knowledge cutoff: 2024-06\nCurrent date: " + HARMONY_DATE + "\n\nReasoning: medium\n\n"
                  "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>")
HARMONY_TEMPLATE = (
    "{{- '" + HARMONY_SYSTEM.replace("\n", "\\n") + "' -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' or m.role == 'developer' -%}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + m.content + '<|end|>' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else (m.thinking or '') -%}"
    "{%- if loop.last and not add_generation_prompt -%}"
    "{%- if reasoning -%}{{- '<|start|>assistant<|channel|>analysis<|message|>' + reasoning + '<|end|>' -}}{%- endif -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' -}}"
    "{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}{%- endif -%}"
    "{%- else -%}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)
# o200k's pre-tokenizer split (tiktoken's o200k_base pattern)
O200K_SPLIT = "|".join((  # noqa: FLY002 (one alternative per line, as tiktoken lists them)
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"))
# gpt-oss-20b's shape, scaled down: alternating sliding (128) and full attention with sinks, experts
# of width intermediate_size with top-k routing, YaRN rope, untied embeddings (vLLM's gpt-oss has no tie)
GPT_OSS = Family(
    name="gpt-oss", model_type="gpt_oss", architecture="GptOssForCausalLM", config_class="GptOssConfig",
    chat_template=HARMONY_TEMPLATE, split_regex=O200K_SPLIT, specials=(), specials_at="harmony",
    eos="<|return|>", pad="<|endoftext|>", end_of_turn="<|return|>", assistant_prefix="<|start|>assistant",
    stop_tokens=("<|return|>", "<|endoftext|>", "<|call|>"), reasoning=HARMONY,
    mask_rule="reserved", reserved_mask="<|reserved_200000|>", tokenizer_source="harmony", history_trained=False,
    server_env={"VLLM_SYSTEM_START_DATE": HARMONY_DATE},
    model_extra={"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128,
                 "layer_types": ["sliding_attention", "full_attention"] * 2, "tie_word_embeddings": False,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                     "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False}},
)
FAMILIES: dict[str, Family] = {f.name: f for f in (QWEN3, QWEN3_MOE, LLAMA3, GPT_OSS)}
BUILTINS: dict[str, Family] = {f.builtin: f for f in FAMILIES.values()}


def family_of_builtin(path: str) -> Family | None:
    """The family a recipe's verifier.path names (builtin:tiny-<family>), or None for a real model."""
    return BUILTINS.get(path)
