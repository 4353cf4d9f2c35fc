"""`LLM`: offline batch generation through the continuous-batching engine."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from pathlib import Path

from tokenserve.engine.config import EngineConfig
from tokenserve.engine.core import LLMEngine
from tokenserve.engine.outputs import CompletionOutput, RequestOutput
from tokenserve.errors import QueueFullError
from tokenserve.sampling import SamplingParams


class LLM:
    """Generates for many prompts at once, all sharing one continuously batched engine.

    Example:
        >>> llm = LLM("models/builtin")
        >>> outs = llm.generate(["def main():", "import os"], SamplingParams(max_tokens=32))
        >>> outs[0].outputs[0].text
    """

    def __init__(self, model_dir: str | Path, engine_config: EngineConfig | None = None,
                 **engine_options):
        from tokenserve.engine.runner import ModelRunner

        config = (engine_config or EngineConfig()).replace(**engine_options)
        runner, tokenizer = ModelRunner.from_model_dir(model_dir, config)
        self.engine = LLMEngine(runner, tokenizer, config)
        self.tokenizer = tokenizer
        self._num_requests = 0  # request ids stay unique across calls

    @classmethod
    def from_model(cls, model, tokenizer, config, engine_config: EngineConfig | None = None,
                   **engine_options) -> "LLM":
        """An LLM over a model in memory (a DecoderLM and its GenerationConfig), no export."""
        from tokenserve.engine.runner import ModelRunner

        engine_config = (engine_config or EngineConfig()).replace(**engine_options)
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(ModelRunner(model, config, engine_config), tokenizer,
                               engine_config)
        llm.tokenizer, llm._num_requests = tokenizer, 0
        return llm

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order, with full texts and token ids.

        prompts: text, a list of texts, or a list of token-id lists; any number of them.
            They are fed to the engine as its queue drains (its request and token limits
            apply to what waits at once, not to the call).
        params: one SamplingParams for all prompts, or one per prompt.

        Raises:
            InvalidRequestError / PromptTooLongError: a prompt the engine refuses; nothing
                has run then (every prompt is checked first).
            QueueFullError: one prompt alone is over the queue's token limit.
        """
        from tqdm.auto import tqdm

        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        ids = [self.tokenizer.encode_prompts([p])[0] if isinstance(p, str) else list(p)
               for p in prompts]
        first = self._num_requests
        requests = [self.engine.make_request(i, p, f"offline-{first + n}")
                    for n, (i, p) in enumerate(zip(ids, per_prompt))]
        self._num_requests += len(requests)
        pending = deque(requests)
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(requests), desc="generate", unit="req",
                      disable=not use_tqdm) as bar:
                while pending or self.engine.has_work:
                    self._feed(pending)
                    for output in self.engine.step():
                        self._accumulate(results, output)
                        bar.update(int(output.finished))
        except BaseException:
            for request in requests:  # leave the engine empty for the next call
                self.engine.abort(request.request_id)
            raise
        return [results[r.request_id] for r in requests]

    def _feed(self, pending: deque) -> None:
        """Queues pending requests until the engine's queue is full."""
        while pending:
            try:
                self.engine.add_request(pending[0])
            except QueueFullError:
                if not self.engine.has_work:
                    raise  # over the limit on an empty queue: it can never be queued
                return
            pending.popleft()

    @staticmethod
    def _accumulate(results: dict[str, RequestOutput], delta: RequestOutput) -> None:
        total = results.setdefault(delta.request_id, RequestOutput(
            delta.request_id, delta.prompt_token_ids, [], False))
        by_index = {c.index: c for c in total.outputs}
        for piece in delta.outputs:
            seq = by_index.setdefault(piece.index, CompletionOutput(piece.index, "", [], None))
            seq.text += piece.text
            seq.token_ids.extend(piece.token_ids)
            if piece.logprobs is not None:
                seq.logprobs = (seq.logprobs or []) + piece.logprobs
            seq.finish_reason = piece.finish_reason or seq.finish_reason
            seq.stop_reason = piece.stop_reason if piece.stop_reason is not None else seq.stop_reason
        total.outputs = sorted(by_index.values(), key=lambda c: c.index)
        total.finished = delta.finished
        total.num_generated_tokens = delta.num_generated_tokens or total.num_generated_tokens
        total.metrics = delta.metrics or total.metrics
        total.num_cached_tokens = delta.num_cached_tokens or total.num_cached_tokens
