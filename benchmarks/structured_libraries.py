#!/usr/bin/env python
"""Which constrained-decoding library: llguidance, xgrammar and outlines-core on our tokenizers.

For each library and tokenizer (the built-in model's 8k byte-level BPE, the tests' 400-token
one, SmolLM2's 49k from its packaged GGUF), three JSON schemas: tokenizer setup time, schema
compile time, and per-token mask time along a random walk of allowed tokens (60 steps; the
walk's own bit unpacking is included, equally for all).

Usage: benchmarks/structured_libraries.py llguidance,xgrammar,outlines-core
Install the peers first (not project dependencies): outlines-core==0.2.14, and xgrammar==0.2.8
with apache-tvm-ffi (its triton dependency is only for GPUs: `pip install --no-deps --target
DIR xgrammar apache-tvm-ffi`, then XGRAMMAR_PATH=DIR). Writes
benchmarks/results/structured_libraries.json (one file per run; libraries merge into it).
"""
import json, os, sys, time, statistics
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
import numpy as np
from tokenizers import Tokenizer as HF

SCHEMAS = {
 "nested": {"type":"object","properties":{"name":{"type":"string","maxLength":12},"address":{"type":"object","properties":{"city":{"type":"string","maxLength":10},"zip":{"type":"integer"}},"required":["city","zip"],"additionalProperties":False}},"required":["name","address"],"additionalProperties":False},
 "enum_array": {"type":"object","properties":{"color":{"enum":["red","green","blue"]},"tags":{"type":"array","items":{"type":"string","maxLength":8},"maxItems":3}},"required":["color","tags"],"additionalProperties":False},
 "bounded": {"type":"object","properties":{"age":{"type":"integer","minimum":0,"maximum":120},"score":{"type":"number","minimum":0,"maximum":1}},"required":["age","score"],"additionalProperties":False},
}

def tokenizers():
    out = {}
    from tokenserve.model.checkpoint import BUILTIN_DIR
    out["builtin"] = (HF.from_file(str(BUILTIN_DIR / "tokenizer.json")), "<|eos|>")
    from conftest import TINY_TEXT
    from tokenserve.model.tokenizer import Tokenizer
    out["tiny400"] = (Tokenizer.train(TINY_TEXT, vocab_size=400).hf, "<|eos|>")
    from tokenserve.model.gguf import read_gguf
    from tokenserve.model.gguf_tokenizer import build_tokenizer
    from tokenserve.model.checkpoint import packaged_gguf
    tok = build_tokenizer(read_gguf(packaged_gguf("smollm2")))
    hf = getattr(tok, "hf", tok)
    out["smollm2"] = (hf, "<|im_end|>")
    return out

def walk(n_vocab, compute, consume, steps=60, seed=0):
    """random valid walk; returns per-step mask times"""
    rng = np.random.default_rng(seed); times=[]
    for _ in range(steps):
        t=time.perf_counter(); allowed = compute(); times.append(time.perf_counter()-t)
        if allowed is None or len(allowed)==0: break
        tok = int(rng.choice(allowed))
        if not consume(tok): break
    return times

def bits_to_ids(bm, n):
    bits = np.unpackbits(bm.view(np.uint8), bitorder="little")[:n]
    return np.nonzero(bits)[0]

def llg(hf, eos, name):
    import llguidance as L
    t=time.perf_counter(); tok = L.LLTokenizer(hf.to_str(), eos_token=hf.token_to_id(eos)); tinit=time.perf_counter()-t
    n = tok.vocab_size
    res={"tokenizer_init_s":tinit}
    for sname, s in SCHEMAS.items():
        t=time.perf_counter(); m = L.LLMatcher(tok, L.LLMatcher.grammar_from_json_schema(json.dumps(s))); tc=time.perf_counter()-t
        assert not m.is_error(), m.get_error()
        bm = np.zeros((1,(n+31)//32), np.int32)
        from llguidance.numpy import fill_next_token_bitmask
        def compute():
            if m.is_stopped(): return None
            fill_next_token_bitmask(m, bm, 0); return bits_to_ids(bm[0], n)
        times = walk(n, compute, m.consume_token)
        res[sname]={"compile_ms":tc*1e3,"mask_ms_median":statistics.median(times)*1e3,"mask_ms_max":max(times)*1e3,"steps":len(times)}
    return res

def xg(hf, eos, name):
    sys.path.insert(0, os.environ.get("XGRAMMAR_PATH", ""))
    import xgrammar as X, transformers, torch
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=hf, eos_token=eos)
    t=time.perf_counter(); info = X.TokenizerInfo.from_huggingface(fast, vocab_size=hf.get_vocab_size()); comp = X.GrammarCompiler(info); tinit=time.perf_counter()-t
    n=hf.get_vocab_size(); res={"tokenizer_init_s":tinit}
    for sname, s in SCHEMAS.items():
        t=time.perf_counter(); cg = comp.compile_json_schema(json.dumps(s)); tc=time.perf_counter()-t
        m = X.GrammarMatcher(cg); bm = X.allocate_token_bitmask(1, n)
        def compute():
            if m.is_terminated(): return None
            m.fill_next_token_bitmask(bm); return bits_to_ids(bm[0].numpy(), n)
        times = walk(n, compute, m.accept_token)
        res[sname]={"compile_ms":tc*1e3,"mask_ms_median":statistics.median(times)*1e3,"mask_ms_max":max(times)*1e3,"steps":len(times)}
    return res

def oc(hf, eos, name):
    from outlines_core import Vocabulary, Index, Guide
    from outlines_core.json_schema import build_regex_from_schema
    t=time.perf_counter()
    eos_id = hf.token_to_id(eos); vocab={}
    for tokstr, i in hf.get_vocab().items():
        if i==eos_id: continue
        vocab.setdefault(tokstr, []).append(i)
    v = Vocabulary(eos_id, vocab); tinit=time.perf_counter()-t
    n=hf.get_vocab_size(); res={"tokenizer_init_s":tinit}
    for sname, s in SCHEMAS.items():
        t=time.perf_counter(); idx = Index(build_regex_from_schema(json.dumps(s)), v); tc=time.perf_counter()-t
        g = Guide(idx)
        bm = np.zeros((1,(n+31)//32), np.int32)
        def compute():
            if g.is_finished(): return None
            g.write_mask_into(bm.ctypes.data, bm.size, 4); return bits_to_ids(bm[0], n)
        def consume(tk):
            try: g.advance(tk, return_tokens=False); return True
            except Exception: return False
        times = walk(n, compute, consume)
        res[sname]={"compile_ms":tc*1e3,"mask_ms_median":statistics.median(times)*1e3,"mask_ms_max":max(times)*1e3,"steps":len(times)}
    return res

if __name__ == "__main__":
    toks = tokenizers(); out={}
    for lib in sys.argv[1].split(","):
        for tname,(hf,eos) in toks.items():
            try:
                r = {"llguidance":llg,"xgrammar":xg,"outlines-core":oc}[lib](hf,eos,tname)
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
            out[f"{lib}/{tname}"]=r; print(lib, tname, json.dumps(r), flush=True)
    path = Path(__file__).parent / "results" / "structured_libraries.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps(merged | out, indent=1) + "\n")
