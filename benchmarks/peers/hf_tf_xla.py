#!/usr/bin/env python
"""Peer system: Hugging Face transformers' TF GPT-2 with XLA `generate`, greedy (or sampled).

Runs INSIDE its own virtualenv (tensorflow 2.21 + tf-keras 2.21 + transformers 4.57; create it
with `bash benchmarks/peers/setup_hf_tf.sh`): transformers 5 dropped TensorFlow. It imports only
tensorflow, transformers, numpy and the standard library, never tokenserve, and is driven by
benchmarks/decode.py and benchmarks/throughput.py through a subprocess.

Model: `TFGPT2LMHeadModel(GPT2Config())` with random weights (GPT-2 small: 12 layers, width 768,
12 heads, vocab 50257, context 1024); `--tiny` for a 2-layer width-128 vocab-512 model; a JSON
spec may set any GPT2Config field under "model" (the benchmarks pass their own shapes).

Generation is HF's documented TF XLA recipe: `tf.function(model.generate, jit_compile=True)`
called with greedy settings (`do_sample=False, num_beams=1`) and `max_new_tokens=N`; with
`--temperature T` > 0, plain temperature sampling instead (`do_sample=True, temperature=T,
top_k=0, top_p=1.0`: no cut, as OpenAI's default request). XLA
compiles once per input shape and per Python argument, so inputs are padded to fixed lengths
(left padding with an attention mask, as HF requires for decoder-only models). TF's generate
ignores `min_new_tokens` (only the PyTorch side implements it), so generation that never stops
early uses its TF equivalent `min_length = padded prompt + N`: the eos logit is -inf at every
step, and pad = eos, so each row produces exactly N tokens; the script counts them.

Modes (one JSON line on stdout; logs go to stderr):

  decode (default)  a static batch of `--batch-size` copies of one prompt (the spec's
                    "prompt_ids", else random ids of `--prompt-len`), `--new-tokens` new tokens.
                    Warm-up compiles the N-token and the 2-token call (compile_s), then each
                    of `--repeats` runs times one N-token generate (wall_s, tok/s = batch*N /
                    wall) and one 2-token generate of the same batch, for the TTFT ESTIMATE
                    (generate returns nothing before it ends; see "TTFT estimate" below).
  jobs              spec "jobs": [[prompt_ids, max_tokens], ...] served in order in static
                    batches of `--batch-size`: each batch padded to its longest prompt and
                    longest output, rounded up to `--prompt-bucket`/`--output-bucket` so
                    XLA compiles a few shapes (all compiled before timing; a short last batch
                    is padded with dummy rows). Batches run back to back from t=0, so with
                    batch size <= concurrency this is a closed-loop run (the caller works out
                    send times). Per job: done_s (its batch's end) and first_token_est_s (its
                    batch's start + the TTFT estimate of that batch's shape: an ESTIMATE of
                    when the first token exists; generate() delivers nothing before the batch
                    ends).

  rounds            for a driver that interleaves systems (benchmarks/one_stream.py): after
                    compiling the batch-1 N-token and 2-token calls it prints
                    {"ready": true}, then for each line read on stdin runs one N-token and
                    one 2-token generate of a new random prompt and prints {"wall_s",
                    "tok_s", "generated", "two_token_call_s", "step_s"}, step_s being one
                    decode step, (wall - 2-token call) / (N - 2), until stdin ends.

TTFT estimate: decode.py times a separate 1-new-token call for one-call systems, but HF's TF
XLA generate cannot make 1 token (max_new_tokens=1 fails to trace: its XLA cache padding
becomes negative). So the estimate is the wall time t2 of a 2-new-token generate of the same
shape (measured after warm-up) minus one decode step taken from the N-token call,
(tN - t2) / (N - 2): prefill + first token, as a 1-token call would be. t2 is reported too.

Usage:
  python hf_tf_xla.py --batch-size 1 --prompt-len 32 --new-tokens 128 --repeats 2
  python hf_tf_xla.py --tiny --new-tokens 16
  echo '{"mode": "jobs", "batch_size": 8, "jobs": [[[5, 6, 7], 20], [[8, 9], 12]]}' \\
      | python hf_tf_xla.py --spec -
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

DEFAULTS = {"mode": "decode", "batch_size": 1, "prompt_len": 32, "new_tokens": 128,
            "repeats": 3, "seed": 0, "prompt_seed": 0, "tiny": False, "temperature": 0.0,
            "prompt_bucket": 128, "output_bucket": 32}
TINY = {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 512, "n_positions": 256}
ENV_VARS = ("ONEDNN_MAX_CPU_ISA", "XLA_FLAGS", "TF_ENABLE_ONEDNN_OPTS", "TF_XLA_FLAGS")


def log(message: str) -> None:
    print(f"[hf-tf-xla] {message}", file=sys.stderr, flush=True)


def parse_spec(argv: list[str] | None) -> dict:
    parser = argparse.ArgumentParser(
        description="HF transformers TF GPT-2, XLA generate (see the module docstring).")
    parser.add_argument("--spec", default=None,
                        help="JSON spec file, or - for stdin; flags given override it")
    parser.add_argument("--mode", choices=("decode", "jobs", "rounds"), default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None, help="weight initialisation seed")
    parser.add_argument("--prompt-seed", type=int, default=None)
    parser.add_argument("--prompt-bucket", type=int, default=None,
                        help="jobs mode: pad prompts to a multiple of this (default 128)")
    parser.add_argument("--output-bucket", type=int, default=None,
                        help="jobs mode: round max_new_tokens up to a multiple of this "
                             "(default 32)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="> 0: plain temperature sampling instead of greedy")
    parser.add_argument("--tiny", action="store_true", default=None,
                        help="2-layer width-128 vocab-512 model (quick checks)")
    args = parser.parse_args(argv)
    spec = dict(DEFAULTS)
    if args.spec is not None:
        text = sys.stdin.read() if args.spec == "-" else open(args.spec).read()
        spec.update(json.loads(text))
    for key, value in vars(args).items():
        if key != "spec" and value is not None:
            spec[key] = value
    for key in ("batch_size", "new_tokens", "repeats", "prompt_bucket", "output_bucket"):
        if int(spec[key]) < 1:
            parser.error(f"{key} must be >= 1")
    if spec["mode"] == "jobs" and not spec.get("jobs"):
        parser.error("jobs mode needs a spec with a non-empty 'jobs' list")
    return spec


def build_model(spec: dict):
    import tensorflow as tf
    from transformers import GPT2Config, TFGPT2LMHeadModel

    fields = dict(TINY) if spec["tiny"] else {}
    fields.update(spec.get("model") or {})
    vocab = fields.get("vocab_size", 50257)
    # bos = eos = pad = the last id, as GPT-2 (50256); it must lie inside a tiny vocabulary.
    fields.setdefault("bos_token_id", vocab - 1)
    fields.setdefault("eos_token_id", vocab - 1)
    config = GPT2Config(**fields)
    tf.keras.utils.set_random_seed(int(spec["seed"]))
    model = TFGPT2LMHeadModel(config)  # random weights (initializer_range 0.02)
    model(tf.constant([[0, 1]], tf.int32))  # builds the weights
    return model, config


class XlaGenerator:
    """`tf.function(model.generate, jit_compile=True)`, greedy or sampled, never stopping
    early."""

    def __init__(self, model, config, temperature: float = 0.0):
        import tensorflow as tf

        self.tf = tf
        # greedy, or plain temperature sampling (no top-k or top-p cut: HF's top_k
        # defaults to 50)
        self.sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
                         if temperature > 0 else dict(do_sample=False))
        self.eos = int(config.eos_token_id)
        self.pad = self.eos
        self.generate_fn = tf.function(model.generate, jit_compile=True)
        self.compile_s: dict[str, float] = {}

    def __call__(self, input_ids, attention_mask, new_tokens: int):
        """Returns the [batch, new_tokens] generated ids (numpy) of padded inputs."""
        tf = self.tf
        prompt_len = int(input_ids.shape[1])
        key = f"batch={input_ids.shape[0]},prompt={prompt_len},new={new_tokens}"
        start = time.perf_counter()
        out = self.generate_fn(
            input_ids=tf.constant(input_ids, tf.int32),
            attention_mask=tf.constant(attention_mask, tf.int32),
            num_beams=1, max_new_tokens=new_tokens, **self.sampling,
            # TF generate ignores min_new_tokens; min_length counts the (padded) prompt.
            min_length=prompt_len + new_tokens,
            pad_token_id=self.pad, eos_token_id=self.eos)
        generated = out.numpy()[:, prompt_len:prompt_len + new_tokens]
        if key not in self.compile_s:  # first call of a shape: trace + XLA compile + one run
            self.compile_s[key] = time.perf_counter() - start
        return generated

    def count(self, generated) -> list[int]:
        """Tokens each row really produced: pad (= eos, banned) marks an early stop."""
        import numpy as np

        produced = generated != self.pad
        return [int(np.argmin(row)) if not row.all() else int(row.size) for row in produced]


def decode_step(t2: float, t_n: float, new_tokens: int) -> float:
    """One decode step of the N-token call: (N-token call - 2-token call) / (N - 2)."""
    return (t_n - t2) / (new_tokens - 2)


def ttft_estimate(t2: float, t_n: float, new_tokens: int) -> float:
    """Prefill + first token: a 2-token call minus one decode step of the N-token call."""
    if new_tokens <= 2:
        return t2
    return min(t2, max(0.0, t2 - decode_step(t2, t_n, new_tokens)))


def timed_pair(gen, ids, mask, new_tokens: int):
    """One N-token generate, then one 2-token generate of the same inputs (compiled
    before): (the N-token call's output, its seconds, the 2-token call's seconds)."""
    start = time.perf_counter()
    out = gen(ids, mask, new_tokens)
    wall = time.perf_counter() - start
    start = time.perf_counter()
    gen(ids, mask, 2)
    return out, wall, time.perf_counter() - start


def left_pad(prompts: list[list[int]], rows: int, length: int, pad: int):
    import numpy as np

    ids = np.full([rows, length], pad, np.int32)
    mask = np.zeros([rows, length], np.int32)
    for row in range(rows):
        prompt = prompts[row] if row < len(prompts) else prompts[0]  # dummy rows copy row 0
        ids[row, length - len(prompt):] = prompt
        mask[row, length - len(prompt):] = 1
    return ids, mask


def run_decode(spec: dict, model, config, gen: XlaGenerator) -> dict:
    import numpy as np

    batch, new = int(spec["batch_size"]), int(spec["new_tokens"])
    prompt = spec.get("prompt_ids")
    if not prompt:
        rng = np.random.default_rng(int(spec["prompt_seed"]))
        prompt = rng.integers(3, config.vocab_size - 1, size=int(spec["prompt_len"])).tolist()
    if len(prompt) + new > config.n_positions:
        raise SystemExit(f"prompt {len(prompt)} + new tokens {new} exceeds the context "
                         f"{config.n_positions}")
    ids, mask = left_pad([prompt], batch, len(prompt), gen.pad)
    log(f"warm-up: compiling {new}-token and 2-token generate, batch {batch}, "
        f"prompt {len(prompt)}")
    start = time.perf_counter()
    gen(ids, mask, new)
    gen(ids, mask, 2)
    warmup_s = time.perf_counter() - start
    runs = []
    for rep in range(int(spec["repeats"])):
        out, wall, t2 = timed_pair(gen, ids, mask, new)
        ttft = ttft_estimate(t2, wall, new)
        counts = gen.count(out)
        runs.append({"wall_s": wall, "ttft_est_s": ttft, "two_token_call_s": t2,
                     "generated": min(counts), "tok_s": batch * min(counts) / wall,
                     "tokens": out[0, :counts[0]].tolist()})  # row 0
        log(f"run {rep + 1}: {wall:.3f}s, {runs[-1]['tok_s']:.1f} tok/s, 2-token call "
            f"{t2 * 1e3:.1f} ms, TTFT estimate {ttft * 1e3:.1f} ms")
    return {
        "batch_size": batch, "prompt_tokens": len(prompt), "new_tokens": new,
        "runs": runs,
        "median": {"wall_s": statistics.median(r["wall_s"] for r in runs),
                   "tok_s": statistics.median(r["tok_s"] for r in runs),
                   "ttft_est_s": statistics.median(r["ttft_est_s"] for r in runs)},
        "ttft_is_estimate": True,
        "ttft_note": ("2-new-token generate of the same batch minus one decode step of the "
                      "N-token call (HF's TF XLA generate cannot make 1 token)"),
        "warmup_s": warmup_s,
    }


def run_rounds(spec: dict, config, gen: XlaGenerator, out) -> None:
    """One timed N-token generate per line of stdin, each answered with a JSON line on `out`
    (prompts of the same length, so nothing compiles after the first call)."""
    import numpy as np

    new = int(spec["new_tokens"])
    if new <= 2:
        raise SystemExit("rounds mode times one decode step from an N-token and a 2-token "
                         "call: --new-tokens must be > 2")
    rng = np.random.default_rng(int(spec["prompt_seed"]))

    def prompt():
        ids = rng.integers(3, config.vocab_size - 1, size=int(spec["prompt_len"])).tolist()
        return left_pad([ids], 1, len(ids), gen.pad)

    gen(*prompt(), new)  # compiles
    gen(*prompt(), 2)
    print(json.dumps({"ready": True}), file=out, flush=True)
    for _ in sys.stdin:
        generated, wall, t2 = timed_pair(gen, *prompt(), new)
        count = min(gen.count(generated))
        print(json.dumps({"wall_s": wall, "tok_s": count / wall, "generated": count,
                          "two_token_call_s": t2, "step_s": decode_step(t2, wall, new)}),
              file=out, flush=True)


def run_jobs(spec: dict, model, config, gen: XlaGenerator) -> dict:
    batch_size = int(spec["batch_size"])
    p_bucket, o_bucket = int(spec["prompt_bucket"]), int(spec["output_bucket"])
    jobs = [(list(map(int, prompt)), int(max_tokens)) for prompt, max_tokens in spec["jobs"]]
    context = config.n_positions

    def up(value: int, bucket: int) -> int:
        return -(-value // bucket) * bucket

    plans = []
    for first in range(0, len(jobs), batch_size):
        members = list(range(first, min(first + batch_size, len(jobs))))
        longest_prompt = max(len(jobs[j][0]) for j in members)
        longest_output = max(jobs[j][1] for j in members)
        if longest_prompt + longest_output > context:
            raise SystemExit(f"jobs {members}: prompt {longest_prompt} + output "
                             f"{longest_output} exceeds the context {context}")
        prompt_len = min(up(longest_prompt, p_bucket), context - longest_output)
        new = min(up(longest_output, o_bucket), context - prompt_len)
        plans.append({"jobs": members, "prompt_len": prompt_len, "new_tokens": new,
                      "longest_prompt": longest_prompt, "longest_output": longest_output})

    # Compile every shape, and time each prompt shape's 2-token generate (for the first-token
    # estimate) on a compiled function, before timing anything.
    shapes = sorted({(p["prompt_len"], p["new_tokens"]) for p in plans})
    two_token_s: dict[int, float] = {}
    log(f"warm-up: {len(plans)} batches of {batch_size}, compiling {len(shapes)} shapes "
        f"{shapes} and {len({s[0] for s in shapes})} 2-token shapes")
    start = time.perf_counter()
    for prompt_len, new in shapes:
        ids, mask = left_pad([[3] * (prompt_len // 2 or 1)], batch_size, prompt_len, gen.pad)
        gen(ids, mask, new)
        if prompt_len not in two_token_s:
            gen(ids, mask, 2)
            t = time.perf_counter()
            gen(ids, mask, 2)
            two_token_s[prompt_len] = time.perf_counter() - t
    warmup_s = time.perf_counter() - start

    results = [None] * len(jobs)
    batches = []
    t0 = time.perf_counter()
    for number, plan in enumerate(plans):
        members = plan["jobs"]
        ids, mask = left_pad([jobs[j][0] for j in members], batch_size, plan["prompt_len"],
                             gen.pad)
        begin = time.perf_counter() - t0
        out = gen(ids, mask, plan["new_tokens"])
        end = time.perf_counter() - t0
        counts = gen.count(out)
        ttft = ttft_estimate(two_token_s[plan["prompt_len"]], end - begin, plan["new_tokens"])
        for row, j in enumerate(members):
            results[j] = {"index": j, "batch": number, "max_tokens": jobs[j][1],
                          "generated": counts[row], "first_token_est_s": begin + ttft,
                          "done_s": end}
        batches.append({**plan, "rows": batch_size, "start_s": begin, "end_s": end,
                        "wall_s": end - begin, "first_token_est_s": ttft,
                        "min_generated": min(counts[:len(members)])})
        log(f"batch {number + 1}/{len(plans)}: {len(members)} jobs, prompt "
            f"{plan['prompt_len']}, new {plan['new_tokens']}: {end - begin:.2f}s")
    wall = max(r["done_s"] for r in results)
    requested = sum(m for _, m in jobs)
    decoded_rows = sum(b["rows"] * b["new_tokens"] for b in batches)
    return {
        "batch_size": batch_size, "num_jobs": len(jobs), "prompt_bucket": p_bucket,
        "output_bucket": o_bucket, "wall_s": wall, "output_tokens": requested,
        "output_tok_s": requested / wall,
        "decoded_token_slots": decoded_rows,
        "wasted_slot_fraction": 1 - requested / decoded_rows,
        "two_token_call_s": {str(k): v for k, v in sorted(two_token_s.items())},
        "first_token_is_estimate": True,
        "first_token_note": ("batch start + (2-token generate of the batch's shape, timed "
                             "after warm-up, minus one decode step of the batch's own call); "
                             "generate() returns nothing before the whole batch ends"),
        "warmup_s": warmup_s, "jobs": results, "batches": batches,
    }


def main(argv: list[str] | None = None) -> int:
    spec = parse_spec(argv)
    real_stdout = sys.stdout
    sys.stdout = sys.stderr  # anything the libraries print stays off the JSON line
    try:
        import numpy as np
        import tensorflow as tf
        import transformers

        transformers.logging.set_verbosity_error()  # per-trace padding warnings, deprecation

        start = time.perf_counter()
        model, config = build_model(spec)
        build_s = time.perf_counter() - start
        gen = XlaGenerator(model, config, float(spec["temperature"]))
        log(f"GPT-2 {config.n_layer} layers, width {config.n_embd}, {config.n_head} heads, "
            f"vocab {config.vocab_size}, context {config.n_positions}: "
            f"{model.count_params():,} params; mode {spec['mode']}, batch {spec['batch_size']}")
        if spec["mode"] == "rounds":
            run_rounds(spec, config, gen, real_stdout)
            return 0
        result = (run_jobs if spec["mode"] == "jobs" else run_decode)(spec, model, config, gen)
        result.update({
            "system": "hf-tf-xla", "mode": spec["mode"],
            "generate": ("tf.function(TFGPT2LMHeadModel.generate, jit_compile=True), "
                         f"{gen.sampling}, num_beams=1, min_length=prompt+new, pad=eos"),
            "model": {key: getattr(config, key) for key in
                      ("n_layer", "n_embd", "n_head", "n_inner", "vocab_size", "n_positions",
                       "eos_token_id")},
            "num_params": int(model.count_params()),
            "dtype": "float32", "seed": int(spec["seed"]), "build_s": build_s,
            "compile_s": gen.compile_s,
            "versions": {"tensorflow": tf.__version__, "transformers": transformers.__version__,
                         "tf_keras": __import__("tf_keras").__version__,
                         "numpy": np.__version__, "python": platform.python_version()},
            "env": {name: os.environ[name] for name in ENV_VARS if name in os.environ},
        })
    finally:
        sys.stdout = real_stdout
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
