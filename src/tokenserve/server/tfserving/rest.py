"""TF Serving's REST API on FastAPI: `/v1/models/{name}[/versions/{v}|/labels/{l}]` for status,
`.../metadata`, and `...:predict|:classify|:regress`, with TF Serving's JSON bodies, its
`{ "error": "..." }` error body and HTTP status mapping (through server/status.py, and TF
Serving's own table for TensorFlow's status codes).

Every answer, errors included, is TF Serving's body: a method other than GET and POST is a
`Malformed request` (400), as is an unknown URL. `--rest_api_timeout_in_ms` bounds the
TensorFlow run itself (RunOptions.timeout_in_ms, as TF Serving sets it), so a request that
times out is cancelled rather than left computing; a backstop a second later answers 504
for anything that cannot be cancelled.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time

import tensorflow as tf
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from tensorflow.core.example import example_pb2, feature_pb2
from tensorflow_serving.apis import get_model_metadata_pb2, input_pb2, model_pb2

from tokenserve.errors import DeadlineExceededError, InvalidRequestError
from tokenserve.lifecycle.manager import ModelManager
from tokenserve.lifecycle.servable import DEFAULT_SIGNATURE
from tokenserve.server.tfserving import codec, inference, json_writer, model_info
from tokenserve.server.tfserving.json_writer import error_body
from tokenserve.server.tfserving.tf_status import (error_grpc_code, error_http_status,
                                                   error_message)

log = logging.getLogger("tokenserve.tfserving")
ENTRYPOINT = "REST"
_SPEC = r"/v1/models/([^/:]+)(?:/versions/(\d+)|/labels/([^/:]+))?"
# Case-insensitive like TF Serving's; any other path is a "Malformed request" (400).
_GET = re.compile(_SPEC + r"(?:/(metadata))?/?$", re.IGNORECASE)
_POST = re.compile(_SPEC + r":(classify|regress|predict)$", re.IGNORECASE)
_CORS_HEADERS = {"Access-Control-Allow-Origin": "*",
                 "Access-Control-Allow-Methods": "POST, GET",
                 "Access-Control-Allow-Headers": "Content-Type"}
_ALL_MODELS = re.compile(r"/v1/models/?$", re.IGNORECASE)
_INT64_MAX = 2**63 - 1
_BACKSTOP_S = 1.0
"""The REST timeout's backstop comes this long after the TensorFlow run's own timeout."""
_OTHER_METHODS = ["PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


def _json_response(body: str, status: int = 200) -> Response:
    # backslashreplace: an error message may quote a URL's name; a lone surrogate in it is
    # written as its escape rather than failing the response (bodies refuse them at parse)
    return Response(content=body.encode("utf-8", "backslashreplace"), status_code=status,
                    media_type="application/json")


_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)")
"""One escape inside a JSON string: `\\uXXXX` (the hex captured), or a backslash and one
character. Matched left to right, `\\\\` is one escape, so `\\\\ud800` is no surrogate."""


def _lone_surrogate_at(body: bytes) -> int | None:
    """The offset of the first `\\uD800`-`\\uDFFF` escape that is not half of a surrogate
    pair (a high one directly followed by a low one), or None. json.loads takes them and makes
    strings UTF-8 cannot hold; TF Serving's RapidJSON refuses them at parse, and so do we."""
    if b"\\u" not in body:
        return None
    high_at = high_end = None
    for match in _ESCAPE.finditer(body):
        unit = int(match.group(1), 16) if match.group(1) else None
        if high_at is not None:
            if match.start() != high_end or unit is None or not 0xDC00 <= unit <= 0xDFFF:
                return high_at
            high_at = None
            continue
        if unit is not None and 0xD800 <= unit <= 0xDBFF:
            high_at, high_end = match.start(), match.end()
        elif unit is not None and 0xDC00 <= unit <= 0xDFFF:
            return match.start()
    return high_at


def _model_spec(name: str, version: str | None, label: str | None) -> model_pb2.ModelSpec:
    spec = model_pb2.ModelSpec(name=name)
    if version is not None:
        if int(version) > _INT64_MAX:  # absl::SimpleAtoi into int64 fails
            raise InvalidRequestError(f"Failed to convert version: {version} to numeric.")
        spec.version.value = int(version)
    elif label is not None:
        spec.version_label = label
    return spec


_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|-?[0-9]+')
"""A JSON string, or the integer digits of a number: to find a number outside strings."""


def _long_integer_at(body: bytes) -> int:
    """The offset of the first integer literal (outside strings) longer than Python's int()
    reads (sys.get_int_max_str_digits(), 4,300 digits), or 0."""
    limit = sys.get_int_max_str_digits()
    for match in _TOKEN.finditer(body):
        token = match.group()
        if not token.startswith(b'"') and len(token.lstrip(b"-")) > limit:
            return match.start()
    return 0


