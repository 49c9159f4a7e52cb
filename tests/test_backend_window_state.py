"""The CUDA backend's per-window state (strata.backend.cuda_window), on the CPU: what one op of a
window hands the next lives in the window's WindowState, keyed by the array it belongs to, and
a graph runner's table feed hands each begun window its own table."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from strata.backend.cuda_window import TableFeed, WindowState, head_spans, prompt_layout, row_ranges, splits_for


@dataclass
class Span:
    cache: object
    start: int
    count: int
    long_prompt: bool = False


def test_q8_blocks_belong_to_their_array_and_their_window():
    win = WindowState(4)
    x, y, q8 = np.zeros((4, 32)), np.zeros((4, 32)), object()
    win.keep_q8(x, q8)
    assert win.q8_of(x) is q8 and win.q8_of(y) is None  # another array (a copy of x) has none
    win.keep_q8(y, None)
    assert win.q8_of(x) is None
    assert WindowState(4).q8_of(x) is None  # a new window starts with nothing


def test_plans_are_shared_by_the_same_ids_only():
    win = WindowState(8)
    ids = np.zeros((8, 2), np.int32)
    win.plans(ids)["key"] = "plan"
    assert win.plans(ids) == {"key": "plan"}  # gate, up and down
    assert win.plans(ids.copy()) == {}  # the next layer's routing
    win.drop_shared()
    assert win.q8_of(ids) is None and win.plans(ids) == {}


def test_prompt_rows_end_with_the_blocks():
    spans = [Span(None, 9, 1), Span(None, 0, 300, long_prompt=True), Span(None, 4, 2)]
    layout = prompt_layout(spans, prefill=True)
    assert layout == ((1, 301, 1),) and prompt_layout(spans, prefill=False) == ()
    win = WindowState(303, prompt_spans=[(a, b, spans[i], i) for a, b, i in layout])
    assert win.prompt_rows == [(1, 301)]
    win.blocks_done = True  # the head's rows are a selection of the window's
    assert win.prompt_rows == []
    assert head_spans(spans, 1) == spans[:1]


def test_row_ranges_cut_at_the_prompts():
    assert row_ranges(10, [(2, 5), (5, 8)]) == [(0, 2, False), (2, 5, True), (5, 8, True), (8, 10, False)]
    assert row_ranges(4, []) == [(0, 4, False)]
    assert row_ranges(6, [(0, 6)]) == [(0, 6, True)]


def test_splits_are_a_power_of_two_per_chunk_of_the_longest_span():
    assert splits_for([Span(None, 0, 1)], 256) == 1
    assert splits_for([Span(None, 256, 1), Span(None, 0, 3)], 256) == 2
    assert splits_for([Span(None, 700, 1)], 256) == 4
    assert splits_for([Span(None, 1 << 20, 1)], 256) == 64


def test_a_feed_hands_each_window_its_table_and_no_more():
    feed = TableFeed(np.arange(10), [(0, 4, 2), (4, 6, 8)])
    table, splits = feed.take()
    assert list(table) == [0, 1, 2, 3] and splits == 2
    table, splits = feed.take()
    assert list(table) == [4, 5, 6, 7, 8, 9] and splits == 8
    with pytest.raises(RuntimeError, match="more than the 2 window"):
        feed.take()
