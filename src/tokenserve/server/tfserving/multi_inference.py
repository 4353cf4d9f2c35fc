"""MultiInference: several Classify/Regress tasks of one model over one Input, answered as
tensorflow_model_server answers it (multi_inference.cc, multi_inference_helper.cc, and the
classifier.cc/regressor.cc checks each task's signature gets).

Each task is checked in TF Serving's order before anything runs: a model name, the first
task's model, a signature no earlier task named (`Duplicate evaluation of signature: x`),
the signature in the model, a classify or regress method (anything else is UNIMPLEMENTED
`Unsupported signature method_name: ...`), then the signature's inputs and outputs.

How the tasks share the Input depends on what kind of SavedModel serves them:

- A TF1 graph is one Session graph: TF Serving feeds the serialized examples once and
  fetches every task's outputs, so all signatures must read the same input tensor (`Input
  tensor must be the same for all Signatures.`). An output two tasks share is computed once.
- A TF2 SavedModel (one with an object graph) holds each signature as its own function with
  its own input placeholder. TF Serving runs each task's signature on the same serialized
  examples, so a `classify` and a `regress` signature are served together.

Results come back in task order, each with the task's model name, its signature name
(`serving_default` when the task named none) and the version that answered.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tensorflow_serving.apis import inference_pb2, model_pb2

from tokenserve.errors import InvalidRequestError
from tokenserve.lifecycle.manager import ModelManager
from tokenserve.lifecycle.servable import CLASSIFY_METHOD, DEFAULT_SIGNATURE, REGRESS_METHOD
from tokenserve.lifecycle.session_bundle import read_saved_model
from tokenserve.server.tfserving.inference import (CLASSIFY_INPUTS, REGRESS_OUTPUTS,
                                                   classification_outputs,
                                                   classification_result, regression_outputs,
                                                   regression_result, remaining,
                                                   serialized_examples, spec_args)
from tokenserve.server.tfserving.tf_status import unimplemented


@dataclass(frozen=True)
class Task:
    """One checked task: the signature that runs, the tensor it reads, and the outputs its
    method (`classify` or `regress`) builds the result from."""

    model_name: str
    signature_name: str
    method: str
    input_tensor: str
    output_tensors: dict[str, str]
    """Output alias -> tensor name, for the outputs the method reads."""


def _check_first_task(request: inference_pb2.MultiInferenceRequest) -> None:
    """What must hold before the first task's ModelSpec can pick a version."""
    if not request.tasks:
        raise InvalidRequestError("Found no tasks in MultiInferenceRequest")
    if not request.tasks[0].model_spec.name:
        raise InvalidRequestError("Found ModelSpec with an empty model name.")


def check_tasks(servable, request: inference_pb2.MultiInferenceRequest) -> list[Task]:
    """Every task checked in TF Serving's order (module docstring); raises its error."""
    _check_first_task(request)
    tasks: list[Task] = []
    for task in request.tasks:
        if not task.model_spec.name:
            raise InvalidRequestError("Found ModelSpec with an empty model name.")
        if tasks and task.model_spec.name != tasks[0].model_name:
            raise InvalidRequestError("All ModelSpecs in a MultiInferenceRequest must access "
                                      "the same model name.")
        name = task.model_spec.signature_name or DEFAULT_SIGNATURE
        if any(earlier.signature_name == name for earlier in tasks):
            raise InvalidRequestError(f"Duplicate evaluation of signature: {name}")
        if name not in servable.signature_defs:
            raise InvalidRequestError(f"Requested signature not found in model graph: {name}")
        sig = servable.signature_defs[name]
        if task.method_name == CLASSIFY_METHOD:
            wanted = classification_outputs(sig)
        elif task.method_name == REGRESS_METHOD:
            wanted = regression_outputs(sig)
        else:
            raise unimplemented(f"Unsupported signature method_name: {task.method_name}")
        tasks.append(Task(task.model_spec.name, name, task.method_name,
                          sig.inputs[CLASSIFY_INPUTS].name,
                          {alias: sig.outputs[alias].name for alias in wanted}))
    return tasks


@functools.lru_cache(maxsize=256)
def _has_object_graph(version_dir: str) -> bool:
    """True for a TF2 SavedModel: `tf.saved_model.save` writes an object graph, the TF1
    SavedModelBuilder none. A version directory does not change while it is served (TF
    Serving's rule too), so the answer is read once."""
    try:
        proto = read_saved_model(Path(version_dir))
    except Exception:  # noqa: BLE001 - no SavedModel here (TFLite, files gone): TF1 rules
        return False
    return any(graph.object_graph_def.nodes for graph in proto.meta_graphs)


def signatures_are_functions(servable) -> bool:
    """Whether the servable's signatures are separate TF2 functions (module docstring)."""
    path = getattr(servable, "path", None)
    return path is not None and _has_object_graph(str(path))


def _run_tasks(servable, tasks: list[Task], examples: np.ndarray,
               deadline: float | None) -> list[dict[str, np.ndarray]]:
    """Each signature runs once, for the outputs no earlier signature computed (by tensor
    name); returns each task's outputs by alias."""
    computed: dict[str, np.ndarray] = {}
    for task in tasks:
        missing = [alias for alias, tensor in task.output_tensors.items()
                   if tensor not in computed]
        if not missing:
            continue
        outputs = servable.run(task.signature_name, {CLASSIFY_INPUTS: examples}, missing,
                               remaining(deadline))
        for alias in missing:
            computed[task.output_tensors[alias]] = outputs[alias]
    return [{alias: computed[tensor] for alias, tensor in task.output_tensors.items()}
            for task in tasks]


def _result_spec(task: Task, version: int | None) -> model_pb2.ModelSpec:
    spec = model_pb2.ModelSpec(name=task.model_name, signature_name=task.signature_name)
    if version is not None:
        spec.version.value = version
    return spec


def multi_inference_on(servable, request: inference_pb2.MultiInferenceRequest,
                       version: int | None = None, deadline: float | None = None
                       ) -> inference_pb2.MultiInferenceResponse:
    """The tasks of `request` on a loaded servable; `version` goes into each result's
    ModelSpec."""
    tasks = check_tasks(servable, request)
    if (len({task.input_tensor for task in tasks}) > 1
            and not signatures_are_functions(servable)):
        raise InvalidRequestError("Input tensor must be the same for all Signatures.")
    examples = serialized_examples(request.input)
    response = inference_pb2.MultiInferenceResponse()
    for task, outputs in zip(tasks, _run_tasks(servable, tasks, examples, deadline)):
        result = response.results.add(model_spec=_result_spec(task, version))
        if task.method == CLASSIFY_METHOD:
            result.classification_result.CopyFrom(
                classification_result(len(examples), outputs))
        else:
            result.regression_result.CopyFrom(
                regression_result(len(examples), outputs[REGRESS_OUTPUTS]))
    return response


def multi_inference(manager: ModelManager, request: inference_pb2.MultiInferenceRequest,
                    deadline: float | None = None) -> inference_pb2.MultiInferenceResponse:
    """Several classify/regress signatures of one model over one shared Input; the first
    task's ModelSpec picks the version (multi_inference_helper.cc)."""
    _check_first_task(request)
    with manager.acquire(**spec_args(request.tasks[0].model_spec)) as loaded:
        return multi_inference_on(loaded.servable, request, loaded.version, deadline)
