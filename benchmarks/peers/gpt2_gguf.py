#!/usr/bin/env python
"""Writes a tokenserve GPT-2 export as GGUF files for llama.cpp: the same weights and
tokenizer, so the llama.cpp peer runs exactly the model tokenserve serves.

    python benchmarks/peers/gpt2_gguf.py /tmp/headline/gpt2-float32 --output-dir /tmp/headline

writes gpt2-f32.gguf and gpt2-q8_0.gguf (llama.cpp's 8-bit format: blocks of 32 weights
with one fp16 scale) laid out as llama.cpp's own converter lays out GPT-2: `blk.N.attn_qkv`
etc., weight matrices as [out, in], the tied LM head repeated as `output.weight`, 1-D
tensors in F32. Runs in the project's environment (it has `gguf`, the writer llama.cpp
maintains). The tokenizer's vocabulary is padded to the model's embedding rows with unused
tokens; its end-of-text token is one of those, so llama.cpp never stops early on the
random model (the benchmark's `ignore_eos`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from rich.progress import track


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """llama.cpp's GPT-2 tensor names -> float32 arrays, from a TransformerLM's weights."""
    weights = {w.path.removeprefix("transformer/"): np.asarray(w.numpy(), np.float32)
               for w in model.weights}
    tensors = {"token_embd.weight": weights["token_embedding"],
               "position_embd.weight": weights["position_embedding"],
               "output_norm.weight": weights["final_norm/scale"],
               "output_norm.bias": weights["final_norm/bias"],
               "output.weight": weights["token_embedding"]}
    for i in range(model.config.num_layers):
        ours, theirs = f"block_{i}/", f"blk.{i}."
        for mine, name in (("attn_norm", "attn_norm"), ("mlp_norm", "ffn_norm")):
            tensors[theirs + name + ".weight"] = weights[ours + mine + "/scale"]
            tensors[theirs + name + ".bias"] = weights[ours + mine + "/bias"]
        for mine, name in (("qkv", "attn_qkv"), ("out", "attn_output"), ("up", "ffn_up"),
                           ("down", "ffn_down")):
            tensors[theirs + name + ".weight"] = weights[ours + mine + "/kernel"].T.copy()
            tensors[theirs + name + ".bias"] = weights[ours + mine + "/bias"]
    return tensors


def vocabulary(tokenizer_file: Path, size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE tokenizer.json, padded to `size`."""
    spec = json.loads(tokenizer_file.read_text())
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    vocab.update(special)
    tokens = [f"<|unused_{i}|>" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for token, token_id in vocab.items():
        tokens[token_id] = token
        types[token_id] = (gguf.TokenType.CONTROL if token in special
                           else gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges


def write(path: Path, model, tensors: dict[str, np.ndarray], vocab, qtype: Q) -> None:
    config = model.config
    tokens, types, merges = vocab
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_name("tokenserve gpt2-small")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == Q.Q8_0
                         else gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(config.max_seq_len)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_layer_norm_eps(config.norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    unused = len(tokens) - 1  # never produced on purpose: the benchmark ignores EOS
    writer.add_bos_token_id(unused)
    writer.add_eos_token_id(unused)
    writer.add_add_bos_token(False)
    for name, value in track(tensors.items(), description=f"writing {path.name}"):
        if value.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(name, value)
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", type=Path, help="a float32 tokenserve export of GPT-2")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--types", nargs="+", default=["f32", "q8_0"], choices=["f32", "q8_0"])
    args = parser.parse_args(argv)

    from tokenserve.export.restore import load_language_model

    model, _, _, version_dir = load_language_model(args.export, precision="float32")
    if getattr(model.config, "position", None) != "learned":
        raise SystemExit("not a GPT-2 (learned positions, LayerNorm) export")
    tensors = gguf_tensors(model)
    vocab = vocabulary(version_dir / "assets" / "tokenizer.json", model.config.vocab_size)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name in args.types:
        path = args.output_dir / f"gpt2-{name}.gguf"
        write(path, model, tensors, vocab, Q.Q8_0 if name == "q8_0" else Q.F32)
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
