"""Pre-tokenizer table for byte-level BPE vocabularies, keyed by `tokenizer.ggml.pre`.

A GGUF BPE vocabulary names its pre-tokenizer instead of carrying it. Each name maps to the
regexes that cut text into words before BPE runs (applied one after another, every match
kept as its own piece), plus two per-vocabulary switches llama.cpp ties to the name:
`ignore_merges` (a word that is itself a token is taken whole) and the default for
`add_bos_token` when the file does not say. The regexes are the facts of each format as
llama.cpp lists them (src/llama-vocab.cpp); where llama.cpp rewrote one for its own regex
engine we keep the tokenizer.json original, which Oniguruma (used by `tokenizers`) reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import StrataError

# --- regex building blocks -------------------------------------------------------------

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# LLAMA3 and QWEN2 differ only in how many digits make one piece.
_LLAMA3_TEMPLATE = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|{digits}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3 = _LLAMA3_TEMPLATE.replace("{digits}", r"\p{N}{1,3}")
QWEN2 = _LLAMA3_TEMPLATE.replace("{digits}", r"\p{N}")
QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SEED_CODER = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"

_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False  # default when tokenizer.ggml.add_bos_token is absent


_DIGIT_THEN_GPT2 = PreTokenizer((r"\p{N}", GPT2))
_LLAMA3_SPEC = PreTokenizer((LLAMA3,), ignore_merges=True, add_bos=True)

# name -> spec. Several names share one spec, as in llama.cpp.
TABLE: dict[str, PreTokenizer] = {
    "default": PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    **dict.fromkeys(
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4",
         "a.x-4.0", "mellum", "gigachat", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de",
         "modern-bert"),
        PreTokenizer((GPT2,)),
    ),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
        _DIGIT_THEN_GPT2,
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _LLAMA3_SPEC,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((LLAMA3,))),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "solar-open", "kormo", "grok-2"),
        PreTokenizer((QWEN2,)),
    ),
    "qwen35": PreTokenizer((QWEN35,)),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), PreTokenizer((GPT4O,))),
    "tekken": PreTokenizer((TEKKEN,), ignore_merges=True, add_bos=True),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")),
    "deepseek-coder": PreTokenizer(DEEPSEEK_CODER),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), PreTokenizer(DEEPSEEK3)),
    **dict.fromkeys(("bloom", "poro-chat", "gpt3-finnish"), PreTokenizer((BLOOM,))),
    "viking": PreTokenizer((BLOOM, r"\p{N}")),
    "seed-coder": PreTokenizer((SEED_CODER,)),
}


def pretokenizer_for(name: str | None) -> PreTokenizer:
    """The spec for a `tokenizer.ggml.pre` value; a missing value means 'default' (as llama.cpp)."""
    key = "default" if not name else name
    try:
        return TABLE[key]
    except KeyError:
        raise StrataError(
            f"tokenizer.ggml.pre = {name!r}: unknown pre-tokenizer (known: {', '.join(sorted(TABLE))})"
        ) from None
