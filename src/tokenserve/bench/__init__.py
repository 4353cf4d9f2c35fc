"""`tokenserve bench`: a load generator for any OpenAI-compatible endpoint.

dataset (what to send) -> load (when to send it) -> client (send, time the stream)
-> metrics (vLLM bench serve's definitions) -> run (one run per request rate)
-> report (JSON run records, table) and plots (PNG).
"""
