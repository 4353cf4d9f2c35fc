"""TF Serving's own test models, rebuilt in the test with tf.compat.v1 (no binary test data):

- `write_half_plus_two`: tensorflow_serving/servables/tensorflow/testdata/
  saved_model_half_plus_two.py (reference variables, a tf.Example parser, an asset file and a
  main_op, classify/regress/predict signatures; Predict's `x` is a `[?,1]` tensor).
- `write_half_plus_three`: saved_model_half_plus_three as old TF 1.x exporters wrote it:
  reference variables, a `[?,1]` placeholder and TensorInfos without shapes, with signatures
  named after their methods (`tensorflow/serving/regress`). `tf.saved_model.load` refuses it
  ("Shapes must be equal rank, but are 2 and 0"); tensorflow_model_server serves it.
- `write_counter`: saved_model_counter (export_counter.py): signatures that read and update
  a reference variable (`tf.saved_model.load` refuses reference-typed outputs).
- `write_tf2_classifier`: a TF2 `tf.saved_model.save` model whose classify and regress
  signatures carry the default method_name `tensorflow/serving/predict`.
- `write_defaults_model`: a SignatureDef with a default for one input (`defaults`).
- `write_keras_in_module`: a Keras 3 model held by a tf.Module, the shape of tokenserve's
  language-model exports, whose functions capture variables the TF1 saver does not restore.
- `write_tflite_half_plus_two` / `write_tflite_with_sigdef`: saved_model_half_plus_two_tflite
  (input `x` of shape `[1,1]`) and saved_model_half_plus_two_tflite_with_sigdef (a TF1
  SignatureDef in the model's metadata naming `tflite_input:0` for the tensor `tflite_input`).
"""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf
from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow.core.protobuf import meta_graph_pb2
from tensorflow_serving.apis import input_pb2

v1 = tf.compat.v1
PREDICT = "tensorflow/serving/predict"
CLASSIFY = "tensorflow/serving/classify"
REGRESS = "tensorflow/serving/regress"


def _version_dir(base: Path, version: int) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    return base / str(version)


def _info(tensor, shape: bool = True) -> meta_graph_pb2.TensorInfo:
    info = v1.saved_model.utils.build_tensor_info(tensor)
    if not shape:  # TF 1.x exporters wrote TensorInfos without tensor_shape
        info.ClearField("tensor_shape")
    return info


def _signature(inputs: dict, outputs: dict, method: str, shape: bool = True):
    return meta_graph_pb2.SignatureDef(
        inputs={key: _info(t, shape) for key, t in inputs.items()},
        outputs={key: _info(t, shape) for key, t in outputs.items()}, method_name=method)


def _save(path: Path, session, signatures: dict, **kwargs) -> Path:
    builder = v1.saved_model.builder.SavedModelBuilder(str(path))
    builder.add_meta_graph_and_variables(session, [v1.saved_model.tag_constants.SERVING],
                                         signature_def_map=signatures, **kwargs)
    builder.save()
    return path


def write_half_plus_two(base: Path, version: int = 1) -> Path:
    """y = 0.5x + 2, y2 = 0.5x + 3, y3 = 0.5x2 + 3."""
    path = _version_dir(base, version)
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        a = v1.Variable(0.5, name="a", use_resource=False)
        b = v1.Variable(2.0, name="b", use_resource=False)
        c = v1.Variable(3.0, name="c", use_resource=False)
        serialized = v1.placeholder(tf.string, name="tf_example")
        features = v1.parse_example(serialized, {
            "x": v1.FixedLenFeature([1], tf.float32),
            "x2": v1.FixedLenFeature([1], tf.float32, default_value=[0.0])})
        # TF 1.x inferred [?,1] here (TF Serving's half_plus_two_model_metadata.json); a
        # static shape only, as there: nothing checks it when `x` is fed.
        x = tf.identity(features["x"], name="x")
        x.set_shape([None, 1])
        y = tf.identity(tf.add(tf.multiply(a, x), b), name="y")
        y2 = tf.identity(tf.add(tf.multiply(a, x), c), name="y2")
        x2 = tf.identity(features["x2"], name="x2")
        x2.set_shape([None, 1])
        a2 = v1.Variable(0.5, name="a2", use_resource=False)
        c2 = v1.Variable(3.0, name="c2", use_resource=False)
        y3 = tf.identity(tf.add(tf.multiply(a2, x2), c2), name="y3")
        asset_dir = base / "original-assets"
        asset_dir.mkdir(parents=True, exist_ok=True)
        (asset_dir / "foo.txt").write_text("asset-file-contents")
        v1.add_to_collection(v1.GraphKeys.ASSET_FILEPATHS, tf.constant(str(asset_dir / "foo.txt")))
        filename = v1.Variable("foo.txt", name="filename_tensor", trainable=False,
                               collections=[], use_resource=False)
        assign_filename = filename.assign("foo.txt")
        session.run(v1.global_variables_initializer())
        signatures = {
            "regress_x_to_y": _signature({"inputs": serialized}, {"outputs": y}, REGRESS),
            "regress_x_to_y2": _signature({"inputs": serialized}, {"outputs": y2}, REGRESS),
            "regress_x2_to_y3": _signature({"inputs": x2}, {"outputs": y3}, REGRESS),
            "classify_x_to_y": _signature({"inputs": serialized}, {"scores": y}, CLASSIFY),
            "serving_default": _signature({"x": x}, {"y": y}, PREDICT)}
        return _save(path, session, signatures,
                     assets_collection=v1.get_collection(v1.GraphKeys.ASSET_FILEPATHS),
                     main_op=tf.group(assign_filename))


