"""Constrained decoding (strata.grammar) on the test model's tokenizer: masks against the
library's own acceptance, valid outputs walked token by token, random walks drawn only from
allowed tokens that validate against their schema, strict objects, errors, the cache."""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest

from strata.protocol import ConstraintSpec
from strata.grammar import CompiledGrammar, GrammarError, compile_constraint, strict_schema
from strata.grammar.compile import _LRU
from strata.grammar.schema import WHITESPACE_RUN
from strata.text.tokenizer import Tokenizer
from tests.support.grammar_walk import allowed_ids, random_walk
from tests.support.model_fixtures import default_model_or_skip

# A schema whose language is finite (bounded strings, integers, arrays, whitespace), so a random
# walk always ends, with every feature the walk should exercise: nesting, enums, arrays,
# required and optional fields.
FINITE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["S", "M", "L"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {"type": "object", "required": ["admin"],
                  "properties": {"admin": {"type": "boolean"}, "id": {"type": "integer", "minimum": 1, "maximum": 9}}},
    },
    "required": ["name", "size", "owner"],
}
VALID = {"name": "mug", "size": "M", "count": 12, "tags": ["a", "c"], "owner": {"admin": False, "id": 3}}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from strata.gguf.reader import GGUFFile

    with GGUFFile(default_model_or_skip()) as f:
        return Tokenizer.from_metadata(dict(f.metadata))


@pytest.fixture(scope="module")
def finite(tok) -> CompiledGrammar:
    return compile_constraint(ConstraintSpec("json_schema", json.dumps(FINITE)), tok)


def is_allowed(matcher, token: int) -> bool:
    return token in set(allowed_ids(matcher).tolist())


def walk(compiled, tok, text: str):
    """A matcher after every token of `text`, each checked against the mask first."""
    m = compiled.matcher()
    for i, token in enumerate(tok.encode(text)):
        assert is_allowed(m, token), f"token {i} ({tok.token_bytes(token)!r}) of {text!r} not in the mask"
        assert m.accept(token)
    return m


def check_finite(value) -> None:
    """The FINITE schema's rules, by hand (jsonschema is not a dependency of the test suite)."""
    assert isinstance(value, dict) and set(value) <= set(FINITE["properties"])
    assert {"name", "size", "owner"} <= set(value)
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert value["size"] in ("S", "M", "L")
    if "count" in value:
        assert type(value["count"]) is int and 0 <= value["count"] <= 99
    if "tags" in value:
        assert len(value["tags"]) <= 3 and all(t in ("a", "b", "c") for t in value["tags"])
    owner = value["owner"]
    assert isinstance(owner, dict) and set(owner) <= {"admin", "id"} and type(owner["admin"]) is bool
    if "id" in owner:
        assert type(owner["id"]) is int and 1 <= owner["id"] <= 9


def test_every_token_of_valid_outputs_is_allowed(finite, tok):
    for text in (json.dumps(VALID), json.dumps(VALID, indent=2), json.dumps(VALID, separators=(",", ":"))):
        m = walk(finite, tok, text)
        assert m.is_accepting() and m.is_stopped()
        assert set(allowed_ids(m).tolist()) == set(tok.eog_ids) | {tok.eos_id}


def accepts(compiled, tok, text: str) -> bool:
    """Whether every token of `text` is accepted; each token's mask bit must agree with accept."""
    m = compiled.matcher()
    for token in tok.encode(text):
        in_mask = is_allowed(m, token)
        took = m.accept(token)
        assert took == in_mask, f"{tok.token_bytes(token)!r} in {text!r}: mask {in_mask}, accept {took}"
        if not took:
            return False
    return True


@pytest.mark.parametrize("text", [
    '{"name": "mug", "size": 12',  # not one of the enum's strings
    '{"name": "mug", "size": true',
    '{"name": "mug", "size": "XL"',
    '{"name": "mug", "size": "small"',
    '{"name": "mug", "color": "red"',  # a property the schema does not list (strict)
    '{"name": 5',  # the wrong type
    '{"name": "toolongname"',  # past maxLength
    '{"size": "M"',  # properties come in the schema's order; name is required first
    '[{"name": "mug"}]',  # not an object
])
def test_tokens_that_break_the_schema_are_refused(finite, tok, text):
    assert not accepts(finite, tok, text)


