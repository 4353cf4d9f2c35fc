"""`LLM`: offline batch generation through the continuous-batching engine."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

from tokenserve.engine.config import EngineConfig
from tokenserve.engine.core import LLMEngine
from tokenserve.engine.outputs import CompletionOutput, RequestOutput
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

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in order, with full texts and token ids.

        prompts: text, a list of texts, or a list of token-id lists.
        params: one SamplingParams for all prompts, or one per prompt.
        """
        from tqdm.auto import tqdm

        if isinstance(prompts, str):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        requests = [self.engine.make_request(i, p, f"offline-{n}")
                    for n, (i, p) in enumerate(zip(ids, per_prompt))]
        for request in requests:
            self.engine.add_request(request)
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_work:
                for output in self.engine.step():
                    self._accumulate(results, output)
                    bar.update(int(output.finished))
        return [results[r.request_id] for r in requests]

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
