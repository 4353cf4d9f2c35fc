"""What a model computes with on this CPU: the dtype the runner and the loader agree on, and
where the engine's float32 dense half runs (fused ops or XLA). Imports no TensorFlow."""

from __future__ import annotations

import os
import re

from tokenserve.host.cpu_flags import cpu_flags as flags_line


def cpu_flags() -> set[str]:
    """The CPU's feature flags, as the kernel builds key their cache on them."""
    return set(flags_line().split())


def cpu_has_bf16() -> bool:
    """True when the CPU has AMX or AVX512-BF16, where oneDNN's bf16 matmuls pay, and
    oneDNN is allowed to use them: ONEDNN_MAX_CPU_ISA=AVX2 (say) caps it below bf16, and
    oneDNN then fails to create bf16 matmuls at all."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
           or "ALL").upper()
    capped = cap not in ("ALL", "DEFAULT") and "BF16" not in cap and "AMX" not in cap \
        and "FP16" not in cap and "AVX10" not in cap
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags()) and not capped


def choose_precision(precision: str, weight_format: str = "float") -> tuple[str, str]:
    """(compute dtype, why) for an engine's `precision` setting on this CPU."""
    if weight_format == "int8":
        return "float32", ("int8 weights: the int8 kernel multiplies in float32 "
                           "(bfloat16 would only add casts)")
    if weight_format == "gguf":
        return "float32", ("GGUF blocks: the block kernels multiply in float32 "
                           "(bfloat16 would only add casts)")
    if precision != "auto":
        return precision, "set explicitly"
    if cpu_has_bf16():
        found = sorted({"amx_bf16", "avx512_bf16"} & cpu_flags())
        return "bfloat16", (f"the CPU has {', '.join(found)}: oneDNN's bf16 matmuls beat "
                            f"float32 (benchmarks/precision.py)")
    return "float32", ("the CPU has neither AMX nor AVX512-BF16: bf16 would be emulated, so "
                       "float32 with XLA-compiled dense layers")


def resolve_precision(precision: str, weight_format: str = "float") -> str:
    return choose_precision(precision, weight_format)[0]


def xla_has_avx512() -> bool:
    """True when XLA's CPU code may use AVX-512 here: the CPU has it and XLA_FLAGS does not cap
    XLA below it (--xla_cpu_max_isa=AVX2, as when standing in for an AVX2-only CPU)."""
    if "avx512f" not in cpu_flags():
        return False
    caps = re.findall(r"--xla_cpu_max_isa=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return not caps or caps[-1].upper() not in ("SSE4_2", "AVX", "AVX2")


# bfloat16 weights: the fused ops (float32 arithmetic on widened weights) win while a step
# is bound by reading the weights; oneDNN's bf16 matmuls win once it is not (measured with
# in-process runs on a 2-core Zen 5 EPYC with AVX512-BF16; see
# docs/engine.md, "bfloat16 weights through the fused ops").
BF16_FUSED_TOKENS = 8


def choose_fused_dense_tokens(setting: int | None,
                              compute_dtype: str = "float32") -> tuple[int, str]:
    """(most tokens a float32 step runs through the fused dense ops rather than XLA, why).

    XLA's CPU dots use AVX-512 where the CPU has it and XLA is not capped below it; the fused
    ops are AVX2 code. Measured with benchmarks/fused_dense.py on GPT-2-small (docs/engine.md):
    with XLA on AVX2 (an AVX2-only EPYC) the ops, with their packed register-tiled kernel
    from 8 rows, beat XLA's programs up to 32 tokens (decoding 32 sequences 0.69-0.75x the
    step time, prefilling 32 tokens 0.59-0.63x) and lose at 64 (0.92-1.13x); with XLA on
    AVX-512 (a Sapphire Rapids Xeon uncapped, before that kernel) they won up to 8 (0.77x)
    and tied at 16."""
    if setting is not None:
        return setting, "set explicitly"
    if compute_dtype == "bfloat16":
        return BF16_FUSED_TOKENS, ("bfloat16 weights: the fused ops stream them at the memory's "
                                   "rate for a few tokens, oneDNN's bf16 matmuls win above")
    if xla_has_avx512():
        return 8, ("XLA may use AVX-512 here: its dot code catches up with the fused ops by "
                   "16 tokens")
    return 32, ("XLA has no AVX-512 here: the fused ops beat XLA's AVX2 programs up to 32 "
                "tokens")
