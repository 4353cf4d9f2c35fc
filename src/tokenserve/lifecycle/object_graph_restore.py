"""Restores TF2 variables that a SavedModel's TF1 saver does not cover.

`tf.saved_model.save` writes two views of a model: the MetaGraph (graph, saver_def,
signatures), which TF1 Sessions and TF Serving load, and the object graph, which
`tf.saved_model.load` uses. Usually the saver restores every variable the signatures read.
For some models it does not: a Keras 3 model held by a `tf.Module` (as tokenserve's own
language-model exports were, before export/module.py tracked the underlying variables) is saved with the checkpointed variables under one
set of resource names and the functions capturing another set. `tf.saved_model.load` joins
them through the object graph; a Session (and so tensorflow_model_server) loads fine and
then fails every call with `Could not find variable ...`.

`restore_ops` finds the resource variables the saver's restore op does not take (its
inputs are the handles it restores) and whose name the object graph maps to a checkpoint key
(the SavedObjectGraph and the checkpoint's own object graph, walked together from the root
by child names), and builds their restores, to run in the same Session step as the saver's
restore: a Session's first run of a new set of ops prepares the graph again (seconds for a
large model). Variables that cannot be mapped are left alone, so a model that would fail in
TF Serving still fails the same way.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

log = logging.getLogger("tokenserve.lifecycle")

_OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
_VALUE_ATTRIBUTE = "VARIABLE_VALUE"


def _variable_keys(saved_graph, checkpoint_graph) -> dict[str, str]:
    """Variable name -> checkpoint key, for names that occur once."""
    keys: dict[str, list[str]] = defaultdict(list)
    seen = {0}
    pending = [(0, 0)]
    while pending:
        saved_id, checkpoint_id = pending.pop()
        saved = saved_graph.nodes[saved_id]
        if saved.WhichOneof("kind") == "variable":
            for attribute in checkpoint_graph.nodes[checkpoint_id].attributes:
                if attribute.name == _VALUE_ATTRIBUTE:
                    keys[saved.variable.name].append(attribute.checkpoint_key)
        checkpoint_children = {child.local_name: child.node_id
                               for child in checkpoint_graph.nodes[checkpoint_id].children}
        for child in saved.children:
            match = checkpoint_children.get(child.local_name)
            if match is not None and child.node_id not in seen:
                seen.add(child.node_id)
                pending.append((child.node_id, match))
    return {name: found[0] for name, found in keys.items() if len(set(found)) == 1}


def _restored_handles(graph: tf.Graph, saver_def) -> set[str]:
    """Names of the ops whose outputs feed the saver's restore op (the handles it restores)."""
    if not saver_def.restore_op_name:
        return set()
    try:
        restore = graph.get_operation_by_name(saver_def.restore_op_name)
    except KeyError:
        return set()
    return {tensor.op.name for tensor in restore.inputs}


def restore_ops(graph: tf.Graph, meta_graph_def, path: Path) -> list:
    """AssignVariableOps restoring, from the checkpoint, the variables the TF1 saver of a
    TF2 SavedModel does not cover; [] for TF1 SavedModels and for complete savers."""
    if not meta_graph_def.object_graph_def.nodes:
        return []  # a TF1 SavedModel: its saver is the whole story
    covered = _restored_handles(graph, meta_graph_def.saver_def)
    candidates = [op for op in graph.get_operations()
                  if op.type == "VarHandleOp" and op.name not in covered]
    if not candidates:
        return []
    prefix = str(path / "variables" / "variables")
    try:
        reader = tf.train.load_checkpoint(prefix)
        checkpoint_graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
            reader.get_tensor(_OBJECT_GRAPH_KEY))
    except (tf.errors.OpError, ValueError):
        return []
    keys = _variable_keys(meta_graph_def.object_graph_def, checkpoint_graph)
    assigns = []
    with graph.as_default(), tf.name_scope("tokenserve_object_graph_restore"):
        for op in candidates:
            key = keys.get(op.get_attr("shared_name").decode())
            if key is None or not reader.has_tensor(key):
                continue
            value = tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=[key],
                                         shape_and_slices=[""], dtypes=[op.get_attr("dtype")])
            assigns.append(tf.raw_ops.AssignVariableOp(resource=op.outputs[0], value=value[0]))
    if assigns:
        log.info("%s: restoring %d variables through the SavedModel's object graph (its TF1 "
                 "saver does not cover them)", path, len(assigns))
    return assigns