def write_half_plus_three(base: Path, version: int = 1) -> Path:
    """y = 0.5x + 3 from a `[?,1]` placeholder (Predict), or from tf.Examples (Regress,
    Classify), with TensorInfos that carry no shape."""
    path = _version_dir(base, version)
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        a = v1.Variable(0.5, name="a", use_resource=False)
        b = v1.Variable(3.0, name="b", use_resource=False)
        x = v1.placeholder(tf.float32, [None, 1], name="x")
        y = tf.add(tf.multiply(a, x), b, name="y")
        serialized = v1.placeholder(tf.string, name="tf_example")
        parsed = v1.parse_example(serialized, {"x": v1.FixedLenFeature([1], tf.float32)})["x"]
        y_example = tf.add(tf.multiply(a, parsed), b, name="y_example")
        session.run(v1.global_variables_initializer())
        signatures = {
            "serving_default": _signature({"x": x}, {"y": y}, PREDICT, shape=False),
            REGRESS: _signature({"inputs": serialized}, {"outputs": y_example}, REGRESS,
                                shape=False),
            CLASSIFY: _signature({"inputs": serialized}, {"scores": y_example}, CLASSIFY,
                                 shape=False)}
        return _save(path, session, signatures)


def write_counter(base: Path, version: int = 1) -> Path:
    """get_counter, incr_counter, incr_counter_by (delta) and reset_counter."""
    path = _version_dir(base, version)
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        counter = v1.Variable(0.0, dtype=tf.float32, name="counter", use_resource=False)
        incr = counter.assign_add(1.0)
        delta = v1.placeholder(tf.float32, name="delta")
        incr_by = counter.assign_add(delta)
        reset = counter.assign(0.0)
        session.run(v1.global_variables_initializer())
        signatures = {
            "get_counter": _signature({}, {"output": counter}, PREDICT),
            "incr_counter": _signature({}, {"output": incr}, PREDICT),
            "incr_counter_by": _signature({"delta": delta}, {"output": incr_by}, PREDICT),
            "reset_counter": _signature({}, {"output": reset}, PREDICT)}
        return _save(path, session, signatures)


def write_defaults_model(base: Path, version: int = 1) -> Path:
    """serving_default: sum = a + b, where `b` defaults to 10."""
    path = _version_dir(base, version)
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        a = v1.placeholder(tf.float32, [None], name="a")
        b = v1.placeholder(tf.float32, [None], name="b")
        total = tf.add(a, b, name="sum")
        signature = _signature({"a": a, "b": b}, {"sum": total}, PREDICT)
        signature.defaults["b"].CopyFrom(tf.make_tensor_proto([10.0], tf.float32))
        return _save(path, session, {"serving_default": signature})


class _Classifier(tf.Module):
    """TF2 signatures over serialized tf.Examples with one float feature `x`."""

    def __init__(self):
        super().__init__()
        self.scale = tf.Variable(0.5)
        self.offset = tf.Variable(2.0)

    def _y(self, inputs):
        x = tf.io.parse_example(inputs, {"x": tf.io.FixedLenFeature([1], tf.float32)})["x"]
        return x * self.scale + self.offset  # [N, 1]

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def classify(self, inputs):
        y = self._y(inputs)
        scores = tf.concat([y, -y], axis=1)
        classes = tf.tile(tf.constant([["pos", "neg"]]), [tf.shape(y)[0], 1])
        return {"classes": classes, "scores": scores}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def regress(self, inputs):
        return {"outputs": self._y(inputs)[:, 0]}


def write_tf2_classifier(base: Path, version: int = 1) -> Path:
    """`classify` (classes, scores) and `regress` (outputs) of y = 0.5x + 2, both with the
    method_name TF2 gives every signature (`tensorflow/serving/predict`)."""
    path = _version_dir(base, version)
    module = _Classifier()
    tf.saved_model.save(module, str(path), signatures={"classify": module.classify,
                                                       "regress": module.regress})
    return path


