"""TF Serving's REST output format, byte for byte.

TF Serving writes responses with rapidjson's PrettyWriter (4-space indent), switching to
single-line arrays inside each prediction, and writes floats through its own decimal
formatting (`2.0`, not `2`; shortest form that round-trips; `NaN`, `Infinity`). Clients that
diff responses, or parse them with strict number typing, see the same bytes from us.
"""

from __future__ import annotations

import base64
import json

import numpy as np

from tokenserve.errors import InvalidRequestError

_INDENT = "    "
BYTES_SUFFIX = "_bytes"  # string outputs named *_bytes are written as {"b64": ...}


def format_decimal(value: float, single_precision: bool) -> str:
    """A float as TF Serving prints it: %g, else max_digits10, plus `.0` for whole numbers."""
    value = float(value)
    if np.isnan(value):
        return "NaN"
    if np.isinf(value):
        return "-Infinity" if value < 0 else "Infinity"
    cast = np.float32 if single_precision else np.float64
    text = f"{value:g}"
    if cast(float(text)) != cast(value):
        text = f"{value:.9g}" if single_precision else f"{value:.17g}"
    if "." not in text and "e" not in text:
        text += ".0"
    return text


class PrettyWriter:
    """The subset of rapidjson::PrettyWriter that TF Serving's REST handler uses."""

    def __init__(self):
        self._out: list[str] = []
        self._levels: list[list] = []  # [value_count, in_array]
        self.single_line_arrays = False

    def _indent(self) -> None:
        self._out.append(_INDENT * len(self._levels))

    def _prefix(self) -> None:
        if not self._levels:
            return
        level = self._levels[-1]
        if level[1]:
            if level[0] > 0:
                self._out.append(", " if self.single_line_arrays else ",")
            if not self.single_line_arrays:
                self._out.append("\n")
                self._indent()
        else:
            if level[0] > 0:
                self._out.append(",\n" if level[0] % 2 == 0 else ": ")
            else:
                self._out.append("\n")
            if level[0] % 2 == 0:
                self._indent()
        level[0] += 1

    def raw(self, text: str) -> None:
        self._prefix()
        self._out.append(text)

    def key(self, name: str) -> None:
        self.raw(json.dumps(name, ensure_ascii=False))

    def start_object(self) -> None:
        self._prefix()
        self._out.append("{")
        self._levels.append([0, False])

    def end_object(self) -> None:
        empty = self._levels.pop()[0] == 0
        if not empty:
            self._out.append("\n")
            self._indent()
        self._out.append("}")

    def start_array(self) -> None:
        self._prefix()
        self._out.append("[")
        self._levels.append([0, True])

    def end_array(self) -> None:
        empty = self._levels.pop()[0] == 0
        if not empty and not self.single_line_arrays:
            self._out.append("\n")
            self._indent()
        self._out.append("]")

    def text(self) -> str:
        return "".join(self._out)


def error_body(message: str) -> str:
    """TF Serving's REST error body, `{"error": message}` through the same pretty writer."""
    writer = PrettyWriter()
    writer.start_object()
    writer.key("error")
    writer.key(message)
    writer.end_object()
    return writer.text()


# ---- Predict outputs ------------------------------------------------------------------------

def _write_scalar(writer: PrettyWriter, value, as_bytes: bool) -> None:
    if isinstance(value, (bytes, np.bytes_)):
        if as_bytes:
            writer.start_object()
            writer.key("b64")
            writer.raw(json.dumps(base64.b64encode(bytes(value)).decode()))
            writer.end_object()
        else:
            writer.raw(json.dumps(bytes(value).decode("utf-8", "replace"), ensure_ascii=False))
    elif isinstance(value, (bool, np.bool_)):
        writer.raw("true" if value else "false")
    elif isinstance(value, (np.floating, float)):
        writer.raw(format_decimal(value, np.asarray(value).dtype != np.float64))
    else:
        writer.raw(str(int(value)))


