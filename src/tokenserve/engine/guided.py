"""Structured output: token masks from JSON schemas, regexes, choices and grammars.

Built on llguidance (chosen over xgrammar and outlines-core on our tokenizers: grammars
compile in about a millisecond because the token trie is walked lazily per step, masks for a
whole batch are filled in parallel in Rust with the GIL released, Lark grammars can embed a
JSON schema, which tool calls need, and it depends on nothing but numpy).

One `GuidedDecoding` per engine holds the llguidance view of the tokenizer. Each constrained
sequence owns a `Guide` (an `LLMatcher`). Every step the engine asks for the masks of the
sequences that will sample, on a worker thread while the model step runs, and applies them to
the logits (`sampler.apply_token_masks`) before sampling. Plain Python and NumPy: no TF.
"""

from __future__ import annotations

import functools
import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from tokenserve.errors import InvalidRequestError
from tokenserve.sampling import GuideKind, StructuredOutput

log = logging.getLogger(__name__)

MAX_SPEC_CHARS = 64 * 1024
"""Longest schema, regex or grammar a request may carry (bounded compile time and memory)."""
MAX_CHOICES = 1024
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "coerce_one_of": True}
"""Compact JSON, as `json.dumps` writes it: free whitespace lets a weak model pad forever;
oneOf is treated as anyOf (pydantic writes oneOf where any match is fine)."""
_LABELS = {GuideKind.JSON_SCHEMA: "JSON schema", GuideKind.REGEX: "regex",
           GuideKind.CHOICE: "choice", GuideKind.GRAMMAR: "grammar"}


def _llguidance():
    import llguidance  # a runtime dependency, imported on first use (a Rust extension)

    return llguidance


def _lark_string(text: str) -> str:
    """A Lark string literal for `text` (JSON escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _gbnf_to_lark(grammar: str) -> str:
    from llguidance.gbnf_to_lark import gbnf_to_lark

    return gbnf_to_lark(grammar)


@functools.lru_cache(maxsize=512)
def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar of a constraint, checked (cached: a repeated schema costs a
    dictionary lookup).

    Raises:
        InvalidRequestError: the schema, regex or grammar is malformed or unsupported; the
            message says what is wrong.
    """
    llg = _llguidance()
    kind, spec = structured.kind, structured.spec
    size = sum(len(s) for s in spec) if kind is GuideKind.CHOICE else len(spec)
    if size > MAX_SPEC_CHARS:
        raise InvalidRequestError(f"the {_LABELS[kind]} is too long ({size} characters; "
                                  f"at most {MAX_SPEC_CHARS})")
    if kind is GuideKind.JSON_SCHEMA:
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as error:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError("the JSON schema must be an object (or true/false), "
                                      f"not {type(schema).__name__}")
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
        except ValueError as error:
            raise InvalidRequestError(f"invalid JSON schema: {error}") from None
    elif kind is GuideKind.REGEX:
        grammar = llg.LLMatcher.grammar_from_regex(spec)
    elif kind is GuideKind.CHOICE:
        if not spec or len(spec) > MAX_CHOICES:
            raise InvalidRequestError(f"a choice needs between 1 and {MAX_CHOICES} strings, "
                                      f"got {len(spec)}")
        if any(not isinstance(c, str) or not c for c in spec):
            raise InvalidRequestError("every choice must be a non-empty string")
        grammar = llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(_lark_string(c) for c in spec))
    else:
        lark = _gbnf_to_lark(spec) if "::=" in spec else spec
        grammar = llg.LLMatcher.grammar_from_lark(lark)
    error = llg.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise InvalidRequestError(f"invalid {_LABELS[kind]}: {error.strip()}")
    return grammar


class Guide:
    """The constraint state of one sequence: which tokens may come next."""

    def __init__(self, matcher):
        self.matcher = matcher

    def consume(self, token_id: int) -> bool:
        """Advances past a sampled token; False if the constraint did not allow it."""
        return self.matcher.consume_token(token_id)

    @property
    def is_done(self) -> bool:
        """The constraint is complete (nothing but end of sequence may follow) or broken."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None


class GuidedDecoding:
    """The llguidance tokenizer of one engine, making guides and filling batch masks.

    Args:
        tokenizer: tokenserve's Tokenizer (its `hf` is a `tokenizers.Tokenizer`).
        vocab_size: the model's logit width (may exceed the tokenizer's; the extra ids are
            never allowed).
        eos_token_id: the model's end-of-sequence token.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int):
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self._ll_tokenizer = None
        self._executor = None
        self._pool: ThreadPoolExecutor | None = None
        self.num_words = (vocab_size + 31) // 32

    @property
    def ll_tokenizer(self):
        """Built on first use (milliseconds for the built-in vocabulary, ~0.3 s for 49k)."""
        if self._ll_tokenizer is None:
            llg = _llguidance()
            self._ll_tokenizer = llg.LLTokenizer(self.tokenizer.hf.to_str(),
                                                 n_vocab=self.vocab_size,
                                                 eos_token=self.eos_token_id)
            self._executor = llg.LLExecutor()
        return self._ll_tokenizer

    def make_guide(self, structured: StructuredOutput) -> Guide:
        """A fresh guide for one sequence.

        Raises:
            InvalidRequestError: the constraint is invalid, for this tokenizer too.
        """
        matcher = _llguidance().LLMatcher(self.ll_tokenizer, grammar_text(structured),
                                          log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {_LABELS[structured.kind]}: "
                                      f"{matcher.get_error()}")
        return Guide(matcher)

    def fill_masks(self, guides: list[Guide]) -> np.ndarray:
        """int32 [len(guides), ceil(vocab / 32)]: bit t of row i set when guide i allows
        token t. Runs in Rust threads without the GIL."""
        masks = np.zeros((len(guides), self.num_words), np.int32)
        live = [(g.matcher, i) for i, g in enumerate(guides) if not g.matcher.is_error()]
        if live:
            self.ll_tokenizer  # noqa: B018 - makes the executor
            self._executor.unsafe_compute_mask_ptr(live, masks.ctypes.data,
                                                   self.num_words * 4, len(guides))
        empty = ~masks.any(axis=1)
        if empty.any():  # a broken constraint: let the sequence end
            masks.view(np.uint32)[empty, self.eos_token_id // 32] |= np.uint32(
                1 << (self.eos_token_id % 32))
        return masks

    def start_masks(self, guides: list[Guide]) -> Future:
        """`fill_masks` on a worker thread, so it overlaps the model step."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenserve-guided")
        return self._pool.submit(self.fill_masks, guides)


def check_structured(structured: StructuredOutput | None, param: str | None = None) -> None:
    """Refuses an invalid constraint before it reaches an engine (no tokenizer needed).

    Raises:
        InvalidRequestError: with `param` set to the request field, when given.
    """
    if structured is None:
        return
    try:
        grammar_text(structured)
    except InvalidRequestError as error:
        error.param, error.code = param, "invalid_structured_output"
        raise
