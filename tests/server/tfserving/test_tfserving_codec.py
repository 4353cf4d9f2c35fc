"""TF Serving JSON rules and output bytes, without a server."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import tensor_pb2

from tokenserve.errors import InvalidRequestError
from tokenserve.server.tfserving import codec
from tokenserve.server.tfserving.json_writer import (columnar_json, error_body, format_decimal,
                                                     row_json)


def test_half_plus_two_bytes_match_tf_serving():
    # The response TF Serving's REST docs show for half_plus_two.
    body = row_json({"y": np.array([2.5, 3.0, 4.5], np.float32)})
    assert body == '{\n    "predictions": [2.5, 3.0, 4.5\n    ]\n}'


def test_row_format_with_several_outputs_and_bytes():
    body = row_json({"n": np.array([[1, 2], [3, 4]], np.int32),
                           "text_bytes": np.array([b"a", b"\xff"], dtype=object)})
    assert body.startswith('{\n    "predictions": [\n        {\n            "n": [1, 2],')
    import json
    assert json.loads(body) == {"predictions": [{"n": [1, 2], "text_bytes": {"b64": "YQ=="}},
                                                {"n": [3, 4], "text_bytes": {"b64": "/w=="}}]}


def test_columnar_format():
    import json
    body = columnar_json({"y": np.array([[1.0, 2.0]], np.float32)})
    assert json.loads(body) == {"outputs": [[1.0, 2.0]]}
    assert json.loads(columnar_json({"a": np.array(1, np.int64),
                                           "b": np.array([True])})) == {"outputs": {"a": 1,
                                                                                    "b": [True]}}


def test_narrow_float_outputs_are_written_as_decimals_and_complex_is_refused():
    import json

    import ml_dtypes

    for dtype in (tf.bfloat16.as_numpy_dtype, ml_dtypes.float8_e4m3fn, np.float16):
        values = np.array([3.75, -1.5], dtype)
        assert json.loads(columnar_json({"y": values})) == {"outputs": [3.75, -1.5]}
        assert json.loads(row_json({"y": values})) == {"predictions": [3.75, -1.5]}
        assert columnar_json({"y": np.array(2, dtype)}).endswith('"outputs": 2.0\n}')
    with pytest.raises(InvalidRequestError,
                       match="^Failed to write JSON value for tensor type: complex64$"):
        columnar_json({"z": np.array([1 + 2j], np.complex64)})
    with pytest.raises(InvalidRequestError, match="complex128"):
        row_json({"y": np.array([1.0], np.float32), "z": np.array([1j])})


@pytest.mark.parametrize("value, single, text", [
    (2.0, True, "2.0"), (0.1, True, "0.1"), (1 / 3, True, "0.333333343"), (1e7, True, "1e+07"),
    (float("nan"), True, "NaN"), (float("-inf"), False, "-Infinity"),
    (0.1, False, "0.1"), (1 / 3, False, "0.33333333333333331")])
def test_decimal_format(value, single, text):
    assert format_decimal(np.float32(value) if single else value, single) == text


def test_error_body():
    assert error_body('bad "x"') == '{\n    "error": "bad \\"x\\""\n}'


def test_instances_batch_and_b64():
    arrays = codec.instances_to_arrays([{"a": [1, 2], "s": {"b64": "aGk="}},
                                        {"a": [3, 4], "s": "yo"}],
                                       {"a": tf.int64, "s": tf.string})
    assert arrays["a"].tolist() == [[1, 2], [3, 4]] and arrays["a"].dtype == np.int64
    assert arrays["s"].tolist() == [b"hi", b"yo"]


@pytest.mark.parametrize("instances, dtypes, message", [
    ([[1, 2], [3]], {"x": tf.int32},
     "Failed to process element: 1 of 'instances' list. Error: INVALID_ARGUMENT: Expecting "
     "tensor size: 2 but got: 1"),
    ([[1, 2], [[3], [4]]], {"x": tf.int32},
     "Failed to process element: 1 of 'instances' list. Error: INVALID_ARGUMENT: Expecting "
     "shape [2] but got: [2,1]"),
    ([1.5], {"x": tf.int32},
     "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: JSON Value: "
     "1.5 Type: Number is not of expected type: int32"),
    (["a"], {"x": tf.float32},
     'Error: INVALID_ARGUMENT: JSON Value: "a" Type: String is not of expected type: float'),
    ([16777217], {"x": tf.float32}, "Cannot convert JSON value: 16777217 to float without loss"),
    ([1, 2], {"a": tf.int32, "b": tf.int32},
     "instances is a plain list, but expecting list of objects"),
    ([{"a": 1}], {"a": tf.int32, "b": tf.int32}, "must only have keys: a,b"),
])
def test_instances_errors(instances, dtypes, message):
    with pytest.raises(InvalidRequestError) as raised:
        codec.instances_to_arrays(instances, dtypes)
    assert message in str(raised.value)
    assert "float32" not in str(raised.value)  # TF's DataTypeString names, as TF Serving


def test_columnar_inputs_errors():
    with pytest.raises(InvalidRequestError, match="Missing named input: b in 'inputs' object."):
        codec.inputs_to_arrays({"a": [1]}, {"a": tf.int32, "b": tf.int32})
    with pytest.raises(InvalidRequestError, match="Encountered list at unexpected size: 1 at "
                                                  "level: 1 expected size: 2"):
        codec.inputs_to_arrays([[1, 2], [3]], {"a": tf.int32})


# ---- request tensors are checked against their declared shape first --------------------------
# (docs/migrating-from-tf-serving.md#how-a-request-runs)

def test_tensor_proto_fill_within_the_limit_follows_tensorflow():
    proto = tf.make_tensor_proto(1.5, shape=[2, 3])  # one value, six elements
    assert len(proto.float_val) == 1
    assert codec.tensor_proto_to_array("x", proto).tolist() == [[1.5] * 3] * 2


@pytest.mark.parametrize("dtype, field, values", [
    (tf.int8, "int_val", [300, -129, 5]), (tf.uint8, "int_val", [-1, 256, 7]),
    (tf.int16, "int_val", [40000, -40000]), (tf.uint16, "int_val", [-1, 70000]),
    (tf.float16, "half_val", [-1, 70000, 15360]), (tf.bfloat16, "half_val", [-1, 70000, 16256]),
    (tf.qint8, "int_val", [300]), (tf.quint8, "int_val", [-3])])
def test_values_wider_than_their_dtype_are_cast_as_tensorflow_casts_them(dtype, field, values):
    """int_val (int32) and half_val carry narrower dtypes; TensorFlow's C++ parse casts an
    out-of-range value to the width (static_cast), where make_ndarray under NumPy 2 raised
    OverflowError: a gRPC INTERNAL. TensorFlow's own parse (tf.io.parse_tensor) decides."""
    proto = tensor_pb2.TensorProto(dtype=dtype.as_datatype_enum)
    proto.tensor_shape.dim.add().size = 4  # fewer values than elements: the last repeats
    getattr(proto, field).extend(values)
    ours = codec.tensor_proto_to_array("x", proto)
    theirs = tf.io.parse_tensor(proto.SerializeToString(), dtype)
    if dtype.is_quantized:
        ours = ours.view(np.dtype(dtype.as_numpy_dtype)[0])
        theirs = tf.bitcast(theirs, {tf.qint8: tf.int8, tf.quint8: tf.uint8}[dtype])
    np.testing.assert_array_equal(ours.view(np.uint16) if dtype.is_floating else ours,
                                  theirs.numpy().view(np.uint16) if dtype.is_floating
                                  else theirs.numpy())


