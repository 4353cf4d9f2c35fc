"""LoRA fine-tuning: a frozen TransformerLM plus trainable low-rank factors, trained by the
trainer's loop and written as a PEFT adapter that peft and tokenserve both load.

The factors are kept in PEFT's own layout and names (per layer and module, A [r, in] and
B [out, r], scale alpha / r), so writing the adapter is a rename. A starts small and random,
B at zero, as PEFT initialises them: before the first step the model is the base model.
The forward pass is the model's own full forward (embed, pre-norm blocks, head) with each
targeted module's output gaining `scale * x @ A.T @ B.T`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import tensorflow as tf

from tokenserve.engine.lora_adapter import (CONFIG_FILE, WEIGHTS_FILE, family_modules,
                                            role_columns, role_shapes)
from tokenserve.errors import ConfigError
from tokenserve.model.layers import apply_rope, attend, layer_rope_angles, linear, norm
from tokenserve.train.trainer import Trainer

ROLE_ORDER = {"qkv": ("q", "k", "v"), "up": ("gate", "up")}
"""The parts of a fused role, in our matrix's column order (others: one part, "all")."""


def _check_trainable(c) -> None:
    """Refuses a model whose forward LoraModel does not compute (it runs GPT-2's and the
    Llama family's plain blocks, with a partial rotary)."""
    unsupported = [name for name, present in (
        ("QK-norm", c.qk_norm), ("post-norms", c.post_norms), ("GeGLU", c.mlp == "geglu"),
        ("sliding windows", any(c.sliding_windows)),
        ("softcaps", c.attn_softcap or c.final_softcap),
        ("a score scale of its own", c.attn_scale), ("experts", c.num_experts),
        ("RoPE's attention factor", c.rope_attention_factor != 1.0)) if present]
    if unsupported:
        raise ConfigError(f"LoRA fine-tuning does not compute {unsupported[0]} (this model "
                          f"has it); it trains GPT-2's and Llama-style blocks")


