"""tokenserve.v1.GenerationService: server-streaming generation over gRPC (grpc.aio).

The servicer turns a GenerateRequest into prompt ids and SamplingParams, runs it through the
engine the ModelResolver picks, and streams one GenerateResponse per engine output. Errors are
mapped through server/status.py. When the client cancels (or its deadline passes), grpc.aio
cancels the handler; its `finally` closes the engine iterator, which aborts the request. The
engine also gets the call's remaining time as its timeout; a request it aborts at that
deadline ends, after the outputs streamed so far, with status DEADLINE_EXCEEDED.

Example (the integrator's wiring on the gRPC port, beside TF Serving's services):
    server = grpc.aio.server()
    add_generation_service(server, models, api_keys=APIKeys.from_sources(args.api_key))
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import ExitStack

import grpc
from google.protobuf.message import DecodeError

from tokenserve.engine.guided import check_structured
from tokenserve.errors import TokenserveError
from tokenserve.sampling import GuideKind, SamplingParams, StructuredOutput
from tokenserve.server.auth import APIKeys
from tokenserve.server.config import REQUEST_TIMEOUT_S
from tokenserve.server.openai.embeddings import require_generator
from tokenserve.server.openai.formatting import MIN_LOGPROB, token_text
from tokenserve.server.openai.models import ModelResolver
from tokenserve.server.openai.params import (bad_request, engine_seed, max_new_tokens,
                                             prompt_token_ids, request_timeout)
from tokenserve.server.openai.streams import MergedOutputs, trace_context
from tokenserve.server.proto.tokenserve import generation_pb2 as pb
from tokenserve.server.proto.tokenserve import generation_pb2_grpc as pb_grpc
from tokenserve.server.status import grpc_code, grpc_details

DEFAULT_MAX_TOKENS = 16
"""As in the OpenAI completions API, when SamplingOptions.max_tokens is unset."""

_OPTIONAL = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "n", "logprobs")


_GUIDED_KINDS = {"guided_json": GuideKind.JSON_SCHEMA, "guided_regex": GuideKind.REGEX,
                 "guided_choice": GuideKind.CHOICE, "guided_grammar": GuideKind.GRAMMAR}


def structured_output(options: pb.SamplingOptions) -> StructuredOutput | None:
    """The `guided` oneof as a checked StructuredOutput (None when unset).

    Raises:
        InvalidRequestError: the constraint is invalid (naming the field and the problem).
    """
    name = options.WhichOneof("guided")
    if name is None:
        return None
    value = getattr(options, name)
    spec = tuple(value.choices) if name == "guided_choice" else value
    structured = StructuredOutput(_GUIDED_KINDS[name], spec)
    check_structured(structured, name)
    return structured


def sampling_params(options: pb.SamplingOptions, max_tokens: int) -> SamplingParams:
    """SamplingOptions (unset fields: SamplingParams defaults) to SamplingParams.

    Raises:
        InvalidRequestError: a value out of range, or an invalid output constraint.
    """
    values = {name: getattr(options, name) for name in _OPTIONAL if options.HasField(name)}
    if "seed" in values:
        values["seed"] = engine_seed(values["seed"])
    return SamplingParams(max_tokens=max_tokens, stop=list(options.stop),
                          stop_token_ids=list(options.stop_token_ids),
                          ignore_eos=options.ignore_eos, structured=structured_output(options),
                          **values)


class GenerationServicer(pb_grpc.GenerationServiceServicer):
    """GenerationService over the engines of a ModelResolver."""

    def __init__(self, models: ModelResolver, api_keys: APIKeys | None = None,
                 request_timeout_s: float | None = REQUEST_TIMEOUT_S):
        self.models = models
        self.api_keys = api_keys or APIKeys()
        self.request_timeout_s = request_timeout_s

    def _prepare(self, request: pb.GenerateRequest, engine, metadata,
                 remaining: float | None) -> MergedOutputs:
        """The engine inputs of a request; raises TokenserveError. Blocking (it tokenizes):
        Generate runs it off the event loop, which the TF Serving services on this port
        share. It touches no model version: Generate acquires that on the loop, so a call
        cancelled meanwhile cannot leave a version held."""
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise bad_request("GenerateRequest needs a prompt: set text or token_ids.", "prompt")
        prompt = request.text if kind == "text" else list(request.token_ids.ids)
        prompt_ids = prompt_token_ids(prompt, engine.tokenizer, engine.config.model.vocab_size,
                                      max_prompts=1, max_model_len=engine.max_model_len)[0]
        options = request.sampling
        requested = options.max_tokens if options.HasField("max_tokens") else None
        max_tokens = max_new_tokens(requested, "max_tokens", len(prompt_ids),
                                    engine.max_model_len, DEFAULT_MAX_TOKENS)
        params = sampling_params(options, max_tokens)
        timeout_s = request_timeout(request.timeout_s if request.HasField("timeout_s") else None,
                                    self.request_timeout_s)
        if remaining is not None and (timeout_s is None or remaining < timeout_s):
            timeout_s = max(remaining, 1e-3)
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        return MergedOutputs(engine, [prompt_ids], params, request_id, request.priority,
                             timeout_s, trace_context(metadata))

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        """Streams the request's outputs; aborts the engine request if the call goes away."""
        outputs = None
        with ExitStack() as held:  # holds the model version until the stream ends
            try:
                try:
                    if isinstance(request, _Undecodable):
                        raise bad_request(f"The request is not a valid GenerateRequest: "
                                          f"{request.error}")
                    metadata = context.invocation_metadata()
                    self.api_keys.check_grpc_metadata(metadata)
                    model_id = request.model or self.models.default_model()
                    engine = held.enter_context(self.models.acquire(model_id))
                    require_generator(engine, model_id)
                    tokenizer = engine.tokenizer
                    outputs = await asyncio.to_thread(self._prepare, request, engine, metadata,
                                                      context.time_remaining())
                    await outputs.start()
                except TokenserveError as error:
                    await context.abort(grpc_code(error), grpc_details(str(error)))
                num_generated, first, deadline_passed = 0, True, False
                async for _, output in outputs:
                    num_generated = max(output.num_generated_tokens, num_generated
                                        + sum(len(o.token_ids) for o in output.outputs))
                    response = pb.GenerateResponse(
                        request_id=output.request_id, model=model_id, finished=output.finished,
                        outputs=[_delta(tokenizer, seq) for seq in output.outputs],
                        prompt_token_ids=output.prompt_token_ids if first else [])
                    first = False
                    if output.finished:
                        prompt_tokens = len(output.prompt_token_ids)
                        response.usage.CopyFrom(pb.Usage(
                            prompt_tokens=prompt_tokens, completion_tokens=num_generated,
                            total_tokens=prompt_tokens + num_generated))
                    yield response
                    deadline_passed |= any(outputs.deadline_passed(seq.finish_reason)
                                           for seq in output.outputs)
                if deadline_passed:  # outputs so far were streamed; the status says why it ended
                    error = outputs.deadline_error()
                    await context.abort(grpc_code(error), grpc_details(str(error)))
            except TokenserveError as error:  # engine failure mid-stream
                await context.abort(grpc_code(error), grpc_details(str(error)))
            finally:
                if outputs is not None:
                    await outputs.aclose()  # no-op when finished; aborts when cancelled


