"""What ops a SavedModel's graph holds, read from its saved_model.pb (no loading): how a
test tells that an export runs on stock TensorFlow."""

from __future__ import annotations

from pathlib import Path


def saved_model_op_types(version_dir: Path) -> set[str]:
    """The op types of the first MetaGraph's graph and of every function in its library."""
    from tensorflow.core.protobuf import saved_model_pb2

    proto = saved_model_pb2.SavedModel()
    proto.ParseFromString((Path(version_dir) / "saved_model.pb").read_bytes())
    graph = proto.meta_graphs[0].graph_def
    ops = {node.op for node in graph.node}
    return ops | {node.op for f in graph.library.function for node in f.node_def}


def assert_stock_tensorflow_graph(version_dir: Path) -> None:
    """The export reads its variables and holds none of tokenserve's compiled ops, so stock
    TensorFlow (TF Serving, tf.saved_model.load without tokenserve) runs it."""
    ops = saved_model_op_types(version_dir)
    assert "ReadVariableOp" in ops and not {op for op in ops if "Tokenserve" in op}
