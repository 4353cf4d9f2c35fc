"""The Session-based SavedModel servable and the TFLite servable, in process: they load TF
Serving's own test models (rebuilt with tf.compat.v1, tests/support/tfserving_models.py)
and apply TF Serving's request rules, with TF Serving's texts
(docs/migrating-from-tf-serving.md#how-a-request-runs)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from support import servables as S
from support import tfserving_models as M
from tokenserve.errors import (DeadlineExceededError, FailedPreconditionError,
                               InvalidRequestError, ModelLoadError)
from tokenserve.lifecycle.savedmodel import SavedModelServable
from tokenserve.lifecycle.session_bundle import SessionOptions
from tokenserve.lifecycle.tflite import TFLiteServable


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"half_plus_two": M.write_half_plus_two(root / "half_plus_two"),
            "half_plus_three": M.write_half_plus_three(root / "half_plus_three"),
            "counter": M.write_counter(root / "counter"),
            "defaults": M.write_defaults_model(root / "defaults"),
            "keras_in_module": M.write_keras_in_module(root / "keras_in_module"),
            "tf2": S.write_tf2_model(root / "tf2", 1),
            "lite": M.write_tflite_half_plus_two(root / "lite"),
            "lite_sigdef": M.write_tflite_with_sigdef(root / "lite_sigdef")}


def floats(*values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


# ---- item 1: every SavedModel loads, as in a TF1 Session -------------------------------------

def test_half_plus_three_with_reference_variables_and_shapeless_tensor_infos(models):
    """`tf.saved_model.load` fails on this model with "Shapes must be equal rank, but are 2
    and 0" (the old loader's error, reported by the issue); a Session serves it."""
    servable = SavedModelServable(models["half_plus_three"])
    assert sorted(servable.signature_defs) == ["serving_default", M.CLASSIFY, M.REGRESS]
    assert servable.run("", {"x": floats(1.0, 2.0, 5.0)})["y"].tolist() == [3.5, 4.0, 5.5]
    servable.close()


def test_counter_signatures_update_a_reference_variable(models):
    servable = SavedModelServable(models["counter"])
    assert servable.run("incr_counter", {})["output"] == 1.0
    assert servable.run("incr_counter_by", {"delta": np.float32(2.5)})["output"] == 3.5
    assert servable.run("get_counter", {})["output"] == 3.5
    assert servable.run("reset_counter", {})["output"] == 0.0


def test_keras_model_in_a_module_restores_the_variables_its_functions_capture(models):
    """The TF1 saver of such a model restores other handles than its functions read (a bare
    Session fails with `Could not find variable ...`); the object graph maps them."""
    servable = SavedModelServable(models["keras_in_module"])
    assert servable.run("", {"features": np.ones((2, 3), np.float32)})["scores"].tolist() == [
        [3.0, 3.0], [3.0, 3.0]]


def test_signature_defs_are_the_metagraphs_and_tags_must_match_exactly(models):
    tf2 = SavedModelServable(models["tf2"])
    assert "__saved_model_init_op" in tf2.signature_defs  # as TF Serving's metadata shows
    with pytest.raises(ModelLoadError) as raised:
        SavedModelServable(models["tf2"], tags=("serve", "gpu"))
    assert str(raised.value) == ("Could not find meta graph def matching supplied tags: "
                                 "{ serve gpu }. To inspect available tag-sets in the "
                                 "SavedModel, please use the SavedModel CLI: `saved_model_cli`")
    assert raised.value.error_code == "NOT_FOUND"


def test_session_uses_the_thread_pool_flags(models):
    servable = SavedModelServable(models["tf2"], options=SessionOptions(intra_op_threads=2,
                                                                        inter_op_threads=1))
    config = servable._bundle.session._config  # noqa: SLF001 - the ConfigProto it runs with
    assert (config.intra_op_parallelism_threads, config.inter_op_parallelism_threads) == (2, 1)


# ---- item 2: no shape check against the SignatureDef -----------------------------------------

def test_predict_feeds_the_tensor_as_sent(models):
    servable = SavedModelServable(models["half_plus_two"])  # x is [?,1] in the SignatureDef
    assert servable.run("", {"x": floats(1.0, 2.0, 5.0)})["y"].tolist() == [2.5, 3.0, 4.5]
    assert servable.run("", {"x": floats(1.0)})["y"].tolist() == [2.5]
    assert servable.run("", {"x": floats([1.0], [3.0])})["y"].tolist() == [[2.5], [3.5]]
    with pytest.raises(InvalidRequestError, match="^Expects arg\\[0\\] to be float but "
                                                  "int64 is provided"):
        servable.run("", {"x": np.array([1], np.int64)})


def test_tflite_input_is_resized_as_tf_serving_does(models):
    servable = TFLiteServable(models["lite"])  # x is [1,1]
    assert servable.run("", {"x": floats(1.0)})["y"].tolist() == [2.5]
    assert servable.run("", {"x": floats(1.0, 2.0, 5.0)})["y"].tolist() == [2.5, 3.0, 4.5]
    assert servable.run("", {"x": floats([4.0])})["y"].tolist() == [[4.0]]


