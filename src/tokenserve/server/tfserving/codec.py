"""Tensors at the TF Serving edge: JSON (row/columnar, b64) and TensorProto <-> NumPy.

JSON rules and error messages follow TF Serving's json_tensor: a JSON value must match the
signature's dtype exactly (an int32 input takes JSON integers only, a float input refuses a
value it cannot hold without loss), every instance must have the same shape, and string
tensors take `{"b64": ...}` objects; outputs named `*_bytes` come back base64-encoded.

A tensor that cannot be built is TF Serving's `tensor parsing error: <alias>` (what
`Tensor::FromProto` failing gives), raised before anything large is allocated: a TensorProto
is checked against its declared shape first (a 44-byte request declaring 2^26 elements with
one value is refused, not expanded), and a JSON value nested deeper than the dimensions a
tensor can have is refused before it is walked.
"""

from __future__ import annotations

import base64
import binascii
import json

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2

from tokenserve.errors import InvalidRequestError
from tokenserve.lifecycle.savedmodel import dtype_string

MAX_DIMS = 64
"""Dimensions of one tensor. TensorFlow allows 254; NumPy, which carries tensors here, 64."""
MAX_FILL_ELEMENTS = 1 << 20
"""A TensorProto may send fewer values than its shape holds (TF repeats the last one, as
`tf.make_tensor_proto(0.0, shape=[...])` relies on); such a fill may expand to at most this
many elements, so a tiny request cannot make the server allocate gigabytes."""


class TensorParsingError(InvalidRequestError):
    """A request tensor that does not form a tensor (TF Serving: `tensor parsing error`)."""

    def __init__(self, name: str, detail: str = ""):
        super().__init__(f"tensor parsing error: {name}" + (f" ({detail})" if detail else ""))


_INT_RANGES = {tf.int8: (-2**7, 2**7 - 1), tf.int16: (-2**15, 2**15 - 1),
               tf.int32: (-2**31, 2**31 - 1), tf.uint8: (0, 2**8 - 1),
               tf.int64: (-2**63, 2**63 - 1), tf.uint32: (0, 2**32 - 1),
               tf.uint64: (0, 2**64 - 1)}


def invalid(message: str) -> InvalidRequestError:
    return InvalidRequestError(message)


def compact(value) -> str:
    """rapidjson's one-line rendering of a JSON value, for error messages."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        return "<nested too deeply to print>"


def json_type(value) -> str:
    if value is None:
        return "Null"
    if value is True:
        return "True"
    if value is False:
        return "False"
    if isinstance(value, dict):
        return "Object"
    if isinstance(value, list):
        return "Array"
    if isinstance(value, str):
        return "String"
    return "Number"


def status_text(message: str) -> str:
    """absl::Status::ToString() of an INVALID_ARGUMENT, as nested in TF Serving's messages."""
    return f"INVALID_ARGUMENT: {message}"


def is_b64(value) -> bool:
    return isinstance(value, dict) and len(value) == 1 and isinstance(value.get("b64"), str)


def decode_b64(value) -> bytes:
    if not is_b64(value):
        raise invalid(f"JSON Value: {compact(value)} not formatted correctly for base64 data")
    try:
        return base64.b64decode(value["b64"], validate=True)
    except (binascii.Error, ValueError):
        raise invalid("Unable to base64 decode") from None


def _type_error(value, dtype: tf.DType) -> InvalidRequestError:
    return invalid(f"JSON Value: {compact(value)} Type: {json_type(value)} is not of "
                   f"expected type: {dtype_string(dtype)}")