class LoraModel(tf.Module):
    """`model` (frozen) with trainable LoRA factors on `targets` (PEFT module names of the
    model's own checkpoint: q_proj, ..., Phi-3's qkv_proj, o_proj, gate_up_proj, down_proj,
    or GPT-2's c_attn, c_proj, c_fc; None: every one of them).

    Called like the model: int32 [B, T] -> float32 logits [B, T, vocab]."""

    def __init__(self, model, rank: int, alpha: float | None = None,
                 targets: list[str] | None = None, seed: int = 0):
        super().__init__(name="lora_model")
        self.model, self.config = model, model.config
        self.rank, self.alpha = rank, float(alpha if alpha is not None else 2 * rank)
        self.scale = self.alpha / rank
        c = model.config
        _check_trainable(c)
        self.gpt2 = c.mlp == "gelu"
        modules = family_modules(c)
        short = {name: name.rsplit(".", 1)[-1] for name in modules}
        wanted = set(targets or short.values())
        unknown = wanted - set(short.values())
        if unknown:
            from tokenserve.engine.lora_adapter import LoraTargetError

            raise LoraTargetError(f"unknown LoRA target {sorted(unknown)[0]!r}; this model's: "
                                  f"{', '.join(sorted(set(short.values())))}")
        self.modules = {name: part for name, part in modules.items() if short[name] in wanted}
        self.targets = sorted(wanted)
        columns, shapes = role_columns(c), role_shapes(c)
        rng = np.random.default_rng(seed)
        self.factors: dict[tuple[int, str], tuple[tf.Variable, tf.Variable]] = {}
        for layer in range(c.num_layers):
            for name, (role, part) in self.modules.items():
                width_in = shapes[role][0]
                first, end = columns[role][part]
                bound = 1.0 / math.sqrt(width_in)  # PEFT's kaiming_uniform(a=sqrt(5)) on A
                a = rng.uniform(-bound, bound, [rank, width_in]).astype(np.float32)
                self.factors[(layer, name)] = (
                    tf.Variable(a, name=f"l{layer}_{name}_A"),
                    tf.Variable(tf.zeros([end - first, rank]), name=f"l{layer}_{name}_B"))
        self.columns = columns

    @property
    def trainable_variables(self):
        return [v for pair in self.factors.values() for v in pair]

    def _delta(self, x, layer: int, role: str):
        """x [..., in] -> the role's delta [..., out], or None where no module of it is
        targeted."""
        names = {part: name for name, (r, part) in self.modules.items() if r == role}
        if not names:
            return None
        # one module for the whole role (GPT-2's, Phi-3's fused ones), or one per part
        parts = ("all",) if "all" in names else ROLE_ORDER[role]
        pieces = []
        for part in parts:
            first, end = self.columns[role][part]
            if part not in names:
                pieces.append(tf.zeros(tf.concat([tf.shape(x)[:-1], [end - first]], 0),
                                       x.dtype))
                continue
            a, b = self.factors[(layer, names[part])]
            pieces.append(tf.matmul(tf.matmul(x, a, transpose_b=True), b, transpose_b=True)
                          * self.scale)
        return pieces[0] if len(pieces) == 1 else tf.concat(pieces, -1)

    def _project(self, x, weights: dict, layer: int, role: str):
        y = linear(x, weights)
        delta = self._delta(x, layer, role)
        return y if delta is None else y + delta

    def __call__(self, token_ids):
        m, c = self.model, self.config
        token_ids = tf.cast(token_ids, tf.int32)
        batch, length = tf.shape(token_ids)[0], tf.shape(token_ids)[1]
        positions = tf.broadcast_to(tf.range(length)[None, :], [batch, length])
        causal = tf.range(length)[None, :] <= tf.range(length)[:, None]    # [T, T]
        mask = tf.broadcast_to(causal[None], [batch, length, length])
        x = m.embed(token_ids, positions)                                    # [B, T, D]
        q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        for i, block in enumerate(m.blocks):
            h = norm(x, block.attn_norm.weights_dict(), c.norm, c.norm_eps)
            qkv = self._project(h, block.attn.qkv.weights_dict(), i, "qkv")
            q, k, v = tf.split(qkv, [q_width, kv_width, kv_width], -1)
            q = tf.reshape(q, [batch, length, c.num_heads, c.head_dim])
            k = tf.reshape(k, [batch, length, c.num_kv_heads, c.head_dim])
            v = tf.reshape(v, [batch, length, c.num_kv_heads, c.head_dim])
            if c.position == "rope":
                cos, sin = layer_rope_angles(c, i, positions, q.dtype)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            attn = attend(q, k, v, mask)                                     # [B, T, H*Dh]
            x = x + self._project(attn, block.attn.out.weights_dict(), i, "out")
            h = norm(x, block.mlp_norm.weights_dict(), c.norm, c.norm_eps)
            u = self._project(h, block.mlp.up.weights_dict(), i, "up")
            if c.mlp == "swiglu":
                gate, up = tf.split(u, 2, axis=-1)
                u = tf.nn.silu(gate) * up
            else:
                u = tf.nn.gelu(u, approximate=True)
            x = x + self._project(u, block.mlp.down.weights_dict(), i, "down")
        return m.head_logits(x)

    def save_adapter(self, directory: str | Path, base_model: str = "") -> Path:
        """Writes the factors as a PEFT adapter (adapter_config.json and
        adapter_model.safetensors, PEFT's tensor names for this family)."""
        from safetensors.numpy import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        stem = "base_model.model.transformer.h" if self.gpt2 else "base_model.model.model.layers"
        tensors = {}
        for (layer, name), (a, b) in self.factors.items():
            tensors[f"{stem}.{layer}.{name}.lora_A.weight"] = a.numpy()
            tensors[f"{stem}.{layer}.{name}.lora_B.weight"] = b.numpy()
        save_file(tensors, str(directory / WEIGHTS_FILE))
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank,
                  "lora_alpha": self.alpha, "lora_dropout": 0.0, "bias": "none",
                  "target_modules": self.targets, "fan_in_fan_out": self.gpt2,
                  "base_model_name_or_path": base_model, "inference_mode": True,
                  "use_rslora": False, "use_dora": False, "init_lora_weights": True,
                  "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None,
                  "layers_to_transform": None, "layers_pattern": None, "revision": None}
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        return directory


class LoraTrainer(Trainer):
    """The trainer's loop on a LoraModel: checkpoints hold the factors, not the base."""

    def _save(self, step: int, seconds: float, loss: float) -> None:
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        np.savez(self.checkpoint_dir / "lora.npz", *[v.numpy() for v in
                                                      self.model.trainable_variables])
        np.savez(self.checkpoint_dir / "optimizer.npz",
                 *[v.numpy() for v in self.optimizer.variables])
        (self.checkpoint_dir / "state.json").write_text(
            json.dumps({"step": step, "seconds": seconds, "loss": loss}))

    def _restore(self) -> tuple[int, float, float]:
        state_path = self.checkpoint_dir / "state.json"
        if not state_path.exists():
            return 0, 0.0, float("nan")
        state = json.loads(state_path.read_text())
        for saved, variables in (("lora.npz", self.model.trainable_variables),
                                 ("optimizer.npz", self.optimizer.variables)):
            arrays = np.load(self.checkpoint_dir / saved)
            for i, variable in enumerate(variables):
                variable.assign(arrays[f"arr_{i}"])
        return state["step"], state["seconds"], state.get("loss", float("nan"))
