"""Constrained decoding in the engine: every constrained output parses and validates, with the
built-in model and with a tiny imported Qwen2-style model (random weights), and bad
constraints are refused before they take a slot."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from tokenserve.engine.guided import grammar_text
from tokenserve.engine.sampler.masks import apply_token_masks
from tokenserve.errors import InvalidRequestError
from tokenserve.sampling import GuideKind, SamplingParams, StructuredOutput

SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False,
               "required": ["name", "address"],
               "properties": {"name": {"type": "string", "maxLength": 8},
                              "address": {"type": "object", "additionalProperties": False,
                                          "required": ["city", "zip"],
                                          "properties": {"city": {"type": "string",
                                                                  "maxLength": 8},
                                                         "zip": {"type": "integer",
                                                                 "minimum": 10000,
                                                                 "maximum": 99999}}}}},
    "enum_array": {"type": "object", "additionalProperties": False,
                   "required": ["color", "sizes"],
                   "properties": {"color": {"enum": ["red", "green", "blue"]},
                                  "sizes": {"type": "array", "minItems": 1, "maxItems": 4,
                                            "items": {"enum": ["S", "M", "L"]}}}},
    "bounded_numbers": {"type": "object", "additionalProperties": False,
                        "required": ["age", "ratio"],
                        "properties": {"age": {"type": "integer", "minimum": 0,
                                               "maximum": 120},
                                       # multipleOf bounds the fraction's digits
                                       "ratio": {"type": "number", "minimum": 0,
                                                 "maximum": 1, "multipleOf": 0.01}}},
}
PROMPTS = [f"# record {i}\n{word} = " for i, word in enumerate(
    ["user", "item", "config", "point", "row", "entry", "data", "obj", "node", "cell",
     "spec", "value", "result", "info", "thing", "answer", "payload", "body", "doc", "out"])]


@pytest.fixture(scope="module")
def builtin_llm():
    from tokenserve.engine.llm import LLM
    from tokenserve.export.cached_exports import builtin_export

    return LLM(builtin_export(), max_num_seqs=20)


@pytest.fixture(scope="module")
def qwen2_llm(tmp_path_factory):
    pytest.importorskip("torch")
    from support.qwen2_tiny import qwen2_tiny_dir

    from tokenserve.engine.llm import LLM

    return LLM(qwen2_tiny_dir(tmp_path_factory), max_num_seqs=20)


def constrained(structured: StructuredOutput, i: int, max_tokens: int) -> SamplingParams:
    """Half greedy, half sampled at temperature 1 (seeded), so outputs vary."""
    return SamplingParams(max_tokens=max_tokens, structured=structured,
                          temperature=0.0 if i % 2 else 1.0, seed=i)


@pytest.mark.parametrize("model", ["builtin_llm", "qwen2_llm"])
@pytest.mark.parametrize("schema_name", list(SCHEMAS))
def test_every_output_validates_against_its_schema(request, model, schema_name):
    llm = request.getfixturevalue(model)
    schema = SCHEMAS[schema_name]
    structured = StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps(schema))
    outputs = llm.generate(PROMPTS, [constrained(structured, i, 100) for i in range(20)],
                           use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason.value == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize("model", ["builtin_llm", "qwen2_llm"])
def test_regex_choice_and_grammar_hold(request, model):
    llm = request.getfixturevalue(model)
    regex = StructuredOutput(GuideKind.REGEX, r"[A-Z][a-z]{1,5}-[0-9]{2}")  # \d is Unicode
    choice = StructuredOutput(GuideKind.CHOICE, ("alpha", "beta", "gamma delta"))
    gbnf = StructuredOutput(GuideKind.GRAMMAR, 'root ::= "f(" arg ("," arg)* ")"\n'
                                               'arg ::= [a-z] | [0-9]')
    params = ([constrained(regex, i, 30) for i in range(6)]
              + [constrained(choice, i, 30) for i in range(6)]
              + [constrained(gbnf, i, 40) for i in range(6)])
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS[:18], params, use_tqdm=False)]
    assert all(re.fullmatch(r"[A-Z][a-z]{1,5}-[0-9]{2}", t) for t in texts[:6]), texts[:6]
    assert all(t in choice.spec for t in texts[6:12]), texts[6:12]
    assert all(re.fullmatch(r"f\([a-z0-9](,[a-z0-9])*\)", t) for t in texts[12:]), texts[12:]


def test_constrained_and_free_requests_share_a_batch(builtin_llm):
    """A free request next to constrained ones gives the same tokens as alone."""
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = builtin_llm.generate(["def main():"], free, use_tqdm=False)[0]
    choice = StructuredOutput(GuideKind.CHOICE, ("yes", "no"))
    mixed = builtin_llm.generate(["def main():", "x = "],
                                 [free, SamplingParams(max_tokens=5, structured=choice)],
                                 use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert mixed[1].outputs[0].text in ("yes", "no")


@pytest.mark.parametrize("kind,spec,words", [
    (GuideKind.JSON_SCHEMA, '{"type": "strin"}', "Invalid type"),
    (GuideKind.JSON_SCHEMA, "{", "not valid JSON"),
    (GuideKind.JSON_SCHEMA, "[]", "must be an object"),
    (GuideKind.REGEX, "a{2,1}", "invalid regex"),
    (GuideKind.CHOICE, (), "choice"),
    (GuideKind.GRAMMAR, "start: missing", "unknown name"),
])
def test_invalid_constraint_is_refused_before_it_takes_a_slot(builtin_llm, kind, spec, words):
    engine = builtin_llm.engine
    params = SamplingParams(max_tokens=4, structured=StructuredOutput(kind, spec))
    with pytest.raises(InvalidRequestError, match=words):
        engine.make_request([5, 6, 7], params)
    assert not engine.has_work


def test_masks_rule_out_every_other_token():
    """In place, on the given rows only; sparse (token by token) and dense rows alike."""
    rng = np.random.default_rng(0)
    vocab = 600
    logits = rng.normal(size=(4, vocab)).astype(np.float32)
    before = logits.copy()
    allowed = {0: {0, 31, 32, 599}, 2: {5}, 3: set(range(vocab)) - {7, 300}}  # 3 is dense
    masks = np.zeros((3, (vocab + 31) // 32), np.uint32)
    for mask, ids in zip(masks, allowed.values()):
        for t in ids:
            mask[t // 32] |= np.uint32(1 << (t % 32))
    apply_token_masks(logits, list(allowed), masks.view(np.int32))
    for row, ids in allowed.items():
        finite = set(np.flatnonzero(np.isfinite(logits[row])).tolist())
        assert finite == ids
        assert np.array_equal(logits[row, sorted(ids)], before[row, sorted(ids)])
    assert np.array_equal(logits[1], before[1])  # not a masked row


def _walks(llm, structured: StructuredOutput, num: int, max_tokens: int) -> list[list[int]]:
    """Token ids the model writes under `structured`, greedy and sampled."""
    outputs = llm.generate(PROMPTS[:num], [constrained(structured, i, max_tokens)
                                           for i in range(num)], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


SHORTCUT_CASES = [
    StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested"])),
    StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps(SCHEMAS["enum_array"])),
    StructuredOutput(GuideKind.REGEX, r"[a-z_]+( [a-z_]+)*"),
    StructuredOutput(GuideKind.CHOICE, ("alpha", "beta", "gamma delta")),
]


@pytest.mark.parametrize("model", ["builtin_llm", "qwen2_llm"])
@pytest.mark.parametrize("structured", SHORTCUT_CASES, ids=lambda s: s.kind.value)
def test_shortcuts_agree_with_the_mask(request, model, structured):
    """Where GuidedDecoding.apply decides without a mask, the mask agrees: with forced bytes
    it allows `forced_token()` alone (when there is one); with nothing forced, `allows` is the
    mask, token by token."""
    llm = request.getfixturevalue(model)
    guided = llm.engine.guided
    vocab = guided.vocab_size
    num_forced = num_free = 0
    for walk in _walks(llm, structured, 4, 40):
        guide = guided.make_guide(structured)
        for token in walk:
            if guide.is_done:
                break
            bits = np.unpackbits(guided.fill_masks([guide])[0].view(np.uint8), count=vocab,
                                 bitorder="little").astype(bool)
            allows = np.array([guide.allows(t) for t in range(vocab)])
            if guide.is_forced:
                forced = guide.forced_token()
                num_forced += forced is not None
                if forced is not None:
                    assert np.flatnonzero(bits).tolist() == [forced]
                assert not (bits & ~allows).any()  # the mask keeps to one spelling
            else:
                num_free += 1
                assert np.array_equal(allows, bits), np.flatnonzero(allows != bits)[:8]
            assert guide.consume(token)
    assert num_free > 0
    if structured.kind is GuideKind.JSON_SCHEMA:
        assert num_forced > 0


@pytest.mark.parametrize("structured", SHORTCUT_CASES, ids=lambda s: s.kind.value)
def test_apply_gives_what_the_full_mask_gives(builtin_llm, structured):
    """Greedy rows end with the argmax of the fully masked row (even when the model's best
    tokens are all ruled out); sampled rows end fully masked."""
    guided = builtin_llm.engine.guided
    rng = np.random.default_rng(1)
    for walk in _walks(builtin_llm, structured, 2, 30):
        guides = [guided.make_guide(structured) for _ in range(4)]
        for token in walk:
            if guides[0].is_done:
                break
            logits = rng.normal(size=(5, guided.vocab_size)).astype(np.float32)
            logits[1] = logits[0]
            # rows 2 and 3: the model's favourites are what the constraint forbids
            masks = guided.fill_masks(guides[:1])
            banned = np.unpackbits(masks[0].view(np.uint8), count=guided.vocab_size,
                                   bitorder="little") == 0
            logits[2:4, banned] += 50.0
            full = logits.copy()
            apply_token_masks(full, [0, 1, 2, 3], np.repeat(masks, 4, axis=0))
            out = logits.copy()
            guided.apply(out, [0, 1, 2, 3], guides, [True, False, True, False])
            assert np.array_equal(out.argmax(axis=1)[:4], full.argmax(axis=1)[:4])
            assert np.array_equal(out[[1, 3]], full[[1, 3]])  # sampled rows: the full mask
            assert np.array_equal(out[4], logits[4])           # not a constrained row
            for guide in guides:
                assert guide.consume(token)


def test_guides_of_one_constraint_are_independent(builtin_llm):
    """Guides are copies of one compiled matcher: advancing one leaves the others (and the
    next new one) at the start."""
    guided = builtin_llm.engine.guided
    structured = StructuredOutput(GuideKind.CHOICE, ("yes", "no"))
    first, second = guided.make_guide(structured), guided.make_guide(structured)
    start = guided.fill_masks([second])
    assert first.consume(builtin_llm.engine.tokenizer.encode("yes")[0])
    assert not np.array_equal(guided.fill_masks([first]), start)
    assert np.array_equal(guided.fill_masks([second]), start)
    assert np.array_equal(guided.fill_masks([guided.make_guide(structured)]), start)


def test_a_repeated_schema_compiles_once():
    structured = StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested"]))
    grammar_text(structured)
    hits = grammar_text.cache_info().hits
    grammar_text(StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested"])))
    assert grammar_text.cache_info().hits == hits + 1
