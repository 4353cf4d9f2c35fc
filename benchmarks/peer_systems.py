"""The peers the benchmarks measure tokenserve against, driven from the project's venv.

  HF TF XLA   Hugging Face transformers' TF GPT-2 with XLA `generate` (peers/hf_tf_xla.py),
              in its own virtualenv (transformers 5 dropped TensorFlow):
              bash benchmarks/peers/setup_hf_tf.sh
  llama.cpp   llama-cpp-python's OpenAI server on the same weights written as GGUF
              (peers/gpt2_gguf.py), in its own virtualenv: bash benchmarks/peers/setup_llama_cpp.sh
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import LineWorker, Server, free_port

HERE = Path(__file__).resolve().parent
HF_PEER = HERE / "peers" / "hf_tf_xla.py"
HF_VENV = HERE / ".venv-hf-tf"
HF_SETUP = "bash benchmarks/peers/setup_hf_tf.sh"
LLAMA_CPP_VENV = HERE / ".venv-llama-cpp"
LLAMA_CPP_SETUP = "bash benchmarks/peers/setup_llama_cpp.sh"


# -- Hugging Face transformers' TF GPT-2 -----------------------------------------------------
def hf_peer_python(venv: Path) -> Path | None:
    """The HF peer venv's python, or None when the venv is missing."""
    python = venv / "bin" / "python"
    return python if python.exists() else None


def hf_model_fields(arch) -> dict:
    """GPT2Config fields of the same shape as our model's `arch`."""
    return {"n_layer": arch.num_layers, "n_embd": arch.hidden_size, "n_head": arch.num_heads,
            "n_inner": arch.intermediate_size, "vocab_size": arch.vocab_size,
            "n_positions": arch.max_seq_len}


def run_hf_peer(python: Path, spec: dict, timeout: float | None = None) -> dict:
    """Runs peers/hf_tf_xla.py with `python` (its venv's) on `spec`; returns its JSON line."""
    proc = subprocess.run([str(python), str(HF_PEER), "--spec", "-"], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        log = [line for line in proc.stderr.splitlines()
               if not line.startswith(("I0000", "W0000", "WARNING: All log messages"))]
        raise RuntimeError(f"{HF_PEER.name} exited {proc.returncode}:\n" + "\n".join(log[-25:]))
    return json.loads(lines[-1])


def run_hf_cli(python: Path, args: list[str]) -> dict:
    """Runs peers/hf_tf_xla.py with command-line `args`; returns its last JSON line."""
    out = subprocess.run([str(python), str(HF_PEER), *args], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class HFRounds:
    """peers/hf_tf_xla.py in rounds mode: one compiled batch-1 generate per request, the
    model kept loaded between rounds."""

    def __init__(self, python: Path, prompt_len: int, new_tokens: int, temperature: float,
                 log_name: str):
        self.name = "hf"
        self.worker = LineWorker("hf", [
            str(python), str(HF_PEER), "--mode", "rounds", "--prompt-len", str(prompt_len),
            "--new-tokens", str(new_tokens), "--temperature", str(temperature)],
            Path(tempfile.gettempdir()) / log_name)

    def ready(self) -> None:
        assert self.worker.read().get("ready")

    def generate(self) -> dict:
        """One N-token generate and one 2-token one: {"wall_s", "tok_s", "generated",
        "two_token_call_s", "step_s"}."""
        return self.worker.ask("go")

    def stop(self) -> None:
        self.worker.stop()


# -- llama.cpp -------------------------------------------------------------------------------
def gguf_of(export_dir: Path, workdir: Path, qtype: str) -> Path:
    """WORKDIR/gpt2-QTYPE.gguf: the export's weights as GGUF (f32 or q8_0), written once."""
    path = workdir / f"gpt2-{qtype}.gguf"
    if not path.exists():
        subprocess.run([sys.executable, str(HERE / "peers" / "gpt2_gguf.py"), str(export_dir),
                        "--output-dir", str(workdir), "--types", qtype], check=True)
    return path


def llama_cpp_threads() -> int:
    """A thread per usable CPU, as tokenserve sizes TF's pools under a CPU quota."""
    from tokenserve.host.cpu_quota import usable_cpus

    return usable_cpus()


def llama_cpp_server(python: Path, gguf: Path, log_name: str, n_ctx: int = 1024,
                     logits_all: bool = True) -> Server:
    """llama-cpp-python's OpenAI server on `gguf` (model alias gpt2) on a free port, with a
    KV cache of `n_ctx` positions. logits_all: its server's default keeps a float32 row of
    logits for every context position and computes the head for every prompt token; False
    keeps the last batch's only (as llama.cpp's own server does)."""
    port, threads = free_port(), str(llama_cpp_threads())
    return Server([str(python), "-m", "llama_cpp.server", "--model", str(gguf),
                   "--model_alias", "gpt2", "--n_ctx", str(n_ctx), "--n_threads", threads,
                   "--n_threads_batch", threads, "--logits_all", str(logits_all).lower(),
                   "--host", "127.0.0.1", "--port", str(port)],
                  f"http://127.0.0.1:{port}", log_name)


def bert_gguf_of(workdir: Path, qtype: str) -> Path:
    """WORKDIR/minilm-QTYPE.gguf: all-MiniLM-L6-v2 as llama.cpp's BERT (f32 or f16),
    written once by peers/bert_gguf.py."""
    path = workdir / f"minilm-{qtype}.gguf"
    if not path.exists():
        subprocess.run([sys.executable, str(HERE / "peers" / "bert_gguf.py"), "--output-dir",
                        str(workdir), "--types", qtype], check=True)
    return path


def llama_cpp_embedding_server(python: Path, gguf: Path, log_name: str) -> Server:
    """llama-cpp-python's OpenAI server on a BERT `gguf` with embeddings on (model alias
    minilm), on a free port held in `ports["openai"]`. n_ctx and n_batch of 512 hold the
    longest input BERT takes in one batch, as embeddings need."""
    port, threads = free_port(), str(llama_cpp_threads())
    return Server([str(python), "-m", "llama_cpp.server", "--model", str(gguf),
                   "--model_alias", "minilm", "--embedding", "true", "--n_ctx", "512",
                   "--n_batch", "512", "--n_threads", threads, "--n_threads_batch", threads,
                   "--host", "127.0.0.1", "--port", str(port)],
                  f"http://127.0.0.1:{port}", log_name, ports={"openai": port})
