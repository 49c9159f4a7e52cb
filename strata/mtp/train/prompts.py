"""Prompts the target answers to make its own training text (self-distillation).

Training prompts are built from templates x topics so ~200 varied requests cost a few lines;
the held-out prompts (used for acceptance while training and by bench/bench_mtp.py) are
written out by hand, on topics and phrasings the templates never produce.
"""

from __future__ import annotations

import itertools

TOPICS = [
    "the water cycle", "black holes", "photosynthesis", "the French Revolution", "volcanoes", "honey bees",
    "the stock market", "machine learning", "the Roman Empire", "climate change", "the human heart",
    "electric cars", "coffee", "the Moon landing", "sleep", "recycling", "the internet", "dinosaurs",
    "chess", "rainbows", "vaccines", "the Great Wall of China", "solar panels", "friendship", "jazz music",
    "the ocean tides", "earthquakes", "bread baking", "time management", "the Olympic Games",
]

CHAT = [
    "Can you explain {t} to me in simple terms?",
    "What is the most interesting fact about {t}?",
    "I'm curious about {t}. Where should I start?",
    "Why does {t} matter?",
    "Tell me something surprising about {t}.",
    "How would you describe {t} to a child?",
]
LISTS = [
    "List five key facts about {t}.",
    "Give me three tips related to {t}, as a numbered list.",
    "What are the pros and cons of {t}? Use bullet points.",
    "Name four questions a student might ask about {t}.",
]
PROSE = [
    "Write a short paragraph about {t}.",
    "Write a short story that involves {t}.",
    "Write a poem about {t}.",
    "Write a brief essay introduction on {t}.",
]
CODE = [
    "Write a Python function that {c}.",
    "Write a JavaScript function that {c}.",
    "Write a Python function that {c}, and explain how it works.",
    "Write a C function that {c}.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "sorts a list of numbers", "counts the words in a sentence", "finds the largest element in a list",
    "converts Celsius to Fahrenheit", "merges two sorted lists", "checks if a string is a palindrome",
    "computes the Fibonacci numbers up to n", "reads a file line by line", "removes duplicates from a list",
    "computes the average of a list", "finds the greatest common divisor of two numbers",
]
QA = [
    "What is {a} plus {b}?", "How many days are in {m}?", "What is the capital of {c}?",
    "Translate 'good morning' into {l}.",
]


# a second set (no overlap with the first or with HELD_OUT's subjects): `training_prompts(n, more=True)`
TOPICS_MORE = [
    "the printing press", "penguins", "the immune system", "glaciers", "the Renaissance", "wind turbines",
    "origami", "the Amazon rainforest", "comets", "gardening", "the violin", "public libraries", "bicycles",
    "the Silk Road", "octopuses", "nutrition", "museums", "the periodic table", "trains", "deserts",
    "meditation", "board games", "the Eiffel Tower", "tea ceremonies", "robots", "mushrooms", "lighthouses",
    "the human brain", "ancient Egypt", "soccer", "photography", "money", "bridges", "the Arctic", "yoga",
    "electricity", "the piano", "wolves", "satellites", "pottery",
]
CODE_TASKS_MORE = [
    "counts the vowels in a string", "flattens a nested list", "checks whether two strings are anagrams",
    "returns the n-th triangular number", "finds the second largest number in a list",
    "capitalizes every word in a sentence", "computes the power of a number without using **",
    "checks whether a year is a leap year", "returns the digits of an integer as a list",
    "finds the index of an item with binary search", "counts how often each character appears",
    "converts a binary string to an integer", "rotates a list by k positions", "computes the median of a list",
    "checks whether a list is sorted", "returns the common elements of two lists",
]


def training_prompts(n: int = 200, more: bool = False) -> list[tuple[str, str]]:
    """(kind, user message) pairs, kinds interleaved so any prefix is a varied sample.

    The first 434 come from TOPICS / CODE_TASKS, then (n > 434) the 560 of TOPICS_MORE /
    CODE_TASKS_MORE; more=True gives only the second set.
    """
    topics, tasks = (TOPICS_MORE, CODE_TASKS_MORE) if more else (TOPICS, CODE_TASKS)
    pools = {
        "chat": [tpl.format(t=t) for t, tpl in itertools.product(topics, CHAT)],
        "lists": [tpl.format(t=t) for t, tpl in itertools.product(topics, LISTS)],
        "prose": [tpl.format(t=t) for t, tpl in itertools.product(topics, PROSE)],
        "code": [tpl.format(c=c) for c, tpl in itertools.product(tasks, CODE)],
        "qa": [] if more else [QA[0].format(a=a, b=b) for a, b in ((12, 30), (7, 8), (150, 275))]
        + [QA[1].format(m=m) for m in ("February", "a leap year", "a week")]
        + [QA[2].format(c=c) for c in ("France", "Japan", "Canada", "Brazil", "Egypt")]
        + [QA[3].format(l=lang) for lang in ("Spanish", "German", "Italian")],
    }
    # spread each pool evenly (stride through it) so topics and templates both vary
    spread = {k: [v[(i * 7) % len(v)] for i in range(len(v))] if len(v) % 7 else v for k, v in pools.items()}
    out: list[tuple[str, str]] = []
    for i in itertools.count():
        added = False
        for kind in ("chat", "code", "lists", "prose", "chat", "qa"):
            pool = spread[kind]
            j = i if kind != "chat" else 2 * i + (len(out) % 2)
            if j < len(pool) and (kind, pool[j]) not in out:
                out.append((kind, pool[j]))
                added = True
            if len(out) >= n:
                return out
        if not added:  # the first set is exhausted: continue with the second
            return out + (training_prompts(n - len(out), more=True) if not more else [])
    return out


# held out: never used for training; acceptance and the bench run on these
HELD_OUT: dict[str, list[str]] = {
    "chat": [
        "Hi! How are you today?",
        "What should I cook for dinner tonight?",
        "How do airplanes stay in the air?",
        "Can you help me plan a weekend trip to the mountains?",
        "What is the difference between weather and climate?",
        "Why is the sky blue?",
    ],
    "code": [
        "Write a Python function that returns the sum of the squares of a list.",
        "Write a Python class for a simple bank account with deposit and withdraw methods.",
        "How do I read a JSON file in Python?",
        "Write a SQL query that selects all users older than 30.",
    ],
    "lists": [
        "List the planets of the solar system in order.",
        "Give me five ideas for a birthday party.",
        "What are the steps to make a cup of tea?",
        "List six healthy breakfast foods.",
    ],
    "prose": [
        "Write a short description of a quiet forest in autumn.",
        "Write a paragraph about the importance of reading books.",
        "Write a short letter thanking a teacher.",
        "Describe a busy city street at night.",
    ],
}


def held_out(kinds=None, per_kind: int | None = None) -> list[tuple[str, str]]:
    out = []
    for kind, texts in HELD_OUT.items():
        if kinds is None or kind in kinds:
            out += [(kind, t) for t in texts[:per_kind]]
    return out
