"""The engine's compiled steps, one family each (design notes: docs/engine.md).

    transformer.py   TransformerStep: the KV cache, the traced step, its LM heads
    graph_blocks.py  the dense half of every block as TF ops (XLA for float32 weights)
    fused_blocks.py  the same as the fused ops (kernels/dense.py), for steps of a few tokens
    attention.py     attention over the paged cache: the fused op, or the gathered graph path
    head.py          the LM head's int8 or float16 screen, for steps that need only an argmax
    lstm.py          LSTMStep: (h, c) state slots
    packing.py       scheduled tokens -> the step's index arrays, and bucket sizes (no TF)
    flat_call.py     calling a traced step without binding its signature

Import the modules themselves: this package imports nothing, so the runner can read
packing.py's plain Python without loading TensorFlow.
"""
