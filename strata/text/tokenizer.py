"""The model's tokenizer, rebuilt from a GGUF file's `tokenizer.*` metadata.

Encoding runs on a Hugging Face `tokenizers` model built from the GGUF vocabulary (Rust,
thread-safe, fast); the construction mirrors what llama.cpp does with the same metadata so
the ids match llama.cpp's. Decoding does not go through `tokenizers`: every token has exact
bytes (`token_bytes`), and text is the UTF-8 decoding of their concatenation, which is what
llama.cpp's server emits and what streaming needs.

Two vocabulary kinds (`tokenizer.ggml.model`):
- `gpt2`: byte-level BPE. Token text is in GPT-2's byte alphabet; merges are listed; the
  pre-tokenizer regexes come from `tokenizer.ggml.pre` (see pretokenizers.TABLE).
- `llama`: SentencePiece-style. Spaces are '▁', merges follow the scores, characters
  missing from the vocabulary fall back to <0xNN> byte tokens, and a '▁' is prepended to
  each run of text (at the start and after each special token) when add_space_prefix.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Callable

from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from strata.errors import StrataError
from strata.gguf.key_rules import utf8_problem
from strata.text.bytelevel import decode_bytelevel
from strata.text.pretokenizers import pretokenizer_for
from strata.text.spm import merges_from_scores

KEY = "tokenizer.ggml."
SPIECE_SPACE = "\u2581"  # '▁'


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's llama_token_type)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


SPECIAL_TYPES = frozenset({TokenType.UNKNOWN, TokenType.CONTROL})

# Control tokens that end a turn even when the file does not name them eos/eot/eom
# (llama.cpp recognises the same texts).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
    "<｜end▁of▁sentence｜>", "[EOT]", "[EOS]",
})

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# a lone UTF-16 surrogate: what Python makes of bytes that are not UTF-8 in argv, in a file read
# with errors="surrogateescape", or of a JSON "\ud800" escape; no tokenizer can take one
_SURROGATE = re.compile("[\ud800-\udfff]")


def refuse_lone_surrogates(text: str, what: str) -> None:
    """One line naming `what` and where, when the text holds a lone surrogate (not Unicode)."""
    m = _SURROGATE.search(text)
    if m is not None:
        code = ord(m.group())
        raw = f" (the byte 0x{code - 0xDC00:02X} is not UTF-8)" if 0xDC80 <= code <= 0xDCFF else ""
        raise StrataError(f"{what}: character {m.start()} is a lone UTF-16 surrogate U+{code:04X}, "
                          f"not valid Unicode{raw}")


@dataclass(frozen=True)
class Vocab:
    """The parsed, validated `tokenizer.ggml.*` metadata."""

    model: str
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    pad_id: int | None
    add_bos: bool | None  # None: the file does not say; the vocabulary kind decides
    add_eos: bool
    add_space_prefix: bool | None

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> "Vocab":
        tokens = md.get(KEY + "tokens")
        if tokens is None or len(tokens) == 0:
            raise StrataError(f"{KEY}tokens: missing or empty; the file carries no vocabulary")
        tokens = [str(t) for t in tokens]
        merges = [str(m) for m in (md.get(KEY + "merges") or ())]
        for name, texts, what in (("tokens", tokens, "token"), ("merges", merges, "merge")):
            problem = utf8_problem(texts, what)
            if problem:
                raise StrataError(f"{KEY}{name}: {problem}")
        n = len(tokens)
        types = _int_list(md.get(KEY + "token_type"), n, "token_type", TokenType.NORMAL)
        scores = md.get(KEY + "scores")
        if scores is not None:
            scores = [float(s) for s in scores]
            if len(scores) != n:
                raise StrataError(f"{KEY}scores: {len(scores)} entries for {n} tokens")
        model = md.get(KEY + "model")
        if model is None:
            raise StrataError(f"{KEY}model: missing")
        return cls(
            model=str(model),
            pre=md.get(KEY + "pre"),
            tokens=tokens,
            types=types,
            scores=scores,
            merges=merges,
            bos_id=_token_id(md, "bos_token_id", n),
            eos_id=_token_id(md, "eos_token_id", n),
            eot_id=_token_id(md, "eot_token_id", n),
            eom_id=_token_id(md, "eom_token_id", n),
            pad_id=_token_id(md, "padding_token_id", n),
            add_bos=_opt_bool(md.get(KEY + "add_bos_token")),
            add_eos=bool(md.get(KEY + "add_eos_token", False)),
            add_space_prefix=_opt_bool(md.get(KEY + "add_space_prefix")),
        )


def _int_list(value, n: int, name: str, default: int) -> list[int]:
    if value is None:
        return [int(default)] * n
    out = [int(v) for v in value]
    if len(out) != n:
        raise StrataError(f"{KEY}{name}: {len(out)} entries for {n} tokens")
    return out


def _token_id(md: Mapping[str, Any], name: str, n: int) -> int | None:
    value = md.get(KEY + name)
    if value is None:
        return None
    value = int(value)
    if value < 0:  # some converters write -1 for "none"
        return None
    if value >= n:
        raise StrataError(f"{KEY}{name} = {value}: out of range for a vocabulary of {n} tokens")
    return value


def _opt_bool(value) -> bool | None:
    return None if value is None else bool(value)


# --- building the `tokenizers` model, one builder per vocabulary kind -------------------

@dataclass(frozen=True)
class _Built:
    hf_factory: Callable[[], HFTokenizer]  # builds a fresh model (a second one is needed
    # for parse_special=False, which is a per-tokenizer switch in `tokenizers`)
    normal_bytes: Callable[[str], bytes]  # exact bytes of a NORMAL token's text
    add_bos_default: bool


def _id_map(vocab: Vocab) -> dict[str, int]:
    return {text: i for i, text in enumerate(vocab.tokens)}  # duplicates: last id wins (llama.cpp)


def _split_merges(merges: list[str]) -> list[tuple[str, str]]:
    out = []
    for m in merges:
        cut = m.find(" ", 1)  # from 1: a merge's left part may itself start with a space
        if cut > 0:
            out.append((m[:cut], m[cut + 1:]))
    return out


def _bpe_model(ids: dict[str, int], merges: list[tuple[str, str]], **kwargs) -> models.BPE:
    try:
        return models.BPE(ids, merges, **kwargs)
    except Exception:
        # A merge naming a text that is not a token makes `tokenizers` refuse the whole list;
        # llama.cpp ignores such merges, so drop them and retry.
        kept = [(a, b) for a, b in merges if a in ids and b in ids and a + b in ids]
        return models.BPE(ids, kept, **kwargs)


def _add_vocab_tokens(hf: HFTokenizer, vocab: Vocab) -> None:
    """Control/unknown tokens become special added tokens (matched only when parsing
    specials); user-defined ones become plain added tokens (always matched)."""
    special, user = [], []
    for text, t in zip(vocab.tokens, vocab.types):
        if t in SPECIAL_TYPES:
            special.append(AddedToken(text, special=True, normalized=False))
        elif t == TokenType.USER_DEFINED:
            user.append(AddedToken(text, special=False, normalized=False))
    if special:
        hf.add_special_tokens(special)
    if user:
        hf.add_tokens(user)


def _build_gpt2(vocab: Vocab) -> _Built:
    spec = pretokenizer_for(vocab.pre)
    ids = _id_map(vocab)
    merges = _split_merges(vocab.merges)

    def factory() -> HFTokenizer:
        hf = HFTokenizer(_bpe_model(ids, merges, ignore_merges=spec.ignore_merges))
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        _add_vocab_tokens(hf, vocab)
        return hf

    return _Built(factory, decode_bytelevel, spec.add_bos)


def _build_llama(vocab: Vocab) -> _Built:
    if vocab.scores is None:
        raise StrataError(f"{KEY}scores: missing; a 'llama' (SentencePiece) vocabulary needs them")
    ids = _id_map(vocab)
    mergeable = [t == TokenType.NORMAL for t in vocab.types]
    merges = merges_from_scores(vocab.tokens, vocab.scores, mergeable)
    unk = next((vocab.tokens[i] for i, t in enumerate(vocab.types) if t == TokenType.UNKNOWN), None)
    space_prefix = True if vocab.add_space_prefix is None else vocab.add_space_prefix

    def factory() -> HFTokenizer:
        # fuse_unk off: llama.cpp emits one unknown per unmatched piece.
        hf = HFTokenizer(_bpe_model(ids, merges, unk_token=unk, byte_fallback=True, fuse_unk=False))
        steps = [normalizers.Replace(" ", SPIECE_SPACE)]
        if space_prefix:
            # Normalizers run on each run of text between added tokens, so this prepends
            # at the start and after every special token, as llama.cpp does.
            steps.insert(0, normalizers.Prepend(SPIECE_SPACE))
        hf.normalizer = normalizers.Sequence(steps)
        _add_vocab_tokens(hf, vocab)
        return hf

    def normal_bytes(text: str) -> bytes:
        return text.replace(SPIECE_SPACE, " ").encode("utf-8")

    return _Built(factory, normal_bytes, True)


BUILDERS: dict[str, Callable[[Vocab], _Built]] = {"gpt2": _build_gpt2, "llama": _build_llama}


TRIE_MAX_CHARS = 200  # special-token texts are a few dozen characters


def _literal_pattern(texts: list[str]) -> "re.Pattern[str]":
    """A regex finding any of `texts`, leftmost-longest. Written as a trie (one branch per next
    character, a shorter text's end tried last), so a search tests each position against the few
    texts that can still match there: a plain alternation of 256 texts that share a prefix costs
    ~1 s on a megabyte that repeats it. A vocabulary with a text longer than TRIE_MAX_CHARS
    (a trie that deep would nest past the regex compiler's depth) gets the plain alternation,
    longest first: the same matches."""
    alternation = "|".join(map(re.escape, sorted(texts, key=len, reverse=True)))
    if max(map(len, texts)) > TRIE_MAX_CHARS:
        return re.compile(alternation)
    try:
        return re.compile(_trie_regex(_trie(texts)))
    except (RecursionError, re.error, OverflowError):
        return re.compile(alternation)


def _trie(texts: list[str]) -> dict:
    root: dict = {}
    for text in texts:
        node = root
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = True  # a text ends here
    return root


def _trie_regex(node: dict) -> str:
    branches = []
    for ch, child in sorted((c, n) for c, n in node.items() if c):
        run = ch  # a chain of single children without an end is one literal
        while "" not in child and len(child) == 1:
            (ch, child), = child.items()
            run += ch
        branches.append(re.escape(run) + _trie_regex(child))
    if not branches:
        return ""
    group = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    if "" in node:  # a text ends here: the longer ones are tried first (a greedy optional group)
        return f"(?:{group})?"
    return group


class Tokenizer:
    """Encode text to ids and ids to bytes/text, exactly as llama.cpp does for the model."""

    def __init__(self, vocab: Vocab):
        builder = BUILDERS.get(vocab.model)
        if builder is None:
            raise StrataError(
                f"{KEY}model = {vocab.model!r}: unsupported tokenizer model (supported: {', '.join(BUILDERS)})"
            )
        built = builder(vocab)
        self.vocab = vocab
        self._built = built
        self._hf = built.hf_factory()
        self._hf_plain: HFTokenizer | None = None  # specials not parsed; built on first use
        self._plain_lock = threading.Lock()
        self._bytes: list[bytes | None] = [None] * len(vocab.tokens)
        # control/unknown token text -> id (duplicates: the last id, as _id_map), and its regex
        self._special_ids = {t: i for i, (t, ty) in enumerate(zip(vocab.tokens, vocab.types)) if ty in SPECIAL_TYPES}
        self._special_re: "re.Pattern[str] | bool | None" = None
        self.add_bos = built.add_bos_default if vocab.add_bos is None else vocab.add_bos
        self.add_eos = vocab.add_eos
        self.eog_ids: set[int] = self._eog_ids()

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        return cls(Vocab.from_metadata(md))

    # --- ids and properties ---
    @property
    def vocab_size(self) -> int:
        return len(self.vocab.tokens)

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def pad_id(self) -> int | None:
        return self.vocab.pad_id

    def _eog_ids(self) -> set[int]:
        v = self.vocab
        eog = {i for i in (v.eos_id, v.eot_id, v.eom_id) if i is not None}
        eog.update(
            i for i, (text, t) in enumerate(zip(v.tokens, v.types))
            if t == TokenType.CONTROL and text in EOG_TEXTS
        )
        return eog

    def token_to_id(self, text: str) -> int | None:
        """Id of the token whose vocabulary text is `text` (e.g. '<|im_end|>'), or None."""
        return self._hf.token_to_id(text)

    def _check(self, token_id: int) -> int:
        token_id = int(token_id)
        if not 0 <= token_id < len(self.vocab.tokens):
            raise StrataError(f"token id {token_id}: out of range for a vocabulary of {self.vocab_size}")
        return token_id

    def is_special(self, token_id: int) -> bool:
        """Control or unknown token (skipped by decode(skip_special=True))."""
        return self.vocab.types[self._check(token_id)] in SPECIAL_TYPES

    def token_text(self, token_id: int) -> str:
        """The token as stored in the vocabulary (byte alphabet / '▁' and all)."""
        return self.vocab.tokens[self._check(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """Exact bytes the token stands for; special and user-defined tokens give their text,
        unused tokens nothing (as llama.cpp renders them)."""
        token_id = self._check(token_id)
        cached = self._bytes[token_id]
        if cached is None:
            cached = self._bytes[token_id] = self._render(token_id)
        return cached

    def _render(self, token_id: int) -> bytes:
        text, t = self.vocab.tokens[token_id], self.vocab.types[token_id]
        if t == TokenType.NORMAL:
            return self._built.normal_bytes(text)
        if t == TokenType.BYTE:
            m = _BYTE_TOKEN.fullmatch(text)
            return bytes([int(m.group(1), 16)]) if m else text.encode("utf-8")
        if t in SPECIAL_TYPES or t == TokenType.USER_DEFINED:
            return text.encode("utf-8")
        return b""  # unused / undefined

    def piece(self, token_id: int) -> str:
        """The token's text as llama.cpp's token_to_piece shows it (invalid UTF-8 replaced)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    # --- encode / decode ---
    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. add_special adds BOS (and EOS) as the vocabulary asks, never a
        second BOS in front of one the text already starts with. parse_special matches
        control tokens written in the text (e.g. '<|im_start|>'); off, they are plain text."""
        if not isinstance(text, str):
            raise StrataError(f"text to tokenize must be a string, not {type(text).__name__}")
        refuse_lone_surrogates(text, "text to tokenize")
        hf = self._hf if parse_special else self._plain()
        # encode_batch, not encode: it releases the GIL while it works (encode holds it, ~1.5 s
        # per MB), so a big prompt tokenized on a server thread does not stop its event loop
        ids = hf.encode_batch([text], add_special_tokens=False)[0].ids
        return self._framed(ids) if add_special else ids

    def _framed(self, ids: list[int]) -> list[int]:
        """BOS (and EOS) added as the vocabulary asks, never a second BOS."""
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        if self.add_eos and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    @property
    def special_pattern(self) -> "re.Pattern[str] | None":
        """A regex matching the text of any control/unknown token, leftmost-longest as the
        tokenizer matches them (longer texts first); None when the vocabulary has none."""
        if self._special_re is None:
            self._special_re = _literal_pattern(list(self._special_ids)) if self._special_ids else False
        return self._special_re or None

    def encode_parts(self, parts: Iterable[tuple[str, bool]], add_special: bool = False) -> list[int]:
        """Token ids of the parts' texts joined, where a part's flag says whether its special
        tokens are parsed (a chat template's text) or are plain text (what a user wrote). Text
        between two special tokens is tokenized in one piece whatever parts it spans, so
        with every flag on this is encode() of the joined text."""
        pattern = self.special_pattern
        pieces: list[int | str] = []  # special ids and the runs of text between them
        run: list[str] = []
        for text, parse in parts:
            refuse_lone_surrogates(text, "text to tokenize")
            at = 0
            for m in (pattern.finditer(text) if parse and pattern is not None else ()):
                run.append(text[at : m.start()])
                pieces += ["".join(run), self._special_ids[m.group()]]
                run, at = [], m.end()
            run.append(text[at:])
        pieces.append("".join(run))
        runs = [p for p in pieces if isinstance(p, str) and p]
        encoded = iter(self._plain().encode_batch(runs, add_special_tokens=False) if runs else [])
        ids: list[int] = []
        for p in pieces:
            if isinstance(p, int):
                ids.append(p)
            elif p:
                ids += next(encoded).ids
        return self._framed(ids) if add_special else ids

    def pretokenize(self, text: str) -> list[str]:
        """The words BPE sees, as text (for debugging a `pre` choice; no special tokens)."""
        pre = self._hf.pre_tokenizer
        if pre is None:  # SentencePiece: the whole run is one word
            return [text] if text else []
        return [self._built.normal_bytes(w).decode("utf-8", errors="replace") for w, _ in pre.pre_tokenize_str(text)]

    def _plain(self) -> HFTokenizer:
        if self._hf_plain is None:
            with self._plain_lock:
                if self._hf_plain is None:
                    hf = self._built.hf_factory()
                    hf.encode_special_tokens = True
                    self._hf_plain = hf
        return self._hf_plain

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        out = []
        for i in ids:
            if skip_special and self.is_special(i):
                continue
            out.append(self.token_bytes(i))
        return b"".join(out)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of the ids: their bytes joined, then decoded (invalid UTF-8 replaced)."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"Tokenizer(model={self.vocab.model!r}, pre={self.vocab.pre!r}, vocab_size={self.vocab_size})"