def _delta(tokenizer, seq) -> pb.SequenceDelta:
    delta = pb.SequenceDelta(index=seq.index, text=seq.text, token_ids=seq.token_ids,
                             finish_reason=seq.finish_reason.value if seq.finish_reason else "")
    if isinstance(seq.stop_reason, str):
        delta.stop_string = seq.stop_reason
    elif isinstance(seq.stop_reason, int):
        delta.stop_token_id = seq.stop_reason
    for entry in seq.logprobs or ():
        delta.logprobs.append(pb.TokenLogprob(
            token_id=entry.token_id, token=token_text(tokenizer, entry.token_id),
            logprob=max(entry.logprob, MIN_LOGPROB),
            top=[pb.TopLogprob(token_id=t, token=token_text(tokenizer, t),
                               logprob=max(lp, MIN_LOGPROB)) for t, lp in entry.top]))
    return delta


def add_generation_service(grpc_server: grpc.aio.Server, models: ModelResolver,
                           api_keys: APIKeys | None = None,
                           request_timeout_s: float | None = REQUEST_TIMEOUT_S) -> GenerationServicer:
    """Registers tokenserve.v1.GenerationService on a grpc.aio server.

    Args:
        grpc_server: a `grpc.aio.server()` running on the engines' event loop.
        models: model id -> engine.
        api_keys: when enabled, calls need metadata `authorization: Bearer <key>`.
        request_timeout_s: the server's deadline for a request (a call's own gRPC deadline
            and `timeout_s` can shorten it).
    """
    servicer = GenerationServicer(models, api_keys, request_timeout_s)
    # As the generated add_GenerationServiceServicer_to_server, but with a request parser
    # that hands undecodable bytes to the servicer (INVALID_ARGUMENT) instead of letting
    # grpc answer UNKNOWN.
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=_parse_request,
        response_serializer=pb.GenerateResponse.SerializeToString)}
    grpc_server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    grpc_server.add_registered_method_handlers(SERVICE_NAME, handlers)
    return servicer


SERVICE_NAME = "tokenserve.v1.GenerationService"


class _Undecodable:
    """Request bytes that are not a GenerateRequest (e.g. a string field with bad UTF-8)."""

    def __init__(self, error: Exception):
        self.error = error


def _parse_request(data: bytes) -> pb.GenerateRequest | _Undecodable:
    try:
        return pb.GenerateRequest.FromString(data)
    except DecodeError as error:
        return _Undecodable(error)
