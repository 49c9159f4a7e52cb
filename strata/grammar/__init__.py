"""Constrained decoding: the output held to a JSON schema or a grammar, one token at a time.

A request's ConstraintSpec (strata.protocol) is compiled once per tokenizer
(`compile_constraint`, cached); each request takes a fresh `Matcher` from the compiled grammar.
Before a token is sampled the engine asks the matcher for the set of allowed tokens
(`fill_mask`, a bit set over token ids), and after it is chosen tells the matcher
(`accept`); a speculative draft's rejected tail is undone with `rollback`. When the grammar
is complete only end-of-generation is allowed, which is how a constrained output ends.

The grammar library is llguidance (Earley parser over a token trie, Rust, abi3 wheels):
chosen by bench/grammar_mask.py, whose numbers are in pyproject.toml beside the dependency.

    compile.py   kinds table, per-tokenizer LRU, compile_constraint
    matcher.py   CompiledGrammar and Matcher over llguidance's matcher
    schema.py    strict objects and bounded whitespace for JSON schemas; %json rules for Lark
    vocab.py     the library's tokenizer, built once per Tokenizer
    errors.py    GrammarError
"""

from strata.grammar.compile import KINDS, compile_constraint
from strata.grammar.errors import GrammarError
from strata.grammar.matcher import CompiledGrammar, Matcher
from strata.grammar.schema import lark_json_rule, strict_schema

__all__ = ["GrammarError", "compile_constraint", "CompiledGrammar", "Matcher", "KINDS", "lark_json_rule",
           "strict_schema"]
