"""Frontends: OpenAI-compatible HTTP, TF Serving REST and gRPC, our streaming gRPC service."""
