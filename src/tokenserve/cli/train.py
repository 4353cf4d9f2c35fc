"""`tokenserve train`: rebuild the built-in models from the stdlib corpus."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(commands) -> None:
    from tokenserve.config import TrainConfig

    defaults = TrainConfig()
    p = commands.add_parser("train", help="train the built-in tokenizer, Transformer and LSTM",
                            description="Trains the built-in models on this interpreter's "
                                        "standard-library sources. Resumes from --checkpoints.")
    p.add_argument("--output", type=Path, default=Path("runs/builtin"),
                   help="where tokenizer.json and the weights go (default: runs/builtin)")
    p.add_argument("--checkpoints", type=Path, default=Path("runs/checkpoints"),
                   help="checkpoint folder; an existing one is resumed")
    p.add_argument("--steps", type=int, default=defaults.num_steps, help="Transformer steps")
    p.add_argument("--lstm-steps", type=int, default=1000, help="LSTM steps")
    p.add_argument("--lstm-learning-rate", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=defaults.batch_size)
    p.add_argument("--seq-len", type=int, default=defaults.seq_len)
    p.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    p.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    p.add_argument("--precision", choices=["bf16", "fp32"], default=defaults.precision)
    p.add_argument("--family", choices=["transformer", "lstm", "both"], default="both")
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tokenserve.cli.output import prepare_output_dir
    from tokenserve.config import TrainConfig
    from tokenserve.train.builtin import train_builtin

    prepare_output_dir(args.output)

    config = TrainConfig(seed=args.seed, vocab_size=args.vocab_size, seq_len=args.seq_len,
                         batch_size=args.batch_size, num_steps=args.steps,
                         learning_rate=args.learning_rate, precision=args.precision)
    families = ("transformer", "lstm") if args.family == "both" else (args.family,)
    train_builtin(args.output, args.checkpoints, config, args.lstm_steps,
                  args.lstm_learning_rate, families)
    return 0