def _scalar(value, dtype: tf.DType):
    if isinstance(value, dict):
        return decode_b64(value) if dtype == tf.string else _raise(_type_error(value, dtype))
    if dtype == tf.string:
        return value.encode() if isinstance(value, str) else _raise(_type_error(value, dtype))
    if dtype == tf.bool:
        return value if isinstance(value, bool) else _raise(_type_error(value, dtype))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(value, dtype)
    if dtype.is_floating:
        digits = 53 if dtype == tf.float64 else 24
        if isinstance(value, int) and abs(value) > 2**digits - 1:
            target = "double" if dtype == tf.float64 else "float"
            raise invalid(f"Cannot convert JSON value: {compact(value)} to {target} without "
                          f"loss of precision.")
        return float(value)
    low, high = _INT_RANGES.get(dtype, (None, None))
    if low is None:
        raise invalid(f"Conversion of JSON Value: {compact(value)} to type: {dtype_string(dtype)}")
    if not isinstance(value, int) or not low <= value <= high:
        raise _type_error(value, dtype)
    return value


def _raise(error: Exception):
    raise error


def _dense_shape(value, limit: int) -> list[int]:
    shape = []
    while isinstance(value, list) and len(shape) < limit:
        shape.append(len(value))
        if not value:
            break
        value = value[0]
    return shape


def _fill(value, level: int, shape: list[int], dtype: tf.DType, out: list) -> None:
    if not isinstance(value, list):
        if level != len(shape):
            raise invalid(f"JSON Value: {compact(value)} found at incorrect level: {level + 1} "
                          f"in the JSON DOM. Expected at level: {len(shape)}")
        out.append(_scalar(value, dtype))
        return
    if level >= len(shape):
        raise invalid(f"Encountered list at unexpected level: {level} expected < {len(shape)}")
    if len(value) != shape[level]:
        raise invalid(f"Encountered list at unexpected size: {len(value)} at level: {level} "
                      f"expected size: {shape[level]}")
    for item in value:
        _fill(item, level + 1, shape, dtype, out)


def json_to_array(value, dtype: tf.DType, name: str = "", max_dims: int = MAX_DIMS
                  ) -> np.ndarray:
    """One JSON value (scalar or nested lists) as an array of the signature's dtype."""
    shape = _dense_shape(value, max_dims + 1)
    if len(shape) > max_dims:
        raise TensorParsingError(name, f"more than {max_dims} dimensions")
    flat: list = []
    _fill(value, 0, shape, dtype, flat)
    if dtype == tf.string:
        array = np.empty(len(flat), dtype=object)
        array[:] = flat
    else:
        array = np.array(flat, dtype=dtype.as_numpy_dtype)
    return array.reshape(shape)


def instances_to_arrays(instances: list, input_dtypes: dict[str, tf.DType]) -> dict:
    """Row format: `instances` batched into one array per input (TF Serving's rules)."""
    if not isinstance(instances[0], dict) and len(input_dtypes) > 1:
        raise invalid("instances is a plain list, but expecting list of objects as multiple "
                      "input tensors required as per tensorinfo_map")
    objects = isinstance(instances[0], dict) and not is_b64(instances[0])
    names = sorted(input_dtypes)
    columns: dict[str, list[np.ndarray]] = {}
    for index, element in enumerate(instances):
        if objects:
            if not isinstance(element, dict) or is_b64(element):
                raise invalid(f"Expecting object but got list at item {index} of input list")
            for name, item in element.items():
                try:
                    _add_instance(item, name, input_dtypes, columns)
                except TensorParsingError:
                    raise
                except InvalidRequestError as error:
                    raise invalid(f"Failed to process element: {index} key: {name} of "
                                  f"'instances' list. Error: {status_text(str(error))}") from None
            if set(element) != set(names):
                raise invalid(f"Failed to process element: {index} of 'instances' list. JSON "
                              f"object: {compact(element)} must only have keys: "
                              f"{','.join(names)}")
        else:
            if isinstance(element, dict) and not is_b64(element):
                raise invalid(f"Expecting value/list but got object at item {index} of "
                              f"input list")
            try:
                _add_instance(element, names[0], input_dtypes, columns)
            except TensorParsingError:
                raise
            except InvalidRequestError as error:
                raise invalid(f"Failed to process element: {index} of 'instances' list. "
                              f"Error: {status_text(str(error))}") from None
    return {name: np.stack(arrays) for name, arrays in columns.items()}


