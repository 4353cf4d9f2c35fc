"""What the manager loads: a servable runs named signatures on NumPy arrays.

Frontends (TF Serving gRPC/REST, warmup replay) convert protobuf and JSON at the edge and talk
to servables in NumPy only. Signature metadata is TF's `SignatureDef` proto, which is what
GetModelMetadata returns verbatim.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from tokenserve.errors import FailedPreconditionError, InvalidRequestError

PREDICT_METHOD = "tensorflow/serving/predict"
CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"
DEFAULT_SIGNATURE = "serving_default"


class Servable(Protocol):
    """A loaded model version."""

    path: Path
    signature_defs: dict
    """Signature name -> tensorflow.SignatureDef (inputs, outputs, method_name)."""

    def run(self, signature_name: str, inputs: dict[str, np.ndarray],
            output_keys: list[str] | None = None) -> dict[str, np.ndarray]:
        """Runs one signature; raises InvalidRequestError for bad names, dtypes or shapes."""

    def close(self) -> None:
        """Frees the model; called once, after in-flight requests drained."""


def signature_def(servable: Servable, signature_name: str):
    """The named SignatureDef, or TF Serving's error for a missing one."""
    name = signature_name or DEFAULT_SIGNATURE
    try:
        return servable.signature_defs[name]
    except KeyError:
        raise FailedPreconditionError(f"Serving signature key \"{name}\" not found.") from None


def check_input_keys(signature_def_proto, inputs: dict) -> None:
    """TF Serving's message for sent-vs-expected input names."""
    expected = set(signature_def_proto.inputs)
    sent = set(inputs)
    if sent != expected:
        def fmt(names):
            return "{" + ",".join(sorted(names)) + "}"
        raise InvalidRequestError(
            f"input size does not match signature: {len(sent)}!={len(expected)} "
            f"len({fmt(sent)}) != len({fmt(expected)}). Sent extra: {fmt(sent - expected)}. "
            f"Missing but required: {fmt(expected - sent)}.")


def check_input_shapes(signature_def_proto, inputs: dict) -> None:
    """Rank and known dimensions of each input against its TensorInfo shape."""
    for key, value in inputs.items():
        shape = signature_def_proto.inputs[key].tensor_shape
        if shape.unknown_rank:
            continue
        expected = [dim.size for dim in shape.dim]
        got = list(np.shape(value))
        if len(expected) != len(got) or any(e >= 0 and e != g for e, g in zip(expected, got)):
            def fmt(dims):
                return "[" + ",".join("?" if d < 0 else str(d) for d in dims) + "]"
            raise InvalidRequestError(f"Shape of tensor {key} {fmt(got)} is not compatible "
                                      f"with expected shape {fmt(expected)}")


def check_output_keys(signature_def_proto, output_keys: list[str] | None) -> list[str]:
    """The outputs to return: all of them, or the requested ones (each must exist)."""
    if not output_keys:
        return sorted(signature_def_proto.outputs)
    for index, key in enumerate(output_keys):
        if key in output_keys[:index]:
            raise InvalidRequestError(f"duplicate output tensor alias: {key}")
        if key not in signature_def_proto.outputs:
            raise InvalidRequestError(f"output tensor alias not found in signature: {key} "
                                      f"Outputs expected to be in the set "
                                      f"{{{','.join(sorted(signature_def_proto.outputs))}}}.")
    return list(output_keys)
