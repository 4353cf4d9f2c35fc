"""OpenAI-compatible HTTP frontend: `build_openai_app(models, config, stats)`."""

from tokenserve.server.openai.app import build_openai_app
from tokenserve.server.openai.config import OpenAIServerConfig
from tokenserve.server.openai.models import ModelCard, ModelResolver, StaticModels

__all__ = ["build_openai_app", "OpenAIServerConfig", "ModelCard", "ModelResolver",
           "StaticModels"]