def _add_instance(item, name: str, input_dtypes: dict, columns: dict) -> None:
    if name not in input_dtypes:
        raise invalid(f"JSON object: does not have named input: {name}")
    # The batch adds a dimension to each instance's.
    array = json_to_array(item, input_dtypes[name], name, MAX_DIMS - 1)
    previous = columns.setdefault(name, [])
    if previous:
        first = previous[0]
        if first.size != array.size:
            raise invalid(f"Expecting tensor size: {first.size} but got: {array.size}")
        if first.shape != array.shape:
            raise invalid(f"Expecting shape [{','.join(map(str, first.shape))}] but got: "
                          f"[{','.join(map(str, array.shape))}]")
    previous.append(array)


def inputs_to_arrays(inputs, input_dtypes: dict[str, tf.DType]) -> dict:
    """Columnar format: `inputs` as one value (single input) or an object of named values."""
    if not isinstance(inputs, dict) or is_b64(inputs):
        if len(input_dtypes) > 1:
            raise invalid("inputs is a plain value/list, but expecting an object as multiple "
                          "input tensors required as per tensorinfo_map")
        name = next(iter(input_dtypes))
        return {name: json_to_array(inputs, input_dtypes[name], name)}
    arrays = {}
    for name in sorted(input_dtypes):
        if name not in inputs:
            raise invalid(f"Missing named input: {name} in 'inputs' object.")
        arrays[name] = json_to_array(inputs[name], input_dtypes[name], name)
    return arrays


# ---- TensorProto ------------------------------------------------------------------------

def _value_field(dtype: tf.DType) -> str | None:
    """The repeated field of TensorProto that holds `dtype`'s values (complex: two each)."""
    return _VALUE_FIELDS.get(dtype) or {tf.float16: "half_val", tf.bfloat16: "half_val",
                                        tf.complex64: "scomplex_val",
                                        tf.complex128: "dcomplex_val"}.get(dtype)


def _values_sent(proto, dtype: tf.DType) -> int:
    """How many elements the typed value field of a TensorProto holds."""
    field = _value_field(dtype)
    if field is None:
        return -1
    count = len(getattr(proto, field))
    return count // 2 if dtype.is_complex else count


def _first_values(proto, dtype: tf.DType, elements: int):
    """A copy of `proto` with only its first `elements` values: TF's Tensor::FromProto reads
    that many and ignores the rest, where make_ndarray failed on a negative pad."""
    field = _value_field(dtype)
    kept = type(proto)()
    kept.CopyFrom(proto)
    values = getattr(kept, field)
    del values[elements * (2 if dtype.is_complex else 1):]
    return kept


def tensor_proto_to_array(name: str, proto) -> np.ndarray:
    """A request TensorProto as an array, checked against its declared shape before any
    allocation (see MAX_DIMS and MAX_FILL_ELEMENTS)."""
    shape = proto.tensor_shape
    dims = [dim.size for dim in shape.dim]
    if shape.unknown_rank or any(size < 0 for size in dims):
        raise TensorParsingError(name, "the shape is not fully defined")
    if len(dims) > MAX_DIMS:
        raise TensorParsingError(name, f"more than {MAX_DIMS} dimensions")
    try:
        dtype = tf.dtypes.as_dtype(proto.dtype)
    except TypeError:
        raise TensorParsingError(name, "unknown dtype") from None
    if dtype in (tf.resource, tf.variant) or dtype._is_ref_dtype or proto.dtype == 0:
        raise TensorParsingError(name, f"dtype {dtype_string(dtype)} cannot be sent")
    elements = 1
    for size in dims:
        elements *= size
    if proto.tensor_content:
        itemsize = np.dtype(dtype.as_numpy_dtype).itemsize
        if dtype == tf.string or len(proto.tensor_content) != elements * itemsize:
            raise TensorParsingError(name, f"tensor_content holds {len(proto.tensor_content)} "
                                           f"bytes for {elements} elements")
    else:
        sent = _values_sent(proto, dtype)
        if 0 <= sent < elements and elements > MAX_FILL_ELEMENTS:
            raise TensorParsingError(name, f"{sent} values for {elements} elements; filling "
                                           f"more than {MAX_FILL_ELEMENTS} is refused")
        if sent > elements:
            proto = _first_values(proto, dtype, elements)
    try:
        try:
            return tf.make_ndarray(proto)
        except OverflowError:  # NumPy 2 refuses what TensorFlow's C++ casts
            return tf.make_ndarray(_wrapped_to_width(name, proto, dtype))
    except (TypeError, ValueError) as error:
        raise TensorParsingError(name, str(error)) from None


