"""Byte-level BPE tokenizer (HF `tokenizers`), stored as `tokenizer.json`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2 in a tokenizer we train


class Tokenizer:
    """Text <-> token ids, with the special tokens a generation config needs."""

    def __init__(self, hf: HFTokenizer, bos_token_id: int, eos_token_id: int, pad_token_id: int,
                 add_bos: bool = False):
        self.hf = hf
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (
            bos_token_id, eos_token_id, pad_token_id)
        self.add_bos = add_bos
        """Prompts start with bos_token_id (GenerationConfig.add_bos_token: Gemma)."""

    @classmethod
    def with_special_tokens(cls, hf: HFTokenizer, bos: str = BOS, eos: str = EOS,
                            pad: str = PAD) -> "Tokenizer":
        """Wraps `hf`, finding the special tokens' ids by their text."""
        def require(token: str) -> int:
            token_id = hf.token_to_id(token)
            if token_id is None:
                raise ValueError(f"tokenizer has no special token {token!r}")
            return token_id

        return cls(hf, require(bos), require(eos), require(pad))

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        """Trains byte-level BPE on `texts` (deterministic for the same input)."""
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=True)
        hf.train_from_iterator(texts, trainer=trainer)
        return cls.with_special_tokens(hf)

    @classmethod
    def load(cls, path: str | Path, **special) -> "Tokenizer":
        """Loads tokenizer.json; `special` overrides the special tokens' text (bos, eos, pad)."""
        return cls.with_special_tokens(HFTokenizer.from_file(str(path)), **special)

    def save(self, path: str | Path) -> None:
        self.hf.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def encode_prompts(self, texts: list[str]) -> list[list[int]]:
        """encode_batch for prompts: with add_bos, each starts with bos_token_id, unless its
        text did already (a chat template that writes the bos token itself)."""
        ids = self.encode_batch(texts)
        if not self.add_bos:
            return ids
        return [i if i[:1] == [self.bos_token_id] else [self.bos_token_id] + i for i in ids]

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def stream(self, token_ids: Iterable[int]) -> Iterator[str]:
        """Yields text as tokens arrive, holding back bytes of an unfinished UTF-8 character."""
        ids: list[int] = []
        emitted = ""
        for token_id in token_ids:
            ids.append(token_id)
            text = self.decode(ids)
            if text.endswith("\ufffd"):  # a multi-byte character is still incomplete
                continue
            if len(text) > len(emitted):
                yield text[len(emitted):]
            emitted = text