@pytest.mark.parametrize("dtype, field, values", [
    (tf.float32, "float_val", [1.0, 2.0, 3.0]), (tf.string, "string_val", [b"a", b"b", b"c"]),
    (tf.complex64, "scomplex_val", [1, 2, 3, 4, 5, 6]), (tf.uint16, "int_val", [-7, 8, 9])])
def test_more_values_than_elements_keep_the_first_as_tensorflow_does(dtype, field, values):
    """TF's parse reads as many values as the shape holds and ignores the rest; make_ndarray
    failed on them ("index can't contain negative values")."""
    proto = tensor_pb2.TensorProto(dtype=dtype.as_datatype_enum)
    proto.tensor_shape.dim.add().size = 2
    getattr(proto, field).extend(values)
    np.testing.assert_array_equal(codec.tensor_proto_to_array("x", proto),
                                  tf.io.parse_tensor(proto.SerializeToString(), dtype).numpy())


def test_tensor_proto_checks_before_allocating():
    huge = tf.make_tensor_proto(1.0, shape=[1, 2**26])
    with pytest.raises(codec.TensorParsingError, match=r"^tensor parsing error: x \(1 values "
                                                       r"for 67108864 elements; filling more "
                                                       r"than 1048576 is refused\)$"):
        codec.tensor_proto_to_array("x", huge)
    short = tf.make_tensor_proto(np.zeros(4, np.float32))
    short.tensor_content = short.tensor_content[:-4]
    with pytest.raises(codec.TensorParsingError, match=r"^tensor parsing error: x \(tensor_"
                                                       r"content holds 12 bytes for 4 "):
        codec.tensor_proto_to_array("x", short)
    unknown = tf.make_tensor_proto(np.zeros(2, np.float32))
    unknown.tensor_shape.dim[0].size = -1
    with pytest.raises(codec.TensorParsingError, match="not fully defined"):
        codec.tensor_proto_to_array("x", unknown)


def test_json_deeper_than_a_tensor_can_be_is_a_tensor_parsing_error():
    value = 1.0
    for _ in range(900):
        value = [value]
    with pytest.raises(codec.TensorParsingError, match=r"^tensor parsing error: x \(more than "
                                                       r"63 dimensions\)$"):
        codec.instances_to_arrays([value], {"x": tf.float32})
    with pytest.raises(codec.TensorParsingError, match=r"^tensor parsing error: x \(more than "
                                                       r"64 dimensions\)$"):
        codec.inputs_to_arrays(value, {"x": tf.float32})
    deepest = 1.0
    for _ in range(63):
        deepest = [deepest]
    assert codec.instances_to_arrays([deepest], {"x": tf.float32})["x"].ndim == 64