def test_refused_token_changes_nothing(finite, tok):
    m = walk(finite, tok, '{"name": "ab", "size": ')
    before = allowed_ids(m)
    refused = [t for t in range(200, 2200, 7) if t not in set(before.tolist())]
    assert refused and not any(m.accept(t) for t in refused)
    assert np.array_equal(allowed_ids(m), before)
    for t in tok.encode('"L", "owner": {"admin": true}}'):
        assert m.accept(t)
    assert m.is_stopped()


def test_mask_bits_match_the_library_acceptance(finite, tok):
    rng = random.Random(7)
    m = finite.matcher()
    for token in tok.encode(json.dumps(VALID))[:12]:
        allowed = set(allowed_ids(m).tolist())
        sample = set(rng.sample(range(tok.vocab_size), 300)) | set(rng.sample(sorted(allowed), min(40, len(allowed))))
        for t in sorted(sample):
            took = m.accept(t)
            assert took == (t in allowed), f"token {t} {tok.token_bytes(t)!r}: mask {t in allowed}, accept {took}"
            if took:
                m.rollback(1)
        assert m.accept(token)


def test_random_walks_from_allowed_tokens_validate(finite, tok):
    jsonschema = None
    try:
        import jsonschema
    except ImportError:
        pass
    rng = random.Random(2024)
    stops = set(tok.eog_ids) | {tok.eos_id}
    for _ in range(6):
        m = finite.matcher()
        ids = random_walk(m, rng, stops)
        assert m.is_accepting()
        value = json.loads(tok.decode(ids))
        check_finite(value)
        if jsonschema is not None:
            jsonschema.validate(value, strict_schema(FINITE))


def test_rollback_returns_to_earlier_masks(finite, tok):
    ids = tok.encode(json.dumps(VALID))
    m = finite.matcher()
    masks = []
    for t in ids:
        masks.append(allowed_ids(m))
        assert m.accept(t)
    stop = tok.eos_id
    assert m.is_stopped() and m.accept(stop) and m.accepted == len(ids) + 1
    m.rollback(1)  # the end-of-generation token taken after the grammar stopped
    assert m.is_stopped() and m.accepted == len(ids)
    m.rollback(5)
    assert np.array_equal(allowed_ids(m), masks[len(ids) - 5])
    for t in ids[-5:]:
        assert m.accept(t)
    assert m.is_stopped()
    with pytest.raises(ValueError):
        m.rollback(len(ids) + 1)


def test_json_object_allows_any_object_only(tok):
    g = compile_constraint(ConstraintSpec("json_object"), tok)
    m = walk(g, tok, '{"a": [1, {"b": null}], "c": "d"}')
    assert m.is_stopped()
    start = g.matcher()
    assert not start.accept(tok.encode("[1]")[0]) and not start.accept(tok.encode("hello")[0])
    assert not start.is_accepting()


def test_whitespace_runs_are_bounded(tok):
    g = compile_constraint(ConstraintSpec("json_object"), tok)
    walk(g, tok, '{\n    "a": 1\n}')
    m = g.matcher()
    text = "{" + " " * (WHITESPACE_RUN + 8) + '"a": 1}'
    assert not all(m.accept(t) for t in tok.encode(text))


