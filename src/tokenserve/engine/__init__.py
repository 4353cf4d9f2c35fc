"""Continuous-batching engine: requests, scheduler, KV-cache accounting, sampler/, drafts
and output processing (plain Python); the runner (runner.py and step/, the engine's only
TensorFlow); and the loop (core.py, async_engine.py, llm.py)."""
