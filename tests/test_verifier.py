"""The verifier on cases worked by hand."""

from __future__ import annotations

import pytest

from pbsd.verifier import exact_match, extract_boxed, normalize, token_f1, verify


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"The answer is \boxed{Danube}.", "Danube"),
        (r"first \boxed{Rhine} then, on reflection, \boxed{Danube}", "Danube"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{ {nested {deep}} braces }", "{nested {deep}} braces"),
        (r"\boxed {spaced}", "spaced"),
        (r"\boxed{a \{literal\} brace}", r"a \{literal\} brace"),
        (r"\boxed{good} and a broken \boxed{never closed", "good"),
        ("no box at all", None),
        (r"\boxed{", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("The Danube", "danube"),  # case and article
        ("Danube!", "danube"),  # punctuation
        ("  the   glass  orchard ", "Glass Orchard"),  # whitespace
        ("Émile Zola", "Emile Zola"),  # accents
        ("1,000", "1000"),  # digit groups
        ("3.0", "3"),
        ("three", "3"),  # number words
        (r"\text{Paris}", "Paris"),  # LaTeX wrappers
        ("U.S.A.", "USA"),  # acronyms: the last "a" is not an article
        ("an Orchid", "orchid"),
    ],
)
def test_normalisation_equates(a, b):
    assert normalize(a) == normalize(b)


@pytest.mark.parametrize(
    ("a", "b"), [("Danube", "Rhine"), ("12.5", "125"), ("1000", "100"), ("Paris", "Paris Hilton")]
)
def test_normalisation_keeps_differences(a, b):
    assert normalize(a) != normalize(b)


def test_exact_match_with_aliases():
    assert exact_match("Donau", "Danube", ["the Donau", "Duna"])
    assert exact_match("the danube", "Danube")
    assert not exact_match("Rhine", "Danube", ["Donau"])
    assert not exact_match("", "Danube")
    assert not exact_match(None, "Danube")
    assert not exact_match("the", "A")  # nothing left after normalisation is never a match


def test_token_f1_by_hand():
    # pred {glass, orchard}; gold {glass, orchard, of, pindkest}: P = 1, R = 1/2, F1 = 2/3
    assert token_f1("The Glass Orchard", "Glass Orchard of Pindkest") == pytest.approx(2 / 3)
    assert token_f1("x", "y") == 0.0
    assert token_f1("Ada Penrose", "Augusta Penrose", ["A. Penrose"]) == pytest.approx(
        2 / 3
    )  # alias 'penrose': P=1/2, R=1
    assert token_f1(None, "y") == 0.0


def test_verify_end_to_end():
    v = verify(r"After three searches: \boxed{The Danube}", "Danube", ["Donau"])
    assert (v.extracted, v.correct, v.f1, v.reward) == ("The Danube", True, 1.0, 1.0)
    v = verify("I could not find it.", "Danube")
    assert (v.extracted, v.correct, v.reward) == (None, False, 0.0)


def test_the_box_that_opens_last_is_the_answer_even_inside_another():
    assert extract_boxed(r"\boxed{Answer: \boxed{Danube}}") == "Danube"
    assert verify(r"\boxed{Answer: \boxed{Danube}}", "Danube").reward == 1.0


def test_an_unbalanced_escaped_brace_neither_opens_nor_closes_a_box():
    assert extract_boxed(r"\boxed{\{3}") == r"\{3"
    assert extract_boxed(r"\boxed{a \} b}") == r"a \} b"


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("3.0", "3", True),  # a whole fraction of zeros goes
        ("3.05", "35", False),  # a fraction that is not all zeros stays
        (r"\text{\textbf{Paris}}", "Paris", True),  # wrappers inside wrappers
        ("12 3456", "123456", False),  # only groups of three digits are thousands
        ("1 000 000", "1000000", True),
    ],
)
def test_normalisation_keeps_apart_what_differs(a, b, same):
    assert exact_match(a, b) is same


def test_token_f1_is_the_best_over_the_answer_and_its_aliases():
    assert token_f1("Danube River", "Danube River", ["Danube"]) == 1.0
