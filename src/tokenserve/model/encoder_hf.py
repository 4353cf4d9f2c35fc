"""Imports BERT encoders from a Hugging Face or sentence-transformers folder.

A transformers folder (`config.json`, `*.safetensors`, `tokenizer.json`) holds a `BertModel`
(an embedder: CLS pooling, no normalization, unless sentence-transformers' files say more)
or a `BertForSequenceClassification` (a cross-encoder: its logits score pairs). A
sentence-transformers folder adds `modules.json`: the Transformer module (the folder itself or
a subfolder, with `sentence_bert_config.json`'s max_seq_length), its Pooling module
(`1_Pooling/config.json`: mean, CLS, max or last token) and, when listed, Normalize.
Weights go through safetensors only: nothing is unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tokenserve.encoder_config import EncoderConfig, Pooling
from tokenserve.errors import ModelLoadError, ModelNotFoundError
from tokenserve.model.encoder import BertEncoder, weight_shapes
from tokenserve.model.encoder_tokenizer import EncoderTokenizer
from tokenserve.model.hf import UnsupportedArchitectureError, read_safetensors

ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification")
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new"}
# sentence-transformers' Pooling flags -> ours; exactly one may be set
_POOLING_FLAGS = {"pooling_mode_mean_tokens": Pooling.MEAN, "pooling_mode_cls_token": Pooling.CLS,
                  "pooling_mode_max_tokens": Pooling.MAX, "pooling_mode_lasttoken": Pooling.LAST}
_MODULE_KINDS = ("Transformer", "Pooling", "Normalize")
# buffers and tensors an encoder does not use: position ids, and an embedder's pooler
_IGNORED = ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias")


def _read_json(path: Path) -> dict | list:
    return json.loads(path.read_text()) if path.exists() else {}


def is_encoder_folder(directory: str | Path) -> bool:
    """True when the folder's config.json names an encoder architecture."""
    config = _read_json(Path(directory) / "config.json")
    return bool(config) and (config.get("architectures") or [""])[0] in ENCODER_ARCHITECTURES


def _sentence_modules(directory: Path) -> tuple[Path, Pooling | None, bool]:
    """(the Transformer module's folder, its pooling, normalize) from modules.json; for a
    plain transformers folder (no modules.json): (the folder, None, False)."""
    modules = _read_json(directory / "modules.json")
    if not modules:
        return directory, None, False
    transformer, pooling, normalize = directory, None, False
    for module in modules:
        kind = module["type"].rsplit(".", 1)[-1]
        if kind not in _MODULE_KINDS:
            raise UnsupportedArchitectureError(
                f"sentence-transformers module {module['type']} is not supported; "
                f"supported: {', '.join(_MODULE_KINDS)}")
        path = directory / module.get("path", "")
        if kind == "Transformer":
            transformer = path
        elif kind == "Pooling":
            pooling = _pooling(_read_json(path / "config.json"))
        else:
            normalize = True
    return transformer, pooling, normalize


def _pooling(config: dict) -> Pooling:
    """The one pooling mode a 1_Pooling/config.json sets."""
    if isinstance(config.get("pooling_mode"), str):  # newer sentence-transformers
        mode = {"lasttoken": "last"}.get(config["pooling_mode"], config["pooling_mode"])
        try:
            return Pooling(mode)
        except ValueError:
            raise UnsupportedArchitectureError(f"pooling {mode!r} is not supported") from None
    chosen = [flag for flag, value in config.items() if flag.startswith("pooling_mode")
              and value]
    if len(chosen) != 1 or chosen[0] not in _POOLING_FLAGS:
        raise UnsupportedArchitectureError(
            f"pooling {chosen or 'none'} is not supported; exactly one of "
            f"{', '.join(_POOLING_FLAGS)} may be set")
    return _POOLING_FLAGS[chosen[0]]


def encoder_config(hf: dict, pooling: Pooling | None = None, normalize: bool = False,
                   max_seq_len: int | None = None, name: str = "encoder") -> EncoderConfig:
    """Our EncoderConfig for a BERT config.json (and sentence-transformers' settings)."""
    arch = (hf.get("architectures") or ["<none>"])[0]
    if arch not in ENCODER_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"encoder architecture {arch!r} is not supported; supported: "
            f"{', '.join(ENCODER_ARCHITECTURES)}")
    activation = _ACTIVATIONS.get(hf.get("hidden_act", "gelu"))
    if activation is None:
        raise UnsupportedArchitectureError(f"activation {hf['hidden_act']!r} is not supported")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedArchitectureError(
            f"position embeddings {hf['position_embedding_type']!r} are not supported")
    num_labels = 0
    if arch == "BertForSequenceClassification":
        num_labels = len(hf.get("id2label") or {}) or hf.get("num_labels", 2)
    positions = hf["max_position_embeddings"]
    return EncoderConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        intermediate_size=hf["intermediate_size"], max_position_embeddings=positions,
        max_seq_len=min(max_seq_len or positions, positions),
        type_vocab_size=hf.get("type_vocab_size", 2), norm_eps=hf.get("layer_norm_eps", 1e-12),
        activation=activation, pooling=pooling or Pooling.CLS, normalize=normalize,
        num_labels=num_labels, pad_token_id=hf.get("pad_token_id") or 0, name=name)