def test_lark_grammar(tok):
    g = compile_constraint(ConstraintSpec("lark", 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,3}/\n'), tok)
    assert walk(g, tok, "maybe 42").is_accepting()
    m = g.matcher()
    assert not m.accept(tok.encode("perhaps")[0])


def test_padded_and_narrow_logit_widths(tok):
    n = tok.vocab_size
    wide = compile_constraint(ConstraintSpec("json_object"), tok, n_vocab=n + 45)
    m = wide.matcher()
    assert m.vocab_words == (n + 45 + 31) // 32
    ids = allowed_ids(m)
    assert len(ids) and ids.max() < n and not m.accept(n + 3)
    narrow = compile_constraint(ConstraintSpec("lark", 'start: /[a-z]+/'), tok, n_vocab=n - 7)
    m = narrow.matcher()
    assert m.vocab_words == (n - 7 + 31) // 32
    assert allowed_ids(m).max() < n - 7
    with pytest.raises(ValueError):
        m.fill_mask(np.zeros(m.vocab_words + 1, np.uint32))


@pytest.mark.parametrize("kind, source, says", [
    ("yaml", "", "constraint kind 'yaml': unknown"),
    ("json_schema", "{not json", "json_schema: the schema is not valid JSON"),
    ("json_schema", "[1, 2]", "json_schema: the schema must be a JSON object"),
    ("json_schema", '{"type": "string", "format": "colour"}', "json_schema: Unknown format"),
    ("json_schema", '{"enum": []}', "json_schema:"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "json_schema:"),
    ("lark", "start: undefined_rule", "lark:"),
    ("lark", "   ", "lark: the grammar is empty"),
])
def test_bad_constraints_are_one_line_errors(tok, kind, source, says):
    with pytest.raises(GrammarError) as e:
        compile_constraint(ConstraintSpec(kind, source), tok)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_strict_schema_closes_listed_objects_only():
    schema = {
        "type": "object", "properties": {"a": {"type": "object", "properties": {"x": {}}},
                                         "free": {"type": "object"},
                                         "open": {"type": "object", "properties": {"y": {}},
                                                  "additionalProperties": True},
                                         "list": {"type": "array", "items": {"properties": {"z": {}}}}},
        "$defs": {"d": {"properties": {"w": {}}}},
        "anyOf": [{"properties": {"v": {}}}],
        "allOf": [{"properties": {"p": {}}}],
    }
    out = strict_schema(schema)
    assert "additionalProperties" not in out  # it holds allOf: its siblings' properties are its own
    props = out["properties"]
    assert props["a"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]
    assert props["open"]["additionalProperties"] is True
    assert props["list"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False
    assert out["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0]
    assert "additionalProperties" not in schema["properties"]["a"]  # the input is not changed


def test_compiles_are_cached_per_key(tok):
    spec = ConstraintSpec("json_schema", '{"type": "object", "properties": {"k": {"type": "integer"}}}')
    a = compile_constraint(spec, tok)
    assert compile_constraint(ConstraintSpec(spec.kind, spec.source), tok) is a
    assert compile_constraint(spec, tok, n_vocab=tok.vocab_size + 64) is not a
    lru = _LRU(2)
    for key in "abc":
        lru.put(key, key.upper())
    assert lru.get("a") is None and lru.get("c") == "C" and len(lru) == 2


def test_concurrent_compiles_and_cheap_matchers(tok):
    schema = {"type": "object", "properties": {"t": {"enum": ["x", "y"]}}, "required": ["t"]}
    spec = ConstraintSpec("json_schema", json.dumps(schema))
    results, errors = [], []

    def work():
        try:
            g = compile_constraint(spec, tok)
            results.append(walk(g, tok, '{"t": "y"}').is_stopped())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [True] * 4
    import time

    # a matcher is a copy of the compiled start state, not a compile: 200 of them cost less than
    # one compile of a grammar as small, measured here (the best of 5 batches: a batch that the
    # OS preempted says nothing about the matchers' cost)
    start = time.perf_counter()
    compile_constraint(ConstraintSpec(spec.kind, json.dumps({**schema, "title": "not cached"})), tok)
    one_compile = time.perf_counter() - start
    g = compile_constraint(spec, tok)
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        matchers = [g.matcher() for _ in range(200)]
        batches.append(time.perf_counter() - start)
        assert len({id(m) for m in matchers}) == 200
    assert min(batches) < one_compile, (batches, one_compile)