# ---- item 4: a .tflite model carrying a SignatureDef -----------------------------------------

def test_tflite_signature_def_metadata_maps_aliases_to_tensors(models):
    servable = TFLiteServable(models["lite_sigdef"])
    [(name, sig)] = servable.signature_defs.items()
    assert name == "serving_default" and sig.method_name == M.PREDICT
    assert (sig.inputs["x"].name, sig.outputs["y"].name) == ("tflite_input", "y")
    assert [d.size for d in sig.inputs["x"].tensor_shape.dim] == [1, 1]
    assert servable.run("", {"x": floats(1.0, 2.0, 3.0)})["y"].tolist() == [2.5, 3.0, 3.5]


# ---- item 5: predict_util's input rules and texts --------------------------------------------

def test_input_count_and_names_as_predict_util(models):
    servable = SavedModelServable(models["half_plus_two"])
    with pytest.raises(InvalidRequestError) as raised:  # same count, other name
        servable.run("", {"z": floats(1.0)})
    assert str(raised.value) == (
        "Signature input alias: x(feed name: x:0) not found in request and no default value "
        "provided. Inputs expected to be in the request {z}, or default input alias set: ")
    with pytest.raises(InvalidRequestError) as raised:  # counts differ
        servable.run("", {"x": floats(1.0), "z": floats(1.0)})
    assert str(raised.value) == ("input size does not match signature: 2!=1 len({x,z}) != "
                                 "len({x}). Sent extra: {z}. Missing but required: {}.")
    with pytest.raises(FailedPreconditionError, match='^Serving signature key "nope" not '
                                                      'found.$'):
        servable.run("nope", {"x": floats(1.0)})


def test_signature_defaults_fill_missing_inputs(models):
    servable = SavedModelServable(models["defaults"])  # b defaults to [10]
    assert servable.run("", {"a": floats(1.0)})["sum"].tolist() == [11.0]
    assert servable.run("", {"a": floats(1.0), "b": floats(2.0)})["sum"].tolist() == [3.0]
    with pytest.raises(InvalidRequestError) as raised:  # fewer inputs are fine, a wrong name not
        servable.run("", {"c": floats(1.0)})
    assert str(raised.value) == (
        "Signature input alias: a(feed name: a:0) not found in request and no default value "
        "provided. Inputs expected to be in the request {c}, or default input alias set: b")
    with pytest.raises(InvalidRequestError) as raised:
        servable.run("", {"a": floats(1.0), "c": floats(1.0)})
    assert str(raised.value) == ("Inputs contains invalid name. Used request inputs: a, "
                                 "request input: a,c")


def test_output_filter_texts(models):
    servable = SavedModelServable(models["tf2"])
    inputs = {"a": np.array([[1]], np.int32), "b": np.array([[2]], np.int32)}
    assert list(servable.run("arith", inputs, ["sum"])) == ["sum"]
    with pytest.raises(InvalidRequestError) as raised:
        servable.run("arith", inputs, ["nope"])
    assert str(raised.value) == ("output tensor alias not found in signature: nope Outputs "
                                 "expected to be in the set {product,sum}.")
    with pytest.raises(InvalidRequestError, match="^duplicate output tensor alias: sum$"):
        servable.run("arith", inputs, ["sum", "sum"])


# ---- item 8: a timeout cancels the run -------------------------------------------------------

def test_timeout_cancels_the_session_run(models, tmp_path):
    servable = SavedModelServable(models["tf2"])
    gate = tmp_path / "never"
    started = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="Timed out waiting for notification"):
        servable.run("wait", {"gate": np.array(str(gate).encode(), dtype=object),
                              "x": floats(1.0)}, timeout_s=0.3)
    assert time.monotonic() - started < 5
    beat = tmp_path / "never.beat"
    assert beat.exists()  # the loop ran ...
    S.wait_until_beat_stops(beat, still_s=0.5)  # ... and stopped with the answer


def test_half_plus_two_fixture_declares_what_tf_serving_declares(models):
    """Shapes as in TF Serving's half_plus_two_model_metadata.json, so item 2 is tested
    against a `[?,1]` input, as the issue reports it."""
    signatures = SavedModelServable(models["half_plus_two"]).signature_defs

    def shape(info):
        return None if info.tensor_shape.unknown_rank else [d.size for d in info.tensor_shape.dim]

    assert shape(signatures["serving_default"].inputs["x"]) == [-1, 1]
    assert shape(signatures["regress_x2_to_y3"].inputs["inputs"]) == [-1, 1]
    assert shape(signatures["classify_x_to_y"].inputs["inputs"]) is None
    assert shape(signatures["classify_x_to_y"].outputs["scores"]) == [-1, 1]
