"""A tiny Qwen2-style checkpoint (random weights, the shared tiny tokenizer, Qwen2.5's chat
template with its tool syntax), imported and exported once per test session. No tests here."""

from __future__ import annotations

import json
from pathlib import Path

from support.tiny_models import TINY_TEXT

QWEN2_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}"
    "{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n"
    "<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}"
    "{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}"
    "{{- '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen2.5-Instruct's template (tools in a system block, Hermes-style <tool_call> blocks,
tool results as <tool_response> in a user turn)."""

_EXPORTED: dict = {}


def qwen2_tiny_dir(tmp_path_factory) -> Path:
    """The exported tiny Qwen2-style model (one import and export per test session)."""
    if "dir" in _EXPORTED:
        return _EXPORTED["dir"]
    import torch
    import transformers

    from tokenserve.export.exporter import export_model
    from tokenserve.model.hf import load_hf
    from tokenserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.train(TINY_TEXT, vocab_size=400)
    config = transformers.Qwen2Config(
        vocab_size=400, max_position_embeddings=2048, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    checkpoint = tmp_path_factory.mktemp("qwen2-tiny-hf")
    transformers.Qwen2ForCausalLM(config).eval().save_pretrained(checkpoint,
                                                                 safe_serialization=True)
    tokenizer.save(checkpoint / "tokenizer.json")
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
         "chat_template": QWEN2_CHAT_TEMPLATE}))
    model, hf_tokenizer, generation = load_hf(checkpoint)
    _EXPORTED["dir"] = export_model(model, hf_tokenizer, generation,
                                    tmp_path_factory.mktemp("qwen2-tiny"), jit_compile=False)
    return _EXPORTED["dir"]
