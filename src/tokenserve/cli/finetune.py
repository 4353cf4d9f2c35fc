"""`tokenserve finetune MODEL --data FILE --lora_rank R --output DIR`: a LoRA fine-tune of a
served model on the user's text, written as a PEFT adapter (`tokenserve serve
--lora_modules name=DIR`, or peft itself, loads it)."""

from __future__ import annotations

import argparse

DEFAULT_STEPS = 200
LORA_LEARNING_RATE = 1e-3
"""LoRA's factors start from nothing (B = 0): a higher rate than a full fine-tune's."""


def add_parser(commands) -> None:
    p = commands.add_parser(
        "finetune", help="LoRA fine-tune a model on your text; writes a PEFT adapter",
        description=__doc__)
    p.add_argument("model", help="an export dir or base path, a Hugging Face checkpoint dir, "
                                 "a .gguf file, builtin or smollm2")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE",
                   help="text files to train on (the last 10 %% held out for perplexity)")
    p.add_argument("--lora_rank", type=int, default=16, help="rank of every factor")
    p.add_argument("--lora_alpha", type=float, default=None,
                   help="scale numerator (alpha / rank); default 2 x rank")
    p.add_argument("--target_modules", nargs="+", default=None, metavar="NAME",
                   help="modules to adapt, as the model's own checkpoint names them "
                        "(default: all of q/k/v/o/gate/up/down, Phi-3's "
                        "qkv/o/gate_up/down, or GPT-2's c_attn/c_proj/c_fc; a mixture "
                        "of experts: q/k/v/o)")
    p.add_argument("--output", required=True, help="the adapter's directory")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--learning_rate", type=float, default=LORA_LEARNING_RATE)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tokenserve.errors import ConfigError
    from tokenserve.tools.evaluate import load_float_source
    from tokenserve.train.finetune import training_streams
    from tokenserve.train.lora import LoraModel

    if args.steps < 1 or args.lora_rank < 1:
        raise ConfigError("--steps and --lora_rank must be at least 1")
    model, tokenizer, config = load_float_source(args.model)
    train, holdout = training_streams(tokenizer, args.data)
    lora = LoraModel(model, args.lora_rank, args.lora_alpha, args.target_modules, args.seed)
    before, after = finetune_lora(lora, train, holdout, args)
    path = lora.save_adapter(args.output, base_model=str(args.model))
    print(f"held-out perplexity {before:.3f} -> {after:.3f} "
          f"({(after / before - 1) * 100:+.1f} %); adapter written to {path}")
    print(f"serve it: tokenserve serve ... --lora_modules {path.name}={path}")
    return 0


def finetune_lora(lora, train, holdout, args) -> tuple[float, float]:
    """(held-out perplexity before, after) a LoRA fine-tune of `lora` by the trainer."""
    import tempfile

    from tokenserve.train.finetune import finetune
    from tokenserve.train.lora import LoraTrainer
    from tokenserve.train.trainer import holdout_windows, perplexity

    seq_len = min(args.seq_len, lora.config.max_seq_len, len(train) - 2, len(holdout) - 2)
    windows = holdout_windows(holdout, seq_len, 8)
    before = perplexity(lora, windows)
    with tempfile.TemporaryDirectory(prefix="tokenserve-lora-") as workdir:
        finetune(lora, train, holdout, args.steps, workdir, learning_rate=args.learning_rate,
                 batch_size=args.batch_size, seq_len=seq_len, seed=args.seed,
                 trainer_class=LoraTrainer)
    return before, perplexity(lora, windows)
