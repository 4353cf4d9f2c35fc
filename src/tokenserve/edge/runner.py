"""Runs an exported .tflite language model through LiteRT (`ai-edge-litert`), as a phone
would: XNNPACK on, one prefill, then one decode call per token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tokenserve.config import GenerationConfig
from tokenserve.edge.cache import cache_names, write_entries
from tokenserve.edge.convert import TFLITE_FILE, TFLITE_INFO_FILE
from tokenserve.errors import ModelLoadError, ModelNotFoundError, PromptTooLongError
from tokenserve.host.cpu_quota import usable_cpus
from tokenserve.sampling import SamplingParams
from tokenserve.tools.token_stream import sample_tokens


def is_tflite_path(path) -> bool:
    """True for a .tflite file, or a version dir / base path whose newest version holds one
    and no SavedModel."""
    path = Path(str(path))
    if path.suffix == ".tflite":
        return True
    try:
        version_dir = resolve_tflite_dir(path)
    except ModelNotFoundError:
        return False
    return not (version_dir / "saved_model.pb").exists()


def resolve_tflite_dir(path) -> Path:
    """The version dir of a .tflite file, a version dir, or a base path (newest version)."""
    from tokenserve.export.exporter import version_dirs

    path = Path(path)
    if path.suffix == ".tflite":
        if not path.is_file():
            raise ModelNotFoundError(f"{path} does not exist")
        return path.parent
    if (path / TFLITE_FILE).is_file():
        return path
    versions = version_dirs(path)
    if versions and (path / str(versions[-1]) / TFLITE_FILE).is_file():
        return path / str(versions[-1])
    raise ModelNotFoundError(f"{path} holds no {TFLITE_FILE}")


def default_num_threads() -> int:
    """The cores this process may run on (fewer under a CPU quota), at most 4 (a cap for big
    hosts, where one batch-1 sequence cannot keep more threads busy; measured only on 2
    cores)."""
    return max(1, min(4, usable_cpus()))


class LiteRTModel:
    """A tokenserve .tflite export in a LiteRT interpreter.

    `config` is the model config (as a Keras model's), `generation_config` the export's.
    """

    def __init__(self, path, num_threads: int | None = None):
        """`num_threads` None: every core this process may run on, at most 4 (XNNPACK splits
        each matmul across them, as TensorFlow's intra-op pool does for a SavedModel)."""
        from ai_edge_litert.interpreter import Interpreter, OpResolverType
        from tokenizers import Tokenizer as HFTokenizer

        from tokenserve.export.exporter import GENERATION_CONFIG_FILE, TOKENIZER_FILE
        from tokenserve.model.tokenizer import Tokenizer

        self.path = resolve_tflite_dir(path)
        file = Path(path) if Path(str(path)).suffix == ".tflite" else self.path / TFLITE_FILE
        assets = self.path / "assets"
        try:
            self.generation_config = GenerationConfig.from_dict(
                json.loads((assets / GENERATION_CONFIG_FILE).read_text()))
            self.info = json.loads((assets / TFLITE_INFO_FILE).read_text())
            self.tokenizer = Tokenizer(
                HFTokenizer.from_file(str(assets / TOKENIZER_FILE)),
                bos_token_id=self.generation_config.bos_token_id,
                eos_token_id=self.generation_config.eos_token_id,
                pad_token_id=self.generation_config.pad_token_id)
            self.interpreter = Interpreter(
                model_path=str(file), num_threads=num_threads or default_num_threads(),
                experimental_op_resolver_type=OpResolverType.BUILTIN)  # XNNPACK delegate on
            self._runners = {key: self.interpreter.get_signature_runner(key)
                             for key in ("prefill", "decode", "score")}
        except Exception as error:
            raise ModelLoadError(f"cannot load {file} as a tokenserve TFLite model: "
                                 f"{type(error).__name__}: {error}") from error
        self.config = self.generation_config.model
        self.file = file
        self.compute_dtype = f"tflite-{self.info.get('quantize', 'none')}"
        decode_inputs = self._runners["decode"].get_input_details()
        self.stateful_io = "state" in decode_inputs  # an LSTM's (h, c), in and out per call
        self.cache_io = "k_cache_0" in decode_inputs  # a KV cache fed to decode in place
        self.cache_len = int(self.info["cache_len"])
        self.state_shape = list(self.info["state_shape"])
        if self.cache_io:
            self._decode = _InPlaceDecode(self.interpreter, self._runners["decode"],
                                          self.config.num_layers)

    @property
    def max_seq_len(self) -> int:
        return self.cache_len

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens + max_tokens > self.cache_len:
            raise PromptTooLongError(
                f"prompt of {num_prompt_tokens} tokens plus max_tokens {max_tokens} exceeds "
                f"the model's context length of {self.cache_len} tokens")

    def _call(self, kind: str, token_ids, position: int, state):
        feed = {"token_ids": np.asarray(token_ids, np.int32).reshape(1, -1)}
        inputs = self._runners[kind].get_input_details()
        if "positions" in inputs:
            feed["positions"] = np.array([position], np.int32)
        if state is not None:
            feed["state"] = state
        out = self._runners[kind](**feed)
        return out["logits"][0], out.get("state")

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[int]:
        """Yields generated token ids one at a time (prefill once, then decode per token)."""
        prompt_ids = list(prompt_ids) or [self.generation_config.bos_token_id]
        self.check_fits(len(prompt_ids), params.max_tokens)
        if self.cache_io:
            logits = self._decode.prefill(self._runners["prefill"], prompt_ids)
            decode = self._decode
        else:
            state = np.zeros(self.state_shape, np.float32) if self.stateful_io else None
            logits, state = self._call("prefill", prompt_ids, 0, state)

            def decode(token: int, position: int) -> np.ndarray:
                nonlocal state
                logits, state = self._call("decode", [token], position, state)
                return logits

        yield from sample_tokens(logits, decode, params, prompt_ids,
                                 self.generation_config.model.vocab_size,
                                 self.generation_config.eos_token_id)

    def logits(self, token_ids) -> np.ndarray:
        """float32 [T, V] next-token logits at every position of one causal pass."""
        return self._runners["score"](token_ids=np.asarray(token_ids, np.int32)[None])[
            "logits"][0]

    def score_windows(self, windows: np.ndarray):
        """(nll [B, T-1], greedy ids [B, T-1]) for int32 windows [B, T], as evaluate's
        scorer computes them for a Keras model."""
        nll, greedy = [], []
        for window in np.asarray(windows, np.int32):
            logits = self.logits(window[:-1]).astype(np.float64)
            peak = logits.max(-1, keepdims=True)
            log_z = peak[:, 0] + np.log(np.exp(logits - peak).sum(-1))
            nll.append(log_z - logits[np.arange(len(logits)), window[1:]])
            greedy.append(logits.argmax(-1).astype(np.int32))
        return np.stack(nll), np.stack(greedy)


class _InPlaceDecode:
    """Batch-1 decode with the KV cache living in the decode signature's own input tensors.

    The `decode` signature reads the per-layer caches (`k_cache_i`, `v_cache_i`) and returns
    only the new token's entries (`kv`, [L, 2, Hkv, 1, Dh]); this writes them into those
    input buffers through numpy views, so a step copies one row per layer instead of the
    whole cache. The views stay valid because the decode subgraph's shapes are static and
    it is allocated once; the signature runner (which resizes and reallocates per call) is
    not used for decode.
    """

    def __init__(self, interpreter, runner, num_layers: int):
        self._wrapper = interpreter._interpreter  # the per-subgraph calls LiteRT's Python API wraps
        self._subgraph = runner._subgraph_index
        self._names = cache_names(num_layers)
        inputs = {name: detail["index"] for name, detail in runner.get_input_details().items()}
        outputs = {name: detail["index"] for name, detail in runner.get_output_details().items()}
        self._wrapper.AllocateTensors(self._subgraph)
        view = self._view
        self._token_ids, self._positions = view(inputs["token_ids"]), view(inputs["positions"])
        self._caches = [view(inputs[name]) for name in self._names]
        for cache in self._caches:  # arena memory: masked rows must still be finite (0 * NaN)
            cache.fill(0.0)
        self._entries, self._logits = view(outputs["kv"]), outputs["logits"]

    def _view(self, index: int) -> np.ndarray:
        return self._wrapper.tensor(self._wrapper, index, self._subgraph)

    def prefill(self, runner, prompt_ids: list[int]) -> np.ndarray:
        """Runs the prompt from position 0, fills the cache, returns the last logits [V]."""
        feed = {"token_ids": np.asarray(prompt_ids, np.int32)[None],
                "positions": np.zeros([1], np.int32)}
        feed.update(zip(self._names, self._caches))  # rows past position 0 are masked
        out = runner(**feed)
        write_entries(self._caches, out["kv"], 0)
        return out["logits"][0]

    def __call__(self, token: int, position: int) -> np.ndarray:
        """The logits [V] after `token` at `position`; its K/V rows join the cache."""
        self._token_ids[0, 0] = token
        self._positions[0] = position
        self._wrapper.Invoke(self._subgraph)
        write_entries(self._caches, self._entries, position)
        return self._wrapper.GetTensor(self._logits, self._subgraph)[0]
