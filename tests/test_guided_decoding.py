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
from tokenserve.engine.sampler import apply_token_masks
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
    from qwen2_tiny import qwen2_tiny_dir

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
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 70)).astype(np.float32)
    allowed = [{0, 31, 32, 69}, {5}, set(range(70))]
    masks = np.zeros((3, 3), np.uint32)
    for row, ids in enumerate(allowed):
        for t in ids:
            masks[row, t // 32] |= np.uint32(1 << (t % 32))
    masked = apply_token_masks(logits, masks.view(np.int32))
    for row, ids in enumerate(allowed):
        finite = set(np.flatnonzero(np.isfinite(masked[row])).tolist())
        assert finite == ids
        assert np.array_equal(masked[row, sorted(ids)], logits[row, sorted(ids)])


def test_a_repeated_schema_compiles_once():
    structured = StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested"]))
    grammar_text(structured)
    hits = grammar_text.cache_info().hits
    grammar_text(StructuredOutput(GuideKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested"])))
    assert grammar_text.cache_info().hits == hits + 1
