"""GetModelStatus and GetModelMetadata, as protos and as TF Serving's REST JSON."""

from __future__ import annotations

from google.protobuf import json_format
from tensorflow_serving.apis import (get_model_metadata_pb2, get_model_status_pb2, model_pb2,
                                     status_pb2)

from tokenserve.errors import InvalidRequestError
from tokenserve.lifecycle.manager import ModelManager
from tokenserve.server.tfserving.inference import spec_args

SIGNATURE_DEF_FIELD = "signature_def"
_ERROR_CODES = status_pb2.StatusProto.DESCRIPTOR.fields_by_name["error_code"].enum_type


def model_status(manager: ModelManager, model_spec: model_pb2.ModelSpec
                 ) -> get_model_status_pb2.GetModelStatusResponse:
    """Every version of the model, or the one the spec names (version or label)."""
    args = spec_args(model_spec)
    version = args["version"]
    if args["label"]:
        labels = manager.labels(model_spec.name)
        if args["label"] not in labels:
            raise InvalidRequestError(f"Unrecognized servable version label: {args['label']}")
        version = labels[args["label"]]
    response = get_model_status_pb2.GetModelStatusResponse()
    for status in manager.model_status(model_spec.name, version):
        code = _ERROR_CODES.values_by_name.get(status.error_code,
                                               _ERROR_CODES.values_by_name["UNKNOWN"]).number
        response.model_version_status.add(
            version=status.version, state=int(status.state),
            status=status_pb2.StatusProto(error_code=code, error_message=status.error_message))
    return response


def model_metadata(manager: ModelManager, request: get_model_metadata_pb2.GetModelMetadataRequest
                   ) -> get_model_metadata_pb2.GetModelMetadataResponse:
    if not request.metadata_field:
        raise InvalidRequestError("GetModelMetadataRequest must specify at least one "
                                  "metadata_field")
    for field in request.metadata_field:
        if field != SIGNATURE_DEF_FIELD:
            raise InvalidRequestError(f"Metadata field {field} is not supported")
    with manager.acquire(**spec_args(request.model_spec)) as version:
        signatures = get_model_metadata_pb2.SignatureDefMap()
        for name, sig in version.servable.signature_defs.items():
            signatures.signature_def[name].CopyFrom(sig)
        response = get_model_metadata_pb2.GetModelMetadataResponse()
        response.model_spec.name = version.model_name
        response.model_spec.version.value = version.version
    response.metadata[SIGNATURE_DEF_FIELD].Pack(signatures)
    return response


def _json(message) -> str:
    # TF Serving prints protos with JSON whitespace, proto field names and default values.
    return json_format.MessageToJson(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True, indent=1)


def status_json(response: get_model_status_pb2.GetModelStatusResponse) -> str:
    return _json(response) + "\n"


def metadata_json(response: get_model_metadata_pb2.GetModelMetadataResponse) -> str:
    """TF Serving's hand-assembled metadata body: model_spec, then each metadata entry."""
    parts = ['{\n"model_spec":', _json(response.model_spec), "\n,\n", '"metadata": {']
    entries = []
    for name, value in sorted(response.metadata.items()):
        signatures = get_model_metadata_pb2.SignatureDefMap()
        value.Unpack(signatures)
        entries.append(f'"{name}": {_json(signatures)}')
    parts.append(",\n".join(entries))
    parts.append("\n}\n}\n")
    return "".join(parts)