def _hf_names(config: EncoderConfig, prefix: str) -> dict:
    """our weight name -> (hf tensor names, how to combine them); torch Linear is [out, in]."""
    keep = lambda x: x  # noqa: E731
    fuse = lambda *ws: np.concatenate([w.T for w in ws], axis=1)  # noqa: E731
    cat = lambda *bs: np.concatenate(bs)  # noqa: E731
    t = lambda w: w.T  # noqa: E731
    e = prefix + "embeddings."
    names = {"word_embedding": ([e + "word_embeddings.weight"], keep),
             "position_embedding": ([e + "position_embeddings.weight"], keep),
             "type_embedding": ([e + "token_type_embeddings.weight"], keep),
             "embedding_norm/scale": ([e + "LayerNorm.weight"], keep),
             "embedding_norm/bias": ([e + "LayerNorm.bias"], keep)}
    for i in range(config.num_layers):
        p, h = f"layer_{i}/", f"{prefix}encoder.layer.{i}."
        qkv = [h + f"attention.self.{x}" for x in ("query", "key", "value")]
        names.update({
            p + "qkv/kernel": ([q + ".weight" for q in qkv], fuse),
            p + "qkv/bias": ([q + ".bias" for q in qkv], cat),
            p + "out/kernel": ([h + "attention.output.dense.weight"], t),
            p + "out/bias": ([h + "attention.output.dense.bias"], keep),
            p + "attn_norm/scale": ([h + "attention.output.LayerNorm.weight"], keep),
            p + "attn_norm/bias": ([h + "attention.output.LayerNorm.bias"], keep),
            p + "up/kernel": ([h + "intermediate.dense.weight"], t),
            p + "up/bias": ([h + "intermediate.dense.bias"], keep),
            p + "down/kernel": ([h + "output.dense.weight"], t),
            p + "down/bias": ([h + "output.dense.bias"], keep),
            p + "mlp_norm/scale": ([h + "output.LayerNorm.weight"], keep),
            p + "mlp_norm/bias": ([h + "output.LayerNorm.bias"], keep)})
    if config.num_labels:
        names.update({"pooler/kernel": ([prefix + "pooler.dense.weight"], t),
                      "pooler/bias": ([prefix + "pooler.dense.bias"], keep),
                      "classifier/kernel": (["classifier.weight"], t),
                      "classifier/bias": (["classifier.bias"], keep)})
    return names


def assign_encoder_weights(encoder: BertEncoder, tensors: dict[str, np.ndarray]) -> None:
    """Copies HF tensors into `encoder`; names any missing, unexpected or misshapen tensor."""
    # TF1-era checkpoints name LayerNorm's parameters gamma and beta
    tensors = {k.replace("LayerNorm.gamma", "LayerNorm.weight")
                .replace("LayerNorm.beta", "LayerNorm.bias"): v for k, v in tensors.items()}
    prefix = "bert." if any(k.startswith("bert.") for k in tensors) else ""
    shapes, used = weight_shapes(encoder.config), set()
    for ours, (sources, combine) in _hf_names(encoder.config, prefix).items():
        missing = [s for s in sources if s not in tensors]
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensor {missing[0]} (for {ours})")
        value = combine(*[tensors[s] for s in sources])
        if tuple(value.shape) != shapes[ours]:
            raise ModelLoadError(f"tensor {sources[0]} {tuple(tensors[sources[0]].shape)} does "
                                 f"not fit {ours}: expected {shapes[ours]}, got "
                                 f"{tuple(value.shape)}")
        encoder.weights[ours].assign(value)
        used.update(sources)
    extra = sorted(k for k in tensors if k not in used and k.removeprefix(prefix) not in _IGNORED)
    if extra:
        raise ModelLoadError(f"checkpoint has unexpected tensor {extra[0]} with shape "
                             f"{tuple(tensors[extra[0]].shape)}"
                             + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


def load_hf_encoder(directory: str | Path, name: str | None = None
                    ) -> tuple[BertEncoder, EncoderTokenizer, EncoderConfig]:
    """(encoder, tokenizer, config) from a transformers or sentence-transformers folder."""
    directory = Path(directory)
    transformer, pooling, normalize = _sentence_modules(directory)
    if not (transformer / "config.json").exists():
        raise ModelNotFoundError(f"{transformer} has no config.json")
    tokenizer_path = transformer / "tokenizer.json"
    if not tokenizer_path.exists():
        raise ModelNotFoundError(f"{transformer} has no tokenizer.json")
    sentence = _read_json(transformer / "sentence_bert_config.json")
    tokenizer_config = _read_json(transformer / "tokenizer_config.json")
    max_seq_len = sentence.get("max_seq_length") or tokenizer_config.get("model_max_length")
    if not isinstance(max_seq_len, int) or max_seq_len > 1 << 20:
        max_seq_len = None  # transformers writes a huge sentinel when there is no limit
    config = encoder_config(_read_json(transformer / "config.json"), pooling, normalize,
                            max_seq_len, name=name or directory.name)
    encoder = BertEncoder(config)
    assign_encoder_weights(encoder, read_safetensors(transformer))
    return encoder, EncoderTokenizer.load(tokenizer_path), config
