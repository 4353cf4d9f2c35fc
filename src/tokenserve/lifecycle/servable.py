"""What the manager loads: a servable runs named signatures on NumPy arrays.

Frontends (TF Serving gRPC/REST, warmup replay) convert protobuf and JSON at the edge and talk
to servables in NumPy only. Signature metadata is TF's `SignatureDef` proto, which is what
GetModelMetadata returns verbatim.

The request rules here are TF Serving's `predict_util.cc` and TensorFlow's
`saved_model::GetInputValues`, in their order and with their texts: a signature is looked up
by name, the number of inputs is checked (fewer are allowed only when the signature has
defaults), every signature input is taken from the request or its default, unknown names
are refused, and the output filter names existing, distinct aliases. Shapes are not checked
against the SignatureDef: TF Serving feeds the tensor to the session as it is, so a `[3]`
tensor reaches an input declared `[?,1]`, and only the graph decides.
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
            output_keys: list[str] | None = None,
            timeout_s: float | None = None) -> dict[str, np.ndarray]:
        """Runs one signature; raises InvalidRequestError for bad names or values, and
        DeadlineExceededError when `timeout_s` passes before the run ends (the run is then
        cancelled, not left computing)."""

    def close(self) -> None:
        """Frees the model; called once, after in-flight requests drained."""


def signature_def(servable: Servable, signature_name: str):
    """The named SignatureDef, or TF Serving's error for a missing one."""
    name = signature_name or DEFAULT_SIGNATURE
    try:
        return servable.signature_defs[name]
    except KeyError:
        raise FailedPreconditionError(f"Serving signature key \"{name}\" not found.") from None


def _braces(names) -> str:
    return "{" + ",".join(sorted(names)) + "}"


def check_inputs_size(signature_def_proto, sent_names) -> None:
    """predict_util's VerifyRequestInputsSize: more inputs than the signature has, or fewer
    when it has no defaults, is refused with the sets spelled out."""
    sent = set(sent_names)
    expected = set(signature_def_proto.inputs)
    if len(sent) > len(expected) or (len(sent) < len(expected)
                                     and not signature_def_proto.defaults):
        raise InvalidRequestError(
            f"input size does not match signature: {len(sent)}!={len(expected)} "
            f"len({_braces(sent)}) != len({_braces(expected)}). Sent extra: "
            f"{_braces(sent - expected)}. Missing but required: {_braces(expected - sent)}.")


def resolve_inputs(signature_def_proto, inputs: dict, defaults: dict | None = None
                   ) -> dict[str, np.ndarray]:
    """TensorFlow's GetInputValues: signature alias -> the value to feed, taken from the
    request or else from the signature's defaults (decoded once, at load).

    Returns {tensor name (`x:0`): value}; raises with TF's texts for a missing input
    without a default, and for request names the signature does not have.
    """
    check_inputs_size(signature_def_proto, inputs)
    defaults = defaults or {}
    feeds = {}
    used = []
    for alias in sorted(signature_def_proto.inputs):
        feed_name = signature_def_proto.inputs[alias].name
        if alias in inputs:
            feeds[feed_name] = inputs[alias]
            used.append(alias)
        elif alias in defaults:
            feeds[feed_name] = defaults[alias]
        else:
            raise InvalidRequestError(
                f"Signature input alias: {alias}(feed name: {feed_name}) not found in request "
                f"and no default value provided. Inputs expected to be in the request "
                f"{_braces(inputs)}, or default input alias set: "
                f"{','.join(sorted(signature_def_proto.defaults))}")
    if inputs and len(used) != len(inputs):
        raise InvalidRequestError(f"Inputs contains invalid name. Used request inputs: "
                                  f"{','.join(sorted(used))}, request input: "
                                  f"{','.join(sorted(inputs))}")
    return feeds


def check_output_keys(signature_def_proto, output_keys: list[str] | None) -> list[str]:
    """The outputs to return: all of them, or the requested ones (each must exist, once)."""
    if not output_keys:
        return sorted(signature_def_proto.outputs)
    seen = set()
    for key in output_keys:
        if key not in signature_def_proto.outputs:
            raise InvalidRequestError(f"output tensor alias not found in signature: {key} "
                                      f"Outputs expected to be in the set "
                                      f"{_braces(signature_def_proto.outputs)}.")
        if key in seen:
            raise InvalidRequestError(f"duplicate output tensor alias: {key}")
        seen.add(key)
    return list(output_keys)
