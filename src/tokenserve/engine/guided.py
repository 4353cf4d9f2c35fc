"""Structured output: token masks from JSON schemas, regexes, choices and grammars.

Built on llguidance (chosen over xgrammar and outlines-core on our tokenizers: grammars
compile in about a millisecond because the token trie is walked lazily per step, masks for a
whole batch are filled in parallel in Rust with the GIL released, Lark grammars can embed a
JSON schema, which tool calls need, and it depends on nothing but numpy).

One `GuidedDecoding` per engine holds the llguidance view of the tokenizer and one compiled
matcher per recent constraint; each constrained sequence owns a `Guide`, a copy of it (copying
takes microseconds, compiling a schema a millisecond). Every step the engine hands the logits
of its constrained rows to `GuidedDecoding.apply`, which asks llguidance for as little as
each row allows:

- when the grammar forces the next bytes (most of a JSON object's keys and punctuation), the
  mask is the first token of their canonical tokenization, so the row keeps that token alone;
- a greedy row needs only its best allowed token: when nothing is forced, its best few tokens
  are checked one by one (a fraction of a microsecond each, where a mask takes 10-30 us on
  the built-in vocabulary);
- every other row (sampled, or whose best few tokens are all ruled out) gets the full
  bitmask, filled for all such rows at once in Rust without the GIL and applied in place
  (`sampler.masks.apply_token_masks`).

Each row ends with the argmax (greedy) or the distribution (sampled) the full mask gives;
tests hold both shortcuts to the mask, token by token. Masks are computed after the step, not
during it: on a 2-core machine a worker thread filling them while TensorFlow runs slowed the
step by as much as it saved. Plain Python and NumPy: no TF.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

from tokenserve.engine.sampler.masks import apply_token_masks
from tokenserve.errors import InvalidRequestError
from tokenserve.sampling import GuideKind, StructuredOutput

if TYPE_CHECKING:
    from tokenserve.engine.sampler.draw import SequenceSampler

log = logging.getLogger(__name__)

MAX_SPEC_CHARS = 64 * 1024
"""Longest schema, regex or grammar a request may carry (bounded compile time and memory)."""
MAX_CHOICES = 1024
MAX_COMPILED = 64
"""Compiled matchers kept per engine (a repeated constraint is copied, not compiled again)."""
MAX_GREEDY_TRIES = 4
"""Best tokens of a greedy row checked before it falls back to a full mask (in
benchmarks/structured.py's JSON workload, 86% of the greedy rows with nothing forced find
their token among their best 4)."""
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
        except (ValueError, RecursionError) as error:  # int() refuses over 4,300 digits
            why = ("it is nested too deeply" if isinstance(error, RecursionError) else
                   f"it has an integer longer than the {sys.get_int_max_str_digits()} digits "
                   f"this server reads")
            raise InvalidRequestError(f"the JSON schema cannot be read: {why}") from None
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

    @property
    def is_forced(self) -> bool:
        """The grammar forces the next bytes (then the mask keeps to their canonical
        tokenization, which `allows` does not know). Under a microsecond."""
        return bool(self.matcher.compute_ff_bytes())

    def forced_token(self) -> int | None:
        """When bytes are forced: the first token of their canonical tokenization, the one
        token llguidance's mask then allows (None when no whole token is forced yet, and the
        mask has to say). Costs about what a mask does, without one to apply."""
        forced = self.matcher.compute_ff_tokens()
        return forced[0] if forced else None

    def allows(self, token_id: int) -> bool:
        """The mask's bit for `token_id` when nothing is forced (with forced bytes, this
        also allows other ways to spell them). A fraction of a microsecond."""
        return self.matcher.validate_tokens([token_id]) == 1


class GuidedDecoding:
    """The llguidance tokenizer of one engine: makes guides and applies them to logits.

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
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._compiled_lock = threading.Lock()  # make_guide runs on the callers' threads
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
        """A fresh guide for one sequence: a copy of the constraint's compiled matcher.

        Raises:
            InvalidRequestError: the constraint is invalid, for this tokenizer too.
        """
        with self._compiled_lock:
            compiled = self._compiled.get(structured)
            if compiled is not None:
                self._compiled.move_to_end(structured)
        if compiled is None:
            compiled = _llguidance().LLMatcher(self.ll_tokenizer, grammar_text(structured),
                                               log_level=0)
            if compiled.is_error():
                raise InvalidRequestError(f"invalid {_LABELS[structured.kind]}: "
                                          f"{compiled.get_error()}")
            with self._compiled_lock:
                self._compiled[structured] = compiled
                while len(self._compiled) > MAX_COMPILED:
                    self._compiled.popitem(last=False)
        return Guide(compiled.deep_copy())

    def mask(self, logits: np.ndarray, samplers: list[SequenceSampler]) -> np.ndarray:
        """`logits` (float [S, vocab], a row per sampler: the caller's copy, masked in place)
        with each row's structured-output constraint applied."""
        rows = [i for i, sampler in enumerate(samplers) if sampler.guide is not None]
        if rows:
            guided = [samplers[i] for i in rows]
            self.apply(logits, rows, [s.guide for s in guided], [s.is_greedy for s in guided])
        return logits

    def apply(self, logits: np.ndarray, rows: list[int], guides: list[Guide],
              greedy: list[bool]) -> None:
        """Rules out, in place, what each guide forbids in its row of `logits`.

        Args:
            logits: float [S, vocab], modified in place.
            rows: the constrained rows.
            guides: each row's guide.
            greedy: whether each row takes its argmax (then only the argmax has to be right:
                the row may keep tokens the guide forbids below its best allowed one).
        """
        full_rows, full_guides = [], []
        for row, guide, is_greedy in zip(rows, guides, greedy):
            if guide.is_forced:
                token = guide.forced_token()
                if token is not None:  # the mask is this one token
                    kept = logits[row, token]
                    logits[row] = -np.inf
                    logits[row, token] = kept
                    continue
            elif is_greedy and _restrict_greedy(logits[row], guide):
                continue
            full_rows.append(row)
            full_guides.append(guide)
        if full_rows:
            apply_token_masks(logits, full_rows, self.fill_masks(full_guides))

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


def _restrict_greedy(row: np.ndarray, guide: Guide) -> bool:
    """Makes the argmax of `row` (float [vocab]) its best allowed token by setting the better
    tokens the guide forbids to -inf; False when the best few are all forbidden."""
    for _ in range(MAX_GREEDY_TRIES):
        token = int(np.argmax(row))
        if guide.allows(token):
            return True
        row[token] = -np.inf
    return False


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