def _parse_body(body: bytes) -> dict:
    if not body:
        raise InvalidRequestError("JSON Parse error: The document is empty")
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        reason = getattr(error, "msg", str(error))
        raise InvalidRequestError(f"JSON Parse error: {reason} at offset: "
                                  f"{getattr(error, 'pos', 0)}") from None
    except RecursionError:  # no tensor has that many dimensions (see codec.MAX_DIMS)
        raise InvalidRequestError("JSON Parse error: The document is nested too deeply") \
            from None
    except ValueError:  # int() refused a literal of over 4,300 digits: a 500 before
        # RapidJSON reads an integer past uint64 as a double, and one past a double's range
        # (any literal this long) fails as this
        raise InvalidRequestError(f"JSON Parse error: Number too big to be stored in double. "
                                  f"at offset: {_long_integer_at(body)}") from None
    lone = _lone_surrogate_at(body)
    if lone is not None:
        raise InvalidRequestError(f"JSON Parse error: The surrogate pair in string is invalid. "
                                  f"at offset: {lone}")
    if not isinstance(doc, dict):
        raise InvalidRequestError(f"JSON Value: {codec.compact(doc)} Is not object")
    signature = doc.get("signature_name", DEFAULT_SIGNATURE)
    if not isinstance(signature, str):
        raise InvalidRequestError(f"JSON Value: {codec.compact(doc)} not formatted correctly. "
                                  f"'signature_name' key must be a string value.")
    return doc


def _predict(manager: ModelManager, spec: model_pb2.ModelSpec, doc: dict,
             deadline: float | None = None) -> str:
    signature = doc.get("signature_name") or DEFAULT_SIGNATURE
    with manager.acquire(**inference.spec_args(spec)) as version:
        if signature not in version.servable.signature_defs:
            raise InvalidRequestError(f"Serving signature name: \"{signature}\" not found in "
                                      f"signature def")
        sig = version.servable.signature_defs[signature]
        dtypes = {name: tf.dtypes.as_dtype(info.dtype) for name, info in sig.inputs.items()}
        if not dtypes:
            raise InvalidRequestError(f"Failed to get input map for signature: {signature}")
        if "instances" in doc:
            if "inputs" in doc:
                raise InvalidRequestError(
                    f"JSON Value: {codec.compact(doc)} Not formatted correctly expecting only "
                    f"one of 'inputs' or 'instances' keys to exist ")
            instances = doc["instances"]
            if not isinstance(instances, list):
                raise InvalidRequestError(f"JSON Value: {codec.compact(doc)} Excepting "
                                          f"'instances' to be an list/array")
            if not instances:
                raise InvalidRequestError(f"JSON Value: {codec.compact(doc)} No values in "
                                          f"'instances' array")
            arrays = codec.instances_to_arrays(instances, dtypes)
            return json_writer.row_json(inference.predict_arrays(version.servable, signature,
                                                                 arrays, deadline))
        if "inputs" in doc:
            arrays = codec.inputs_to_arrays(doc["inputs"], dtypes)
            return json_writer.columnar_json(inference.predict_arrays(
                version.servable, signature, arrays, deadline))
        raise InvalidRequestError("Missing 'inputs' or 'instances' key")


def _feature(name: str, values) -> feature_pb2.Feature:
    """One tf.Example feature from JSON (TF Serving's rules: float/int64/bytes, b64)."""
    feature = feature_pb2.Feature()
    kinds = {"float": "float_list", "int64": "int64_list", "bytes": "bytes_list"}
    for value in values if isinstance(values, list) else [values]:
        if isinstance(value, bool):
            kind, item = "int64", int(value)
        elif isinstance(value, int):
            if not -2**63 <= value <= _INT64_MAX:  # protobuf's append raised ValueError: a 500
                raise InvalidRequestError(f"Feature: {name} has an integer outside int64's "
                                          f"range: {value}")
            kind, item = "int64", value
        elif isinstance(value, float):
            kind, item = "float", value
        elif isinstance(value, str):
            kind, item = "bytes", value.encode()
        elif codec.is_b64(value):
            kind, item = "bytes", codec.decode_b64(value)
        else:
            raise InvalidRequestError(f"Feature: {name} has element with unexpected JSON type: "
                                      f"{codec.json_type(value)}")
        current = feature.WhichOneof("kind")
        if current is not None and current != kinds[kind]:
            raise InvalidRequestError(f"Unexpected element type in feature: {name} expecting "
                                      f"type: {current.removesuffix('_list')}")
        getattr(feature, kinds[kind]).value.append(item)
    return feature


def _example(value) -> example_pb2.Example:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"Example must be JSON object but got JSON "
                                  f"{codec.json_type(value)}")
    example = example_pb2.Example()
    for name, content in value.items():
        example.features.feature[name].CopyFrom(_feature(name, content))
    return example