_NARROW = {tf.int8: (8, True), tf.qint8: (8, True), tf.uint8: (8, False),
           tf.quint8: (8, False), tf.int16: (16, True), tf.qint16: (16, True),
           tf.uint16: (16, False), tf.quint16: (16, False)}
"""Dtypes whose values travel in a wider field (int_val is int32): (bits, signed)."""


def _wrapped_to_width(name: str, proto, dtype: tf.DType):
    """A copy of `proto` whose int_val (narrow integers) or half_val (float16 and bfloat16
    bits) are cast to the dtype's width as TF's Tensor::FromProto does, with a C++
    static_cast: 300 as int8 is 44, -1 as uint8 is 255, a half_val of 70000 is bits 4464.
    make_ndarray under NumPy 2 raises OverflowError on them instead, which was a 500."""
    if dtype in (tf.float16, tf.bfloat16):
        field, (bits, signed) = "half_val", (16, False)
    elif dtype in _NARROW:
        field, (bits, signed) = "int_val", _NARROW[dtype]
    else:
        raise TensorParsingError(name, f"values out of range for {dtype_string(dtype)}")
    values = np.array(getattr(proto, field), np.int64) & ((1 << bits) - 1)
    if signed:
        values = np.where(values >= 1 << (bits - 1), values - (1 << bits), values)
    wrapped = type(proto)()
    wrapped.CopyFrom(proto)
    getattr(wrapped, field)[:] = values.tolist()
    return wrapped


# Which repeated field of TensorProto holds each dtype's values (TF's Tensor::AsProtoField).
_VALUE_FIELDS = {tf.float32: "float_val", tf.float64: "double_val", tf.int32: "int_val",
                 tf.int16: "int_val", tf.int8: "int_val", tf.uint8: "int_val",
                 tf.uint16: "int_val", tf.int64: "int64_val", tf.uint32: "uint32_val",
                 tf.uint64: "uint64_val", tf.bool: "bool_val", tf.string: "string_val"}


def array_to_tensor_proto(array: np.ndarray):
    """A TensorProto with values in the typed field (`float_val`, `int64_val`, ...).

    TF Serving answers this way by default (not `tensor_content`), and clients that read
    `outputs["y"].float_val` directly depend on it.
    """
    array = np.asarray(array)
    dtype = tf.string if array.dtype == object else tf.dtypes.as_dtype(array.dtype)
    field = _VALUE_FIELDS.get(dtype)
    if field is None:  # half, bfloat16, complex ...: TF's own encoding
        return tf.make_tensor_proto(array)
    proto = tensor_pb2.TensorProto(dtype=dtype.as_datatype_enum,
                                   tensor_shape=tf.TensorShape(array.shape).as_proto())
    values = array.reshape(-1)
    if dtype == tf.string:
        getattr(proto, field).extend(bytes(v) if not isinstance(v, str) else v.encode()
                                     for v in values)
    else:
        getattr(proto, field).extend(values.tolist())
    return proto
