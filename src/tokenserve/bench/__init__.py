"""`tokenserve bench`: a load generator for any OpenAI-compatible endpoint.

dataset (what to send) -> load (when to send it) -> client (send, time the stream)
-> metrics (vLLM bench serve's definitions) -> report (table, JSON, PNG).
"""