def _write_values(writer: PrettyWriter, value, as_bytes: bool) -> None:
    if isinstance(value, np.ndarray) and value.ndim > 0:
        writer.start_array()
        for item in value:
            _write_values(writer, item, as_bytes)
        writer.end_array()
    else:
        _write_scalar(writer, value[()] if isinstance(value, np.ndarray) else value, as_bytes)


def _is_bytes_output(name: str, array: np.ndarray) -> bool:
    return array.dtype == object and name.endswith(BYTES_SUFFIX)


def _writable(array) -> np.ndarray:
    """An output as the writer can print it. bfloat16 and the float8 types are ml_dtypes
    types that numpy does not count as floating (kind "V"), so their scalars would print
    through int() and lose their fraction: they are widened to float32, exactly. Complex
    values have no JSON form: TF Serving refuses them with this message, and so do we,
    rather than drop the imaginary part."""
    array = np.asarray(array)
    if array.dtype.kind == "c":
        raise InvalidRequestError(
            f"Failed to write JSON value for tensor type: {array.dtype.name}")
    if array.dtype.kind == "V":
        try:
            return array.astype(np.float32)
        except (TypeError, ValueError):
            raise InvalidRequestError(
                f"Failed to write JSON value for tensor type: {array.dtype.name}") from None
    return array


def row_json(outputs: dict[str, np.ndarray]) -> str:
    """`{"predictions": [...]}`: one entry per batch row, an object when several outputs."""
    outputs = {name: _writable(array) for name, array in outputs.items()}
    batch = 0
    for name, array in sorted(outputs.items()):
        if array.ndim == 0:
            raise InvalidRequestError(f"Tensor name: {name} has no shape information ")
        if array.shape[0] < 1:
            raise InvalidRequestError(f"Tensor name: {name} has invalid batch size: {array.shape[0]}")
        if batch and array.shape[0] != batch:
            raise InvalidRequestError(f"Tensor name: {name} has inconsistent batch size: "
                          f"{array.shape[0]} expecting: {batch}")
        batch = array.shape[0]
    writer = PrettyWriter()
    writer.start_object()
    writer.key("predictions")
    writer.start_array()
    several = len(outputs) > 1
    for row in range(batch):
        if several:
            writer.start_object()
        writer.single_line_arrays = True
        for name, array in sorted(outputs.items()):
            if several:
                writer.key(name)
            _write_values(writer, array[row], _is_bytes_output(name, array))
        writer.single_line_arrays = False
        if several:
            writer.end_object()
    writer.end_array()
    writer.end_object()
    return writer.text()


def columnar_json(outputs: dict[str, np.ndarray]) -> str:
    """`{"outputs": ...}`: the tensor itself, or an object of named tensors."""
    outputs = {name: _writable(array) for name, array in outputs.items()}
    writer = PrettyWriter()
    writer.start_object()
    writer.key("outputs")
    several = len(outputs) > 1
    if several:
        writer.start_object()
    for name, array in sorted(outputs.items()):
        if several:
            writer.key(name)
        _write_values(writer, array, _is_bytes_output(name, array))
    if several:
        writer.end_object()
    writer.end_object()
    return writer.text()


def classification_json(result) -> str:
    """`{"results": [[[label, score], ...], ...]}`, one single-line list per example."""
    writer = PrettyWriter()
    writer.start_object()
    writer.key("results")
    writer.start_array()
    for classifications in result.classifications:
        writer.single_line_arrays = True
        writer.start_array()
        for entry in classifications.classes:
            writer.start_array()
            writer.key(entry.label)
            writer.raw(format_decimal(entry.score, True))
            writer.end_array()
        writer.end_array()
        writer.single_line_arrays = False
    writer.end_array()
    writer.end_object()
    return writer.text()


def regression_json(result) -> str:
    """`{"results": [v, ...]}` on one line, as TF Serving writes it."""
    writer = PrettyWriter()
    writer.start_object()
    writer.key("results")
    writer.single_line_arrays = True  # and left on to the end, as in TF Serving
    writer.start_array()
    for regression in result.regressions:
        writer.raw(format_decimal(regression.value, True))
    writer.end_array()
    writer.end_object()
    return writer.text()
