"""What the engine picks for this CPU when left on auto: the compute dtype (--precision) and
how many tokens a float32 step runs through the fused dense ops rather than XLA."""

import pytest

from tokenserve.model import precision


@pytest.fixture
def flags(monkeypatch):
    """Pretend the CPU has exactly the given feature flags."""
    def set_flags(*names):
        monkeypatch.setattr(precision, "cpu_flags", lambda: set(names))
    return set_flags


def test_without_avx512_the_fused_ops_take_steps_of_up_to_32_tokens(flags, monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    flags("avx2", "fma", "f16c")
    tokens, why = precision.choose_fused_dense_tokens(None)
    assert tokens == 32 and "no AVX-512" in why


def test_with_avx512_xla_takes_steps_above_8_tokens(flags, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    flags("avx2", "fma", "avx512f", "avx512_bf16")
    tokens, why = precision.choose_fused_dense_tokens(None)
    assert tokens == 8 and "AVX-512" in why


@pytest.mark.parametrize("cap,tokens", [("AVX2", 32), ("avx", 32), ("AVX512", 8)])
def test_an_xla_isa_cap_counts_as_the_cpu_xla_has(flags, monkeypatch, cap, tokens):
    """Capped with --xla_cpu_max_isa=AVX2 (standing in for an AVX2-only CPU), XLA's dots are
    AVX2 code, so the choice is an AVX2-only CPU's."""
    monkeypatch.setenv("XLA_FLAGS", f"--xla_cpu_max_isa=AVX512 --xla_cpu_max_isa={cap}")
    flags("avx2", "fma", "avx512f")
    assert precision.choose_fused_dense_tokens(None)[0] == tokens


def test_bfloat16_weights_take_the_fused_ops_up_to_8_tokens_on_any_cpu(flags):
    """bfloat16 steps above the fused share run oneDNN's bf16 matmuls, not XLA, so the
    choice does not depend on XLA's instruction set."""
    for cpu in (("avx2",), ("avx2", "avx512f", "avx512_bf16")):
        flags(*cpu)
        tokens, why = precision.choose_fused_dense_tokens(None, "bfloat16")
        assert tokens == precision.BF16_FUSED_TOKENS == 8 and "bfloat16" in why
        assert precision.choose_fused_dense_tokens(3, "bfloat16") == (3, "set explicitly")


@pytest.mark.parametrize("setting", [0, 4, 1024])
def test_an_explicit_setting_is_kept_on_any_cpu(flags, setting):
    for cpu in (("avx2",), ("avx2", "avx512f")):
        flags(*cpu)
        assert precision.choose_fused_dense_tokens(setting) == (setting, "set explicitly")


def test_auto_precision_computes_in_bf16_only_where_the_cpu_multiplies_in_it(flags, monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    flags("avx2", "fma")
    assert precision.choose_precision("auto")[0] == "float32"
    flags("avx2", "avx512f", "avx512_bf16")
    assert precision.choose_precision("auto")[0] == "bfloat16"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN capped below bf16
    assert precision.choose_precision("auto")[0] == "float32"
    assert precision.choose_precision("auto", weight_format="int8")[0] == "float32"
