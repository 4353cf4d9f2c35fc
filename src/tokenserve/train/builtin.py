"""Builds the built-in models: BPE tokenizer, Transformer and LSTM on the stdlib corpus."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tokenserve.config import GenerationConfig, LSTMConfig, TrainConfig, llama_config
from tokenserve.model.tokenizer import Tokenizer

# The chat template of the built-in models: a plain transcript that a code model can follow.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "# {{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}# assistant:{% endif %}")


def builtin_architecture(family: str, vocab_size: int) -> object:
    """The built-in models' shapes, sized to train in about half an hour on 2 CPU cores."""
    if family == "transformer":
        # Llama-style: RoPE, RMSNorm, SwiGLU, GQA (8 query heads share 4 KV heads).
        # intermediate 688 ~ 8/3 * 256 rounded to a multiple of 16, as in Llama.
        return llama_config(vocab_size=vocab_size, max_seq_len=512, hidden_size=256,
                            num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=688,
                            tie_embeddings=True)
    # An untied head: tied to a small embedding, the LSTM's bounded outputs learned slowly
    # (held-out loss still 6.6 after 700 steps, against 3.3 for the Transformer).
    return LSTMConfig(vocab_size=vocab_size, max_seq_len=512, hidden_size=256, num_layers=2,
                      tie_embeddings=False)


def train_builtin(output: Path, checkpoints: Path, config: TrainConfig, lstm_steps: int,
                  lstm_learning_rate: float,
                  families: tuple[str, ...] = ("transformer", "lstm")) -> dict:
    """Trains everything and writes `output/` (tokenizer.json, <family>.safetensors/.json)."""
    import keras

    from tokenserve.model import build_model
    from tokenserve.model.weights import load_weights, save_weights
    from tokenserve.train.corpus import Corpus, token_stream
    from tokenserve.train.trainer import Trainer, holdout_windows, perplexity

    output.mkdir(parents=True, exist_ok=True)
    checkpoints.mkdir(parents=True, exist_ok=True)
    corpus = Corpus.from_stdlib(config.holdout_fraction)
    print(f"corpus: {len(corpus.train_texts)} training files, "
          f"{len(corpus.holdout_texts)} held-out files")
    tokenizer_path = checkpoints / "tokenizer.json"
    if tokenizer_path.exists():
        tokenizer = Tokenizer.load(tokenizer_path)
    else:
        tokenizer = Tokenizer.train(corpus.train_texts, config.vocab_size)
        tokenizer.save(tokenizer_path)
    tokenizer.save(output / "tokenizer.json")
    stream = token_stream(corpus.train_texts, tokenizer)
    holdout = token_stream(corpus.holdout_texts, tokenizer)
    print(f"tokens: {len(stream):,} training, {len(holdout):,} held out")

    report_path = output / "train_report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    report.update({"seed": config.seed, "train_tokens": int(len(stream)),
              "holdout_tokens": int(len(holdout))})
    report.setdefault("models", {})
    for family in families:
        if family == "transformer":
            family_config = config
        else:
            family_config = dataclasses.replace(config, num_steps=lstm_steps,
                                                learning_rate=lstm_learning_rate)
        steps = family_config.num_steps
        architecture = builtin_architecture(family, tokenizer.vocab_size)
        keras.mixed_precision.set_global_policy(
            "mixed_bfloat16" if config.precision == "bf16" else "float32")
        model = build_model(architecture, seed=config.seed)
        result = Trainer(model, family_config, checkpoints / family).fit(stream, holdout, family)

        # Ship float16 weights (half the size); report perplexity of what ships, in float32.
        keras.mixed_precision.set_global_policy("float32")
        save_weights(model, output / f"{family}.safetensors", dtype="float16")
        shipped = build_model(architecture)
        load_weights(shipped, output / f"{family}.safetensors")
        windows = holdout_windows(holdout, config.seq_len, 10**9)
        ppl = perplexity(shipped, windows)
        generation = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id,
                                      chat_template=DEFAULT_CHAT_TEMPLATE, name=f"builtin-{family}")
        (output / f"{family}.json").write_text(json.dumps(generation.to_dict(), indent=2) + "\n")
        report["models"][family] = {
            "steps": steps, "train_seconds": round(result.seconds, 1),
            "final_train_loss": round(result.final_loss, 4),
            "holdout_perplexity": round(ppl, 3), "holdout_windows": int(len(windows)),
            "parameters": int(sum(w.numpy().size for w in shipped.weights)),
            "batch_size": config.batch_size, "seq_len": config.seq_len,
            "learning_rate": family_config.learning_rate, "precision": config.precision}
        print(f"{family}: held-out perplexity {ppl:.2f} after {steps} steps "
              f"({result.seconds / 60:.1f} min)")
        report_path.write_text(json.dumps(report, indent=2) + "\n")
    return report
