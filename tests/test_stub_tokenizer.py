"""The stub tokenizer takes any text UTF-8 can encode and decodes back exactly what it encoded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tickloom.engine.model.stub import StubTokenizer


@pytest.mark.parametrize("text", [
    "line one\nline two", "col\tcol\r\n", "caf\u00e9", "emoji \U0001F600 and \u4e16\u754c", "\x00\x7f", "",
    "back\\slash ~ and EOS-looking 0a",
])
def test_any_text_round_trips(text: str) -> None:
    tokenizer = StubTokenizer()
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text


def test_printable_ascii_keeps_one_token_per_character() -> None:
    """What the golden logs and the engine tests were written against."""
    tokenizer = StubTokenizer()
    assert tokenizer.encode(" A~") == [0, 33, 94]
    assert tokenizer.decode([0, 33, 94]) == " A~"


def test_a_newline_is_eos_and_two_hex_digits() -> None:
    tokenizer = StubTokenizer()
    assert tokenizer.encode("\n") == [95, ord("0") - 32, ord("a") - 32]
    assert tokenizer.encode("\t", add_special_tokens=False) == [95, ord("0") - 32, ord("9") - 32]


def test_a_plain_eos_still_decodes_as_before() -> None:
    tokenizer = StubTokenizer()
    assert tokenizer.decode([33, 95]) == "A"
    assert tokenizer.decode([33, 95], skip_special_tokens=False) == "A</s>"
    assert tokenizer.decode([95, 33, 34]) == "AB"  # EOS not followed by two hex digits


def test_a_larger_vocabulary_escapes_with_its_own_eos() -> None:
    tokenizer = StubTokenizer(vocab_size=1000)
    ids = tokenizer.encode("a\nb")
    assert 999 in ids and tokenizer.decode(ids) == "a\nb"


def test_text_utf8_cannot_encode_is_refused() -> None:
    with pytest.raises(ValueError, match="UTF-8"):
        StubTokenizer().encode("lone \ud800 surrogate")


@given(st.text(alphabet=st.characters(exclude_categories=["Cs"])))
def test_round_trip_of_any_text(text: str) -> None:
    tokenizer = StubTokenizer()
    assert tokenizer.decode(tokenizer.encode(text)) == text
