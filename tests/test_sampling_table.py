"""The numeric sampling parameters are one table (strata/protocol.py: SamplingParams' fields with
a Knob row), and every front end is made from it: the HTTP request fields with their ranges and
aliases, llama-server's `params` on /props and /slots, and `strata generate`'s flags. A new
sampler is its field and row, and its filter (strata/sampling/filters.py)."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from strata.cli import generate
from strata.protocol import KNOB_DEFAULTS, KNOBS, SamplingParams
from strata.sampling import filters
from strata.sampling.bounds import REQUEST_BOUNDS, SAMPLING_BOUNDS
from strata.server import field_policy, llama_routes
from strata.server.errors import APIError
from strata.server.schemas import ChatCompletionRequest, CompletionRequest, parse_request


def _complete(**fields):
    return parse_request(CompletionRequest, json.dumps({"prompt": "x", **fields}).encode())


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_every_knob_is_a_request_field_with_its_range(name):
    k = KNOBS[name]
    for model in (CompletionRequest, ChatCompletionRequest):
        assert name in model.model_fields and name not in model.field_rules
    b = REQUEST_BOUNDS[name]
    assert b is k.bound
    step = 1 if b.whole else 1e-6
    inside = ([b.high] if math.isfinite(b.high) else []) + ([] if b.low_open else [b.low])
    for value in inside:
        assert getattr(_complete(**{name: value}).sampling(1, logprobs=False, top_logprobs=0), name) == value
    with pytest.raises(APIError) as e:
        _complete(**{name: b.low if b.low_open else b.low - step})
    assert e.value.body()["error"]["param"] == name
    left_out = _complete().sampling(1, logprobs=False, top_logprobs=0)
    assert getattr(left_out, name) == KNOB_DEFAULTS[name] == getattr(SamplingParams(), name)
    if k.nullable:
        assert getattr(_complete(**{name: None}).sampling(1, logprobs=False, top_logprobs=0), name) == KNOB_DEFAULTS[name]
    if k.alias:
        assert CompletionRequest.aliases[k.alias] == name


def test_llama_servers_params_show_every_knob_under_its_name():
    p = SamplingParams(**{name: (3 if k.bound.whole else 0.5) for name, k in KNOBS.items()})
    shown = llama_routes.generation_settings(p, 7)
    for name, k in KNOBS.items():
        assert shown[k.llama or name] == getattr(p, name)
    assert shown["repeat_penalty"] == 0.5 and shown["typical_p"] == 1.0  # (a sampler Strata has not: off)
    assert llama_routes.SAMPLERS == ("penalties", *filters.CHAIN)


def test_generate_has_a_flag_for_each_knob_that_names_one():
    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    args = p.parse_args(["--prompt", "x"])
    flagged = {name for name, k in KNOBS.items() if k.flag_help}
    assert flagged == set(SAMPLING_BOUNDS) - {"max_tokens"} and {"temperature", "top_k", "top_p", "min_p"} <= flagged
    assert args.temperature == 0.0 and args.top_p == 1.0 and args.max_tokens == 128


def test_the_off_rules_of_field_policy_give_way_to_knobs():
    assert "typical_p" in field_policy.SHARED and "typical_p" not in KNOBS
    assert set(KNOBS).isdisjoint(CompletionRequest.field_rules)


def test_the_device_samples_what_the_filters_have():
    assert filters.device_can_sample(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1))
    assert all(f.on_device for f in filters.LOGIT_FILTERS + filters.PROB_FILTERS)
