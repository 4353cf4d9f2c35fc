"""Converts a tokenserve model to a .tflite file with `prefill`, `decode` and `score`
signatures, optionally quantized, and writes it in TF Serving's versioned layout.

Quantization modes (`TFLiteOptions.quantize`):
  none          float32 weights and activations
  float16       float16 weights, dequantized to float32 when the interpreter loads them
  dynamic-int8  int8 weights (one scale per output channel, the token embedding per row);
                activations quantized per call
  int8          int8 weights and int8 activations for every FULLY_CONNECTED (ranges from a
                representative dataset, by default windows of the built-in model's training
                split); the other ops and the KV cache stay float32 (INT8_OPS)
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tokenserve.config import TrainConfig
from tokenserve.errors import ConfigError

QUANTIZE_MODES = ("none", "float16", "dynamic-int8", "int8")
TFLITE_FILE = "model.tflite"          # what lifecycle's --prefer_tflite_model looks for
TFLITE_INFO_FILE = "tflite.json"      # assets/: how the file was made, read by the runner


class UnsupportedOpsError(ConfigError):
    """The graph needs TensorFlow ops that are not TFLite builtins."""

    def __init__(self, ops: list[str]):
        self.ops = ops
        super().__init__(
            f"the model needs ops outside the TFLite builtins: {', '.join(ops)}; they would run "
            f"through Select TF ops (Flex), which LiteRT on a device lacks unless linked in. "
            f"Pass --allow_flex to keep them anyway")


@dataclass(frozen=True)
class TFLiteOptions:
    """How `export_tflite` converts."""

    quantize: str = "none"
    """One of QUANTIZE_MODES."""
    state_mode: str = "io"
    """Transformer KV cache as explicit signature IO (`io`) or a TFLite resource variable
    (`variable`); docs/optimize.md has the measurements behind the default."""
    allow_flex: bool = False
    """Keep ops outside the TFLite builtins as Select TF ops instead of refusing them."""
    calibration: str | None = None
    """A UTF-8 text file for int8 calibration; None uses the built-in training split."""
    num_calibration_samples: int = 32
    """Prefill windows run for int8 calibration (each followed by a few decode steps)."""
    calibration_length: int = 64
    """Tokens per calibration prefill window."""

    def __post_init__(self) -> None:
        if self.quantize not in QUANTIZE_MODES:
            raise ConfigError(f"unknown quantization {self.quantize!r}; use one of "
                              f"{', '.join(QUANTIZE_MODES)}")
        if self.state_mode not in ("io", "variable"):
            raise ConfigError(f"state_mode must be io or variable, got {self.state_mode!r}")
        if self.num_calibration_samples < 1 or self.calibration_length < 2:
            raise ConfigError("calibration needs at least 1 sample of at least 2 tokens")


def flex_ops(tflite_model: bytes) -> list[str]:
    """Names of the Select TF ops (custom ops `Flex<Name>`) a converted model holds."""
    from tensorflow.lite.python import schema_py_generated as schema

    root = schema.Model.GetRootAs(tflite_model, 0)
    names = set()
    for index in range(root.OperatorCodesLength()):
        custom = root.OperatorCodes(index).CustomCode()
        if custom and custom.decode().startswith("Flex"):
            names.add(custom.decode()[len("Flex"):])
    return sorted(names)


def calibration_stream(tokenizer, path: str | None) -> np.ndarray:
    """Token ids to calibrate on: the file at `path`, or the built-in training split."""
    from tokenserve.train.corpus import Corpus, token_stream

    if path:
        try:
            texts = [Path(path).read_text(encoding="utf-8")]
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError(f"cannot read calibration file {path}: {error}") from error
    else:  # the built-in models' training split, as `tokenserve train` made it
        texts = Corpus.from_stdlib(TrainConfig().holdout_fraction).train_texts
    stream = token_stream([t for t in texts if t.strip()], tokenizer)
    if len(stream) < 4:
        raise ConfigError(f"calibration data {path or 'builtin'} holds too few tokens")
    return stream


def representative_dataset(module, stream: np.ndarray, options: TFLiteOptions,
                           decode_steps: int = 4):
    """A converter representative dataset: per sample, one prefill and a few decode steps
    fed the caches the float module itself fills (so cache ranges are realistic), and a
    `score` pass."""
    import tensorflow as tf

    from tokenserve.edge.cache import cache_names, write_entries

    signatures = module.signatures()
    length = max(2, min(options.calibration_length, module.cache_len - decode_steps,
                        len(stream) - decode_steps - 1))
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(stream) - length - decode_steps, options.num_calibration_samples)
    names = {kind: {spec.name for spec in function.structured_input_signature[0]}
             for kind, function in signatures.items()}
    with_caches = "k_cache_0" in names["decode"]  # io-mode Transformer
    with_state = "state" in names["decode"]       # LSTM

    def samples() -> Iterator:
        for start in starts:
            window = stream[start:start + length + decode_steps].astype(np.int32)
            state = np.zeros(module.state_shape(), np.float32)
            caches = [np.zeros(module.layer_cache_shape(), np.float32)
                      for _ in cache_names(module.config.num_layers)] if with_caches else []
            feed = {"token_ids": window[None, :length], "positions": np.zeros([1], np.int32)}
            position = 0
            for step in range(decode_steps + 1):
                if with_state:
                    feed["state"] = state
                feed.update(zip(cache_names(module.config.num_layers), caches))
                kind = "prefill" if step == 0 else "decode"
                feed = {k: v for k, v in feed.items() if k in names[kind]}
                yield kind, dict(feed)
                out = signatures[kind](**{k: tf.constant(v) for k, v in feed.items()})
                if with_state:
                    state = out["state"].numpy()
                if with_caches:
                    write_entries(caches, out["kv"].numpy(), position)
                position = length + step
                feed = {"token_ids": window[None, position:position + 1],
                        "positions": np.array([position], np.int32)}
            yield "score", {"token_ids": window[None, :length]}

    return samples


def convert(module, options: TFLiteOptions, tokenizer=None, progress: bool = False) -> bytes:
    """The .tflite bytes of an `edge.graph` module, quantized as `options` say.

    Raises UnsupportedOpsError naming every op outside the builtins, unless allow_flex.
    """
    import tensorflow as tf

    signatures = module.signatures()
    with tempfile.TemporaryDirectory(prefix="tokenserve-tflite-") as scratch:
        tf.saved_model.save(module, scratch, signatures=signatures)
        converter = tf.lite.TFLiteConverter.from_saved_model(
            scratch, signature_keys=list(signatures))
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS,
                                               tf.lite.OpsSet.SELECT_TF_OPS]
        converter.experimental_enable_resource_variables = module.state_mode == "variable"
        if options.quantize != "none":
            converter.optimizations = [tf.lite.Optimize.DEFAULT]
        if options.quantize == "float16":
            converter.target_spec.supported_types = [tf.float16]
        elif options.quantize == "int8":
            if tokenizer is None:
                raise ConfigError("int8 calibration needs the model's tokenizer")
            stream = calibration_stream(tokenizer, options.calibration)
            samples = representative_dataset(module, stream, options)
            if progress:
                from tqdm import tqdm

                total = options.num_calibration_samples * 6
                source = samples
                samples = lambda: tqdm(source(), total=total, desc="calibrate",  # noqa: E731
                                       unit="call", leave=False, dynamic_ncols=True)
            converter.representative_dataset = samples
            # Calibrate only, then quantize selectively (what TFLite's QuantizationDebugger
            # does with a denylist): see selective_int8.
            converter.experimental_mlir_quantizer = True
            converter._experimental_calibrate_only = True  # noqa: SLF001
        tflite_model = converter.convert()
        if options.quantize == "int8":
            tflite_model = selective_int8(tflite_model)
    found = flex_ops(tflite_model)
    if found and not options.allow_flex:
        raise UnsupportedOpsError(found)
    return tflite_model


INT8_OPS = ("FULLY_CONNECTED",)
"""Ops the int8 mode quantizes (int8 activations, calibrated; int8 weights per channel).
Every other op keeps float32 activations: with the residual stream, norms, RoPE, softmax and
the SwiGLU product in int8 too, the built-in model lost 171 % perplexity, and no single op
type kept in float brought that under 166 % (docs/optimize.md)."""


def opcode_names(root) -> list[str]:
    """The builtin op name of each entry of a parsed .tflite model's (`schema.Model`)
    operator-code table, in table order: what an operator's OpcodeIndex() points at."""
    from tensorflow.lite.python import schema_py_generated as schema

    names = {code: name for name, code in vars(schema.BuiltinOperator).items()
             if not name.startswith("_")}
    return [names[max(code.BuiltinCode(), code.DeprecatedBuiltinCode())]
            for code in map(root.OperatorCodes, range(root.OperatorCodesLength()))]


