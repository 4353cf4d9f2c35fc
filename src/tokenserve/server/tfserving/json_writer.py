"""TF Serving's REST output format, byte for byte.

TF Serving writes responses with rapidjson's PrettyWriter (4-space indent), switching to
single-line arrays inside each prediction, and writes floats through its own decimal
formatting (`2.0`, not `2`; shortest form that round-trips; `NaN`, `Infinity`). Clients that
diff responses, or parse them with strict number typing, see the same bytes from us.
"""

from __future__ import annotations

import json

import numpy as np

_INDENT = "    "


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
    """TF Serving's REST error body: `{ "error": "<message>" }`."""
    return '{ "error": ' + json.dumps(message, ensure_ascii=False) + " }"
