"""Custom TensorFlow CPU kernels, compiled from source on first use.

Import from the module itself: `from tokenserve.kernels.int8_matmul import int8_matmul,
quantize_weight, kernel_status` (the package does not re-export them: the function
`int8_matmul` would be shadowed by the submodule of the same name once it is imported).
"""