def op_names(tflite_model: bytes) -> list[str]:
    """The builtin op names (`FULLY_CONNECTED`, ...) a .tflite model uses."""
    from tensorflow.lite.python import schema_py_generated as schema

    return sorted(set(opcode_names(schema.Model.GetRootAs(tflite_model, 0))))


def selective_int8(calibrated: bytes) -> bytes:
    """Quantizes a calibrated float model: INT8_OPS in int8, every other op denylisted (kept
    float32), then identical read-only buffers merged (the converter's last pass)."""
    from tensorflow.lite.python.convert import deduplicate_readonly_buffers, mlir_quantize

    denylist = [name for name in op_names(calibrated)
                if name not in INT8_OPS and name != "CUSTOM"]
    return deduplicate_readonly_buffers(mlir_quantize(calibrated, denylisted_ops=denylist))


def export_tflite(model, tokenizer, config, base_path: str | Path,
                  options: TFLiteOptions = TFLiteOptions(), version: int | None = None,
                  progress: bool = False) -> Path:
    """Writes BASE_PATH/<version>/{model.tflite, assets/} and returns the version dir.

    assets/ holds tokenizer.json and generation_config.json as a SavedModel export's do, and
    tflite.json (quantization, state mode, cache length, signatures).
    """
    from tokenserve.edge.graph import edge_module
    from tokenserve.export.exporter import GENERATION_CONFIG_FILE, TOKENIZER_FILE, staged_version

    if getattr(config.model, "num_experts", 0):
        raise ConfigError("TFLite export of a mixture of experts is not supported")
    module = edge_module(model, state_mode=options.state_mode,
                         int8_embedding=options.quantize in ("int8", "dynamic-int8"))
    tflite_model = convert(module, options, tokenizer, progress)
    with staged_version(base_path, version) as (staging, final):
        (staging / "assets").mkdir(parents=True)
        (staging / TFLITE_FILE).write_bytes(tflite_model)
        tokenizer.save(staging / "assets" / TOKENIZER_FILE)
        (staging / "assets" / GENERATION_CONFIG_FILE).write_text(
            json.dumps(config.to_dict(), indent=2) + "\n")
        info = dict(asdict(options), state_mode=module.state_mode, cache_len=module.cache_len,
                    state_shape=module.state_shape(), signatures=["prefill", "decode", "score"],
                    flex_ops=flex_ops(tflite_model))
        (staging / "assets" / TFLITE_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return final
