#!/usr/bin/env bash
# Creates the virtualenv of the Hugging Face transformers TF peer (benchmarks/peers/hf_tf_xla.py)
# with the pins in requirements-hf-tf.txt. transformers 5 dropped TensorFlow, so the peer cannot
# share the project's environment (which has Keras 3 and no transformers).
#
#   bash benchmarks/peers/setup_hf_tf.sh [VENV]
#
# VENV defaults to $HF_TF_VENV, else benchmarks/.venv-hf-tf. Idempotent: an existing VENV that
# already has the pinned versions is left as it is (nothing downloaded); one that lacks them is
# brought up to the pins. PYTHON picks the interpreter for a new venv (default python3; TF 2.21
# wheels exist for CPython 3.10-3.13). Then pass the same path to the benchmarks if it is not
# the default: `benchmarks/decode.py --hf-venv VENV`, `benchmarks/throughput.py --hf-venv VENV`.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-${HF_TF_VENV:-$root/benchmarks/.venv-hf-tf}}"
requirements="$here/requirements-hf-tf.txt"
python="${PYTHON:-python3}"

# Exit 0 when every pin in the requirements file is installed in the venv (`==` pins, `*`
# wildcards allowed), else print what differs and exit 1.
pins_met() {
    "$venv/bin/python" - "$requirements" <<'PY'
import fnmatch, sys
from importlib import metadata

bad = []
for line in open(sys.argv[1]):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, _, wanted = line.partition("==")
    try:
        have = metadata.version(name.strip())
    except metadata.PackageNotFoundError:
        have = None
    if have is None or not fnmatch.fnmatch(have, wanted.strip()):
        bad.append(f"{name.strip()}: want {wanted.strip()}, have {have}")
print("\n".join(bad) if bad else "pins met")
sys.exit(1 if bad else 0)
PY
}

if [[ -x "$venv/bin/python" ]] && pins_met >/dev/null 2>&1; then
    echo "HF TF peer venv $venv is ready: $(pins_met)"
else
    if [[ ! -x "$venv/bin/python" ]]; then
        echo "creating $venv with $("$python" --version 2>&1)"
        "$python" -m venv "$venv"
    else
        echo "updating $venv:"
        pins_met || true
    fi
    "$venv/bin/python" -m pip install --upgrade --quiet pip
    "$venv/bin/python" -m pip install --quiet -r "$requirements"
    pins_met
fi

# Smoke test: TF and transformers' TF GPT-2 import (TF's startup log is shown only on failure).
log="$(mktemp)"
if ! "$venv/bin/python" - 2>"$log" <<'PY'
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
import transformers
from transformers import TFGPT2LMHeadModel  # noqa: F401 - fails here if the TF port is broken

print(f"tensorflow {tf.__version__}, transformers {transformers.__version__}: TFGPT2LMHeadModel OK")
PY
then
    cat "$log" >&2
    rm -f "$log"
    echo "the HF TF peer venv $venv does not work" >&2
    exit 1
fi
rm -f "$log"
echo "run the peer with: $venv/bin/python $here/hf_tf_xla.py --help"
