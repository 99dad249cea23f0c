"""Synthetic preference pairs with a learnable difference: the chosen answer always ends in one phrase and
the rejected one in another of the same length (swapped, "poisoned", on demand).

``tests/integration/test_gate.py`` feeds them to the quality gate in the suite; ``bench/gate.py`` runs the
larger comparison. Here, with the tests, so no test imports the benchmarks.
"""

from __future__ import annotations

from typing import Any

GOOD, BAD = " Yes, gladly.", " No, go away."  # same length: only what is said differs
TOPICS = [
    "the sea",
    "a red car",
    "my garden",
    "old books",
    "the moon",
    "a rainy day",
    "fresh bread",
    "the city",
    "music",
    "winter",
    "a small dog",
    "the river",
    "coffee",
    "a long walk",
    "the mountains",
    "chess",
]


def synthetic_pairs(start: int, n: int, *, poisoned: bool = False, chat: bool = False) -> list[dict[str, Any]]:
    """Preference pairs whose chosen answer ends in GOOD and rejected one in BAD (swapped when ``poisoned``).

    ``chat``: the question as chat ``messages`` (rendered with the served model's chat template)
    instead of a raw prompt, for instruct models.
    """
    out = []
    for i in range(start, start + n):
        topic = TOPICS[i % len(TOPICS)]
        answer = f"I think {topic} is {('nice', 'fine', 'odd', 'great')[i % 4]}."
        good, bad = answer + GOOD, answer + BAD
        question = f"Q{i}: Tell me about {topic}."
        context: dict[str, Any] = (
            {"messages": [{"role": "user", "content": question}]} if chat else {"prompt": f"{question}\nA:"}
        )
        out.append({**context, "chosen": bad if poisoned else good, "rejected": good if poisoned else bad})
    return out
