"""Token-mask cost of constrained decoding, per grammar library, on the test model's vocabulary.

    python bench/grammar_mask.py [--pack FILE] [--walks 20] [--libs llguidance,xgrammar]

For each case (any JSON object; a nested schema with enums, arrays and required fields; a
Hermes tool-call grammar over three functions with two calls) it compiles the grammar, then
walks a valid output token by token: the mask of allowed tokens is computed before each token
(the part that sits on the decoding path) and the token is accepted after it. It prints one
Markdown table: library, case, compile ms (median of 3 fresh compiles, after a warm-up compile
that builds the library's per-tokenizer tables, shown as the `setup` row), mean / p50 / p99
per-token mask us over all walks, and whether every token of the walk was in its mask.

llguidance runs through strata.grammar (what the engine uses). xgrammar runs through its own
API on the same token bytes and the same strict, whitespace-bounded schemas. xgrammar 0.2.9
imports torch and transformers at module import (matcher.py, tokenizer_info.py, contrib/hf.py),
so without torch it cannot be imported at all; this script then puts minimal stand-ins for
those two modules into sys.modules before importing it (its compiler and matcher take any
DLPack array, so numpy masks work) and says so under the table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import types

import numpy as np

from strata.defaults import default_model_path
from strata.protocol import ConstraintSpec
from strata.gguf.reader import GGUFFile
from strata.grammar import compile_constraint, strict_schema
from strata.grammar.schema import WHITESPACE_RUN
from strata.text.tokenizer import Tokenizer
from strata.text.tool_calls import HERMES, call_grammar, call_schema, check_tools

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "customer": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                                      "tier": {"enum": ["free", "pro", "enterprise"]}},
                     "required": ["name", "tier"]},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                           "size": {"enum": ["S", "M", "L", "XL"]},
                           "tags": {"type": "array", "items": {"type": "string"}}},
            "required": ["sku", "qty"]}},
        "status": {"enum": ["pending", "paid", "shipped"]},
        "total": {"type": "number"},
        "gift": {"type": "boolean"},
    },
    "required": ["order_id", "customer", "items", "status"],
}
ORDER = {"order_id": "ABC-1234", "customer": {"name": "Ada Lovelace", "email": "ada@example.org", "tier": "pro"},
         "items": [{"sku": "tea-earl-grey", "qty": 2, "size": "M", "tags": ["hot", "loose leaf"]},
                   {"sku": "mug", "qty": 1, "size": "L", "tags": []}],
         "status": "paid", "total": 31.5, "gift": False}
ANY_OBJECT = {"name": "Strata", "version": [0, 1, 0], "nested": {"ok": True, "ratio": 0.25, "none": None},
              "text": "plain words, punctuation; and \"quotes\"", "list": [{"a": 1}, {"b": [2, 3]}]}
TOOLS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}},
])
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("search", {"query": "tea shops near me", "limit": 5})]


def cases() -> list[dict]:
    """name, the ConstraintSpec strata compiles, the schema / grammar xgrammar gets, a valid output."""
    tool_lark = call_grammar(HERMES, TOOLS, parallel=True)
    return [
        dict(name="json_object", spec=ConstraintSpec("json_object"), xg=("schema", {"type": "object"}),
             text=json.dumps(ANY_OBJECT)),
        dict(name="json_schema (nested)", spec=ConstraintSpec("json_schema", json.dumps(ORDER_SCHEMA)),
             xg=("schema", strict_schema(ORDER_SCHEMA)), text=json.dumps(ORDER)),
        dict(name="tool call (lark)", spec=ConstraintSpec("lark", tool_lark),
             xg=("tool", strict_schema(call_schema(HERMES, TOOLS))), text=HERMES.render_calls(CALLS)),
    ]


def summary(samples_us: list[float]) -> tuple[float, float, float]:
    ordered = sorted(samples_us)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return statistics.fmean(ordered), statistics.median(ordered), p99


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


# --- llguidance, through strata.grammar ---------------------------------------------------------

def run_llguidance(tok: Tokenizer, walks: int) -> list[tuple]:
    rows = []
    t = time.perf_counter()
    compile_constraint(ConstraintSpec("json_object"), tok)
    rows.append(("llguidance", "setup", (time.perf_counter() - t) * 1e3, None, True))
    for case in cases():
        times = []
        for i in range(3):  # another logit width is another cache key: a real compile each time
            t = time.perf_counter()
            compile_constraint(case["spec"], tok, n_vocab=tok.vocab_size + 1 + i)
            times.append((time.perf_counter() - t) * 1e3)
        compiled = compile_constraint(case["spec"], tok)
        ids = tok.encode(case["text"])
        samples, ok = [], True
        mask = np.zeros(compiled.vocab_words, np.uint32)
        for _ in range(walks):
            m = compiled.matcher()
            for token in ids:
                t = time.perf_counter()
                m.fill_mask(mask)
                samples.append((time.perf_counter() - t) * 1e6)
                ok &= allowed(mask, token) and m.accept(token)
            ok &= m.is_accepting()
        rows.append(("llguidance", case["name"], statistics.median(times), summary(samples), ok))
    return rows


# --- xgrammar, through its own API --------------------------------------------------------------

def import_xgrammar() -> tuple[object, str]:
    """xgrammar, and how it was imported ('' or the stand-in note)."""
    try:
        import torch  # noqa: F401
        import xgrammar
        return xgrammar, ""
    except ImportError:
        pass
    import tvm_ffi  # noqa: F401  (before the stand-in: it probes for torch itself)

    torch = types.ModuleType("torch")
    torch.Tensor = torch.LongTensor = torch.FloatTensor = type("Tensor", (), {})
    torch.int32 = "int32"
    torch.tensor = lambda *a, **k: None
    transformers = types.ModuleType("transformers")
    for name in ("PreTrainedTokenizerBase", "PreTrainedTokenizerFast", "LogitsProcessor"):
        setattr(transformers, name, type(name, (), {}))
    sys.modules.setdefault("torch", torch)
    sys.modules.setdefault("transformers", transformers)
    import xgrammar
    return xgrammar, "torch and transformers were stand-ins (not installed)"


def _xg_tool_ebnf(xgr, schema: dict) -> str:
    one = str(xgr.Grammar.from_json_schema(json.dumps(schema), max_whitespace_cnt=WHITESPACE_RUN))
    one = re.sub(r"\broot\b", "call", one)  # the call's own root becomes a rule of the wrapper
    return ('root ::= block ("\\n" block)*\n'
            'block ::= "<tool_call>\\n" call "\\n</tool_call>"\n' + one)


def run_xgrammar(tok: Tokenizer, walks: int) -> tuple[list[tuple], str]:
    xgr, note = import_xgrammar()
    t = time.perf_counter()
    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    stops = sorted(tok.eog_ids | ({tok.eos_id} if tok.eos_id is not None else set()))
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=stops)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiler.compile_json_schema('{"type": "object"}')
    rows = [("xgrammar", "setup", (time.perf_counter() - t) * 1e3, None, True)]
    for case in cases():
        how, schema = case["xg"]
        build = ((lambda: compiler.compile_json_schema(json.dumps(schema), max_whitespace_cnt=WHITESPACE_RUN))
                 if how == "schema" else (lambda: compiler.compile_grammar(_xg_tool_ebnf(xgr, schema))))
        compiled, times = None, []
        for _ in range(3):
            t = time.perf_counter()
            compiled = build()
            times.append((time.perf_counter() - t) * 1e3)
        ids = tok.encode(case["text"])
        samples, ok = [], True
        mask = np.zeros((1, (tok.vocab_size + 31) // 32), np.int32)
        for _ in range(walks):
            m = xgr.GrammarMatcher(compiled)
            for token in ids:
                t = time.perf_counter()
                m.fill_next_token_bitmask(mask)
                samples.append((time.perf_counter() - t) * 1e6)
                ok &= allowed(mask[0].view(np.uint32), token) and m.accept_token(token)
        rows.append(("xgrammar", case["name"], statistics.median(times), summary(samples), ok))
    return rows, note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pack", default=None, help="GGUF file whose tokenizer to use (default: the bundled SmolLM2)")
    ap.add_argument("--walks", type=int, default=20, help="walks of each valid output")
    ap.add_argument("--libs", default="llguidance,xgrammar")
    args = ap.parse_args()
    with GGUFFile(args.pack or default_model_path()) as f:
        tok = Tokenizer.from_metadata(dict(f.metadata))

    rows, notes = [], []
    for lib in args.libs.split(","):
        if lib == "llguidance":
            rows += run_llguidance(tok, args.walks)
        elif lib == "xgrammar":
            try:
                xg_rows, note = run_xgrammar(tok, args.walks)
            except ImportError as e:
                notes.append(f"xgrammar: not importable ({e})")
                continue
            rows += xg_rows
            if note:
                notes.append(f"xgrammar: {note}")
    print(f"vocabulary: {tok.vocab_size} tokens; {args.walks} walks per case\n")
    print("| library | case | compile ms | mask mean us | p50 us | p99 us | walk ok |")
    print("|---|---|---:|---:|---:|---:|---|")
    for lib, name, compile_ms, stats, ok in rows:
        cells = ["", "", ""] if stats is None else [f"{x:.1f}" for x in stats]
        print(f"| {lib} | {name} | {compile_ms:.1f} | {' | '.join(cells)} | {'yes' if ok else 'NO'} |")
    for note in notes:
        print(f"\n{note}")


if __name__ == "__main__":
    main()