def _examples_input(doc: dict, method: str) -> input_pb2.Input:
    request_input = input_pb2.Input()
    examples = doc.get("examples")
    if examples is None:
        raise InvalidRequestError(f"JSON Value: {codec.compact(doc)} When method is {method}, "
                                  f"key 'examples' is expected and was not found")
    if not isinstance(examples, list):
        raise InvalidRequestError(f"JSON Value: {codec.compact(doc)} Expecting 'examples' value "
                                  f"to be an list/array")
    if not examples:
        raise InvalidRequestError(f"JSON Value: {codec.compact(doc)} 'examples' value is an "
                                  f"empty array")
    if "context" in doc:
        target = request_input.example_list_with_context
        target.context.CopyFrom(_example(doc["context"]))
    else:
        target = request_input.example_list
    for example in examples:
        target.examples.append(_example(example))
    return request_input


def _classify(manager: ModelManager, spec: model_pb2.ModelSpec, doc: dict,
              deadline: float | None = None) -> str:
    request_input = _examples_input(doc, "classify")
    with manager.acquire(**inference.spec_args(spec)) as version:
        result = inference.classify_on(version.servable, doc.get("signature_name", ""),
                                       request_input, deadline)
    return json_writer.classification_json(result)


def _regress(manager: ModelManager, spec: model_pb2.ModelSpec, doc: dict,
             deadline: float | None = None) -> str:
    request_input = _examples_input(doc, "regress")
    with manager.acquire(**inference.spec_args(spec)) as version:
        result = inference.regress_on(version.servable, doc.get("signature_name", ""),
                                      request_input, deadline)
    return json_writer.regression_json(result)


_POST_HANDLERS = {"predict": _predict, "classify": _classify, "regress": _regress}


def build_rest_app(manager: ModelManager, metrics=None, timeout_s: float = 30.0,
                   prometheus_path: str | None = None, registry=None,
                   cors: bool = False) -> FastAPI:
    """The TF Serving REST app; Prometheus at `prometheus_path` when monitoring is enabled,
    TF Serving's CORS headers with `cors` (--rest_api_enable_cors_support)."""
    app = FastAPI(title="tokenserve TF Serving REST API", docs_url=None, redoc_url=None,
                  openapi_url=None)
    if cors:
        @app.middleware("http")
        async def cors_headers(request: Request, call_next):
            if request.method == "OPTIONS":
                response = Response(status_code=200)
            else:
                response = await call_next(request)
            response.headers.update(_CORS_HEADERS)
            return response

    async def run(api: str, model_name: str, work) -> Response:
        """Runs `work(deadline)` off the event loop; the deadline bounds its TF run."""
        started = time.monotonic()
        deadline = started + timeout_s if timeout_s else None
        try:
            body = await asyncio.wait_for(run_in_threadpool(work, deadline),
                                          timeout_s + _BACKSTOP_S if timeout_s else None)
            status, code = 200, "OK"
            response = _json_response(body)
        except Exception as error:  # noqa: BLE001 - every error becomes TF Serving's body
            if isinstance(error, asyncio.TimeoutError):
                error = DeadlineExceededError(f"Request timed out after {timeout_s * 1000:.0f} "
                                              f"ms")
            status = error_http_status(error)
            if status == 500:
                log.error("%s failed", api, exc_info=error)
            code = error_grpc_code(error).name
            response = _json_response(error_body(error_message(error)), status)
        if metrics and model_name:
            metrics.request(model_name, api, ENTRYPOINT, code, time.monotonic() - started)
        return response

    if prometheus_path and registry is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        @app.get(prometheus_path)
        def prometheus() -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/{path:path}")
    async def get(request: Request) -> Response:
        match = _GET.match(request.url.path)
        if _ALL_MODELS.match(request.url.path):  # TF Serving has no "list all models"
            return _error(InvalidRequestError("Missing model name in request."))
        if not match:
            return _malformed(request)
        name, version, label, metadata = match.groups()
        metadata = metadata and metadata.lower()
        try:
            spec = _model_spec(name, version, label)
        except InvalidRequestError as error:
            return _error(error)
        if metadata:
            def work(deadline):
                request_proto = get_model_metadata_pb2.GetModelMetadataRequest(
                    model_spec=spec, metadata_field=[model_info.SIGNATURE_DEF_FIELD])
                return model_info.metadata_json(model_info.model_metadata(manager,
                                                                          request_proto))
            return await run("get_model_metadata", name, work)
        return await run("get_model_status", "", lambda deadline: model_info.status_json(
            model_info.model_status(manager, spec)))

    @app.post("/{path:path}")
    async def post(request: Request) -> Response:
        match = _POST.match(request.url.path)
        if not match:
            return _malformed(request)
        name, version, label, method = match.groups()
        method = method.lower()
        body = await request.body()
        try:
            spec = _model_spec(name, version, label)
        except InvalidRequestError as error:
            return _error(error)
        return await run(method, name, lambda deadline: _POST_HANDLERS[method](
            manager, spec, _parse_body(body), deadline))

    @app.api_route("/{path:path}", methods=_OTHER_METHODS)
    async def other(request: Request) -> Response:
        return _malformed(request)  # TF Serving serves GET and POST only

    return app


def _error(error: Exception) -> Response:
    return _json_response(error_body(error_message(error)), error_http_status(error))


def _malformed(request: Request) -> Response:
    return _error(InvalidRequestError(f"Malformed request: {request.method} "
                                      f"{request.url.path}"))