class _NarrowFloats(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def narrow(self, x):
        return {"bf16": tf.cast(x, tf.bfloat16), "half": tf.cast(x, tf.float16)}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def complex(self, x):
        return {"z": tf.complex(x, 2.0 * x)}


def write_narrow_floats(base: Path, version: int = 1) -> Path:
    """serving_default: x as bfloat16 (`bf16`) and as float16 (`half`); `complex`:
    z = x + 2xi (complex64), an output JSON cannot carry."""
    path = _version_dir(base, version)
    module = _NarrowFloats()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.narrow,
                                                       "complex": module.complex})
    return path


class _KerasHolder(tf.Module):
    def __init__(self):
        super().__init__()
        import keras

        self.model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(
            2, kernel_initializer="ones", bias_initializer="zeros", name="dense")])

    @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="features")])
    def serve(self, features):
        return {"scores": self.model(features)}


def write_keras_in_module(base: Path, version: int = 1) -> Path:
    """scores = features @ ones(3, 2), from a Keras 3 model held by a tf.Module."""
    path = _version_dir(base, version)
    module = _KerasHolder()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})
    return path


def _tflite_from_session(input_name: str) -> bytes:
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        x = v1.placeholder(tf.float32, [1, 1], name=input_name)
        y = tf.identity(tf.add(tf.multiply(0.5, x), 2.0), name="y")
        return v1.lite.TFLiteConverter.from_session(session, [x], [y]).convert()


def _write_tflite(base: Path, version: int, model: bytes) -> Path:
    path = _version_dir(base, version)
    path.mkdir()
    (path / "model.tflite").write_bytes(model)
    return path


def write_tflite_half_plus_two(base: Path, version: int = 1) -> Path:
    """y = 0.5x + 2, input tensor `x` of shape [1,1], no signatures."""
    return _write_tflite(base, version, _tflite_from_session("x"))


def with_signature_def_metadata(model: bytes, signature_defs: dict) -> bytes:
    """`model` with `signature_defs` in its `signature_defs_metadata` (what TFLite's
    tflite::SetSignatureDefMap writes: a FlexBuffer map of key -> serialized SignatureDef)."""
    import flatbuffers
    from flatbuffers import flexbuffers
    from tensorflow.lite.python import schema_py_generated as schema

    table = flexbuffers.Builder()
    with table.Map():
        for key, signature in sorted(signature_defs.items()):
            table.Key(key)
            # a FlexBuffer *string* holding the proto bytes, as the C++ writer stores it
            table._WriteBlob(signature.SerializeToString(), append_zero=True,  # noqa: SLF001
                             type_=flexbuffers.Type.STRING)
    data = table.Finish()
    root = schema.ModelT.InitFromObj(schema.Model.GetRootAs(model, 0))
    buffer = schema.BufferT()
    buffer.data = list(data)
    root.buffers.append(buffer)
    metadata = schema.MetadataT()
    metadata.name = "signature_defs_metadata"
    metadata.buffer = len(root.buffers) - 1
    root.metadata = (root.metadata or []) + [metadata]
    builder = flatbuffers.Builder(1024)
    builder.Finish(root.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def write_tflite_with_sigdef(base: Path, version: int = 1) -> Path:
    """TF Serving's saved_model_half_plus_two_tflite_with_sigdef: the TFLite tensor is
    `tflite_input`, the SignatureDef names it `tflite_input:0` under the alias `x`."""
    signature = meta_graph_pb2.SignatureDef(method_name=PREDICT)
    signature.inputs["x"].name = "tflite_input:0"
    signature.inputs["x"].dtype = tf.float32.as_datatype_enum
    signature.outputs["y"].name = "y:0"
    signature.outputs["y"].dtype = tf.float32.as_datatype_enum
    model = with_signature_def_metadata(_tflite_from_session("tflite_input"),
                                        {"serving_default": signature})
    return _write_tflite(base, version, model)


def model_config(root: Path, models: dict[str, str]) -> str:
    """A model_config_list text proto: name -> platform, each under root/name."""
    return "model_config_list {\n" + "".join(
        f'  config {{ name: "{name}" base_path: "{root / name}" '
        f'model_platform: "{platform}" }}\n' for name, platform in models.items()) + "}\n"


def examples(*values: float) -> input_pb2.Input:
    """A Classify/Regress/MultiInference input: one tf.Example per value, its float feature "x"."""
    request_input = input_pb2.Input()
    for value in values:
        request_input.example_list.examples.append(example_pb2.Example(
            features=feature_pb2.Features(feature={"x": feature_pb2.Feature(
                float_list=feature_pb2.FloatList(value=[value]))})))
    return request_input
