"""Model lifecycle: TF Serving's repository layout, version policies, loading, warmup, unloading.

`ModelManager` is the entry point: it owns every model's versions, moves them through
START -> LOADING -> AVAILABLE -> UNLOADING -> END, and hands out in-flight references with
`acquire()`. Policy and config code here is plain Python; only the servables (savedmodel,
session_bundle, object_graph_restore, tflite) and warmup replay import TensorFlow.
"""

from tokenserve.lifecycle.manager import ModelManager
from tokenserve.lifecycle.model_config import ModelSpecConfig, parse_model_server_config
from tokenserve.lifecycle.policy import VersionPolicy
from tokenserve.lifecycle.states import VersionStatus
from tokenserve.stats import VersionState
from tokenserve.lifecycle.version import LoadedVersion

__all__ = ["LoadedVersion", "ModelManager", "ModelSpecConfig", "VersionPolicy", "VersionState",
           "VersionStatus", "parse_model_server_config"]
