"""The tokenizer of a GGUF file, rebuilt as an HF `tokenizers` Tokenizer (see gguf.py).

From the vocabulary, merges (or, for SentencePiece files without them, the merges its
scores imply), token types and pre-tokenizer name (`tokenizer.ggml.pre`): byte-level BPE
(`gpt2`) and SentencePiece BPE with byte fallback (`llama`). A pre-tokenizer or tokenizer
model not listed here is refused by name.
"""

from __future__ import annotations

from tokenserve.errors import ModelLoadError
from tokenserve.model.gguf_file import GGUFFile, UnsupportedGGUFError

TOKENIZER_MODELS = ("gpt2", "llama")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer splits, as llama.cpp's llama-vocab.cpp applies them per `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# name -> "gpt2" (GPT-2's own regex), "digits" (each digit alone, then GPT-2's regex) or a
# split regex applied before the byte-level mapping
PRE_TOKENIZERS: dict[str, str] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2", "mpt", "olmo", "jais", "trillion"), "gpt2"),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva"), "digits"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx",
                     "smaug-bpe", "midm-2.0"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O_SPLIT),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(256 + extra)
            extra += 1
    return spelled


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two
    tokens, best score first (as `transformers` derives them for files without merges)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def build_tokenizer(file: GGUFFile):
    """Our Tokenizer (an HF `tokenizers` Tokenizer inside) from the file's vocabulary."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    from tokenserve.model.tokenizer import Tokenizer

    meta = file.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise UnsupportedGGUFError(f"GGUF tokenizer model {kind!r} is not supported; "
                                   f"supported: {', '.join(TOKENIZER_MODELS)}")
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ModelLoadError(f"{file.path.name} has no tokenizer.ggml.tokens")
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]

    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre") or "default"
        if pre not in PRE_TOKENIZERS:
            raise UnsupportedGGUFError(
                f"GGUF pre-tokenizer {pre!r} is not supported; supported: "
                f"{', '.join(sorted(PRE_TOKENIZERS))}")
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {}
        for index, token in enumerate(tokens):
            if not set(token) <= alphabet:  # stored as text: spell its bytes
                token = "".join(spelling[b] for b in token.encode("utf-8"))
            vocab.setdefault(token, index)
        hf = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False))
        split = PRE_TOKENIZERS[pre]
        if split == "gpt2":
            hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif split == "digits":
            hf.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        else:
            hf.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        hf.decoder = decoders.ByteLevel()
        # a byte-level "control" token outside the byte alphabet is a mislabel: not special
        is_control = lambda t: set(t) <= alphabet  # noqa: E731
    else:  # SentencePiece BPE with byte fallback (Llama 1/2, TinyLlama, Mistral)
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        if not merges:
            merges = _merges_from_scores(tokens, scores)
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        hf = HFTokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                             unk_token=tokens[unk] if unk is not None else None,
                             fuse_unk=True, byte_fallback=True))
        hf.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if prefix else "never", split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            steps.append(decoders.Strip(content=" ", left=1))
        hf.decoder = decoders.Sequence(steps)
        is_control = lambda t: True  # noqa: E731

    special = [AddedToken(t, normalized=False, special=True)
               for t, kind_ in zip(tokens, types) if kind_ == CONTROL and is_control(t)]
    if special:
        hf.add_special_tokens(special)
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind_ in zip(tokens, types) if kind_ == USER_DEFINED]
    if user:
        hf.add_tokens(user)

    def token_id(name: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    eos = token_id("eos")
    if eos is None:
        raise ModelLoadError(f"{file.path.name} names no eos token (tokenizer.ggml.eos_token_id)")
    bos, pad = token_id("bos"), token_id("padding")
    return Tokenizer(hf, bos_token_id=eos if bos is None else bos, eos_token_id=eos,
                     pad_token_id=eos if pad is None else pad)
