"""The newer decoder families on the one TransformerConfig: Qwen3 (QK-norm), Mistral (a
sliding window), Gemma 2 and 3 (soft caps, local and global layers, post-norms, GeGLU,
scaled embeddings), Phi-3 (fused projections, partial rotary).

What each reads from a Hugging Face config.json (hf_configs.py) or a GGUF file's metadata
(gguf_configs.py), and where its tensors go (tensor_names.py). model/hf.py and model/gguf.py
dispatch here for the architectures these modules name; GPT-2, Llama and Qwen2 stay there.
"""

from tokenserve.model.families.gguf_configs import GGUF_ARCHITECTURES, gguf_config
from tokenserve.model.families.hf_configs import HF_ARCHITECTURES, hf_config
from tokenserve.model.families.tensor_names import (gguf_layer_names, gguf_tensor_value,
                                                    hf_tensor_names)

__all__ = ["GGUF_ARCHITECTURES", "HF_ARCHITECTURES", "gguf_config", "gguf_layer_names",
           "gguf_tensor_value", "hf_config", "hf_tensor_names"]
