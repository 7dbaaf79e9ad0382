"""Stop strings across deltas: the matched string is never emitted, nothing else is held forever."""

from __future__ import annotations

import random

from qwenserve.router.stop_strings import StopStringMatcher


def _run(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    matcher = StopStringMatcher(stops)
    out = []
    for delta in deltas:
        check = matcher.push(delta)
        out.append(check.text)
        if check.stopped:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_string_split_across_deltas_is_not_emitted() -> None:
    assert _run(["END"], ["hello E", "N", "D and more"]) == ("hello ", True)


def test_text_that_only_looked_like_a_stop_prefix_is_released() -> None:
    assert _run(["END"], ["hello E", "N", "x"]) == ("hello ENx", False)


def test_text_held_back_at_the_end_is_flushed() -> None:
    assert _run(["END"], ["abc EN"]) == ("abc EN", False)


def test_the_earliest_of_several_stop_strings_wins() -> None:
    assert _run(["world", "lo w"], ["hello world"]) == ("hel", True)


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.push("abc").text == "abc"


def test_random_splits_equal_a_one_shot_search() -> None:
    rng = random.Random(7)
    alphabet = "ab\n ü字"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        hits = [text.find(s) for s in stops if s in text]
        expected = (text[: min(hits)], True) if hits else (text, False)
        assert _run(stops, deltas) == expected, (text, stops, deltas)
