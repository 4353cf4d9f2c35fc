"""Benchmark prompts: random lengths, a prompt file, or ShareGPT-style JSON.

Lengths are counted with a Hugging Face `tokenizer.json` (by default tokenserve's built-in
tokenizer); point `--tokenizer` at the served model's own for exact prompt lengths. The
server's reported usage still takes precedence in the metrics when it is returned.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

BUILTIN_TOKENIZER = Path(__file__).resolve().parent.parent / "builtin" / "tokenizer.json"
# ShareGPT filtering as in vLLM's benchmark: drop pairs too short to time, or too long to fit.
MIN_SHAREGPT_TOKENS = 4
MAX_SHAREGPT_PROMPT_TOKENS = 1024
MAX_SHAREGPT_TOTAL_TOKENS = 2048


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send and how many tokens to ask for."""

    prompt: str
    prompt_len: int
    """Prompt length in tokens of the benchmark's tokenizer."""
    output_len: int
    """`max_tokens` to request."""


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """A `tokenizers.Tokenizer` from a tokenizer.json; the built-in one when path is None."""
    return Tokenizer.from_file(str(path or BUILTIN_TOKENIZER))


def sample_lengths(mean: int, range_ratio: float, count: int, rng: random.Random) -> list[int]:
    """Integers uniform in [mean*(1-r), mean*(1+r)] (at least 1), as vLLM's random dataset."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def random_dataset(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                   seed: int, tokenizer: Tokenizer) -> list[BenchRequest]:
    """Prompts of random tokens with random lengths around `input_len`.

    Random ids are decoded to text and re-encoded, then cut to the target length, so the
    text the server receives re-tokenizes (with the same tokenizer) to about that length.
    """
    rng = random.Random(seed)
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    vocabulary = sorted(token_id for token, token_id in tokenizer.get_vocab().items()
                        if token not in special)
    input_lens = sample_lengths(input_len, range_ratio, num_prompts, rng)
    output_lens = sample_lengths(output_len, range_ratio, num_prompts, rng)
    requests = []
    for prompt_len, max_tokens in zip(input_lens, output_lens):
        token_ids = [rng.choice(vocabulary) for _ in range(prompt_len)]
        token_ids = tokenizer.encode(tokenizer.decode(token_ids),
                                     add_special_tokens=False).ids[:prompt_len]
        prompt = tokenizer.decode(token_ids)
        requests.append(BenchRequest(prompt, len(token_ids), max_tokens))
    return requests


def file_dataset(path: str | Path, num_prompts: int, output_len: int, seed: int,
                 tokenizer: Tokenizer) -> list[BenchRequest]:
    """Prompts from a file: one per line, or JSON lines with a "prompt" field.

    Prompts are reused in a seeded shuffled cycle when the file has fewer than asked for.
    """
    prompts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            prompts.append(json.loads(line)["prompt"])
        else:
            prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    rng = random.Random(seed)
    rng.shuffle(prompts)
    chosen = [prompts[index % len(prompts)] for index in range(num_prompts)]
    return [BenchRequest(prompt, _count(tokenizer, prompt), output_len) for prompt in chosen]


def sharegpt_dataset(path: str | Path, num_prompts: int, seed: int, tokenizer: Tokenizer,
                     output_len: int | None = None) -> list[BenchRequest]:
    """First human turn as the prompt; the reply's token count as output length (unless fixed).

    The file is a JSON list of {"conversations": [{"from": ..., "value": ...}, ...]} (the
    ShareGPT_V3 layout vLLM uses). Conversations with fewer than two turns are skipped, and,
    without a fixed output length, pairs under 4 tokens or over 1024 prompt / 2048 total
    tokens (vLLM's filter).
    """
    conversations = [entry["conversations"] for entry in json.loads(Path(path).read_text())
                     if len(entry.get("conversations", ())) >= 2]
    random.Random(seed).shuffle(conversations)
    requests = []
    for turns in conversations:
        if len(requests) == num_prompts:
            break
        prompt = turns[0]["value"]
        prompt_len = _count(tokenizer, prompt)
        reply_len = output_len or _count(tokenizer, turns[1]["value"])
        if output_len is None and not _fits(prompt_len, reply_len):
            continue
        requests.append(BenchRequest(prompt, prompt_len, reply_len))
    if len(requests) < num_prompts:
        raise ValueError(f"{path} has only {len(requests)} usable conversations, "
                         f"{num_prompts} asked for")
    return requests


def _fits(prompt_len: int, output_len: int) -> bool:
    return (prompt_len >= MIN_SHAREGPT_TOKENS and output_len >= MIN_SHAREGPT_TOKENS
            and prompt_len <= MAX_SHAREGPT_PROMPT_TOKENS
            and prompt_len + output_len <= MAX_SHAREGPT_TOTAL_TOKENS)


def _count(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)
