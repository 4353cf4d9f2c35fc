"""LoRA fine-tuning: a frozen TransformerLM plus trainable low-rank factors, trained by the
trainer's loop and written as a PEFT adapter that peft and tokenserve both load.

The factors are kept in PEFT's own layout and names (per layer and module, A [r, in] and
B [out, r], scale alpha / r), so writing the adapter is a rename. A starts small and random,
B at zero, as PEFT initialises them: before the first step the model is the base model.
The forward pass is the model's own (model.layers.lora_factors: each targeted Dense layer
adds x @ A @ B), with the factors fused per role as an adapter is served
(lora_adapter.fuse_role, from the variables, so gradients reach them): every family the
model computes trains, QK-norms, post-norms, windows and softcaps included.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import tensorflow as tf

from tokenserve.engine.lora_adapter import (CONFIG_FILE, WEIGHTS_FILE, LoraTargetError,
                                            block_factors, family_modules, fuse_role,
                                            role_columns, role_shapes)
from tokenserve.model.layers import lora_factors
from tokenserve.train.trainer import Trainer

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
"""What LoRA trains on a mixture of experts."""


def _trainable_modules(config) -> dict[str, tuple[str, str]]:
    """The modules LoRA trains on this model (torch path inside a block -> (role, part)):
    its checkpoint's own; on a mixture of experts, the attention projections only (the
    server serves adapters of the experts, shared expert and router too, but the trainer
    does not make them yet)."""
    modules = family_modules(config)
    if not config.num_experts:
        return modules
    return {name: part for name, part in modules.items()
            if name.rsplit(".", 1)[-1] in ATTENTION_MODULES}


class LoraModel(tf.Module):
    """`model` (frozen) with trainable LoRA factors on `targets` (PEFT module names of the
    model's own checkpoint: q_proj, ..., Phi-3's qkv_proj, o_proj, gate_up_proj, down_proj,
    or GPT-2's c_attn, c_proj, c_fc; a mixture of experts' q/k/v/o_proj; None: every one of
    them).

    Called like the model: int32 [B, T] -> float32 logits [B, T, vocab]."""

    def __init__(self, model, rank: int, alpha: float | None = None,
                 targets: list[str] | None = None, seed: int = 0):
        super().__init__(name="lora_model")
        self.model, self.config = model, model.config
        self.rank, self.alpha = rank, float(alpha if alpha is not None else 2 * rank)
        self.scale = self.alpha / rank
        c = model.config
        self.gpt2 = c.mlp == "gelu"
        modules = _trainable_modules(c)
        short = {name: name.rsplit(".", 1)[-1] for name in modules}
        wanted = set(targets or short.values())
        unknown = wanted - set(short.values())
        if unknown:
            experts = (" (a mixture of experts trains its attention projections only)"
                       if c.num_experts else "")
            raise LoraTargetError(f"unknown LoRA target {sorted(unknown)[0]!r}; this model's: "
                                  f"{', '.join(sorted(set(short.values())))}{experts}")
        self.modules = {name: part for name, part in modules.items() if short[name] in wanted}
        self.targets = sorted(wanted)
        columns, self.shapes = role_columns(c), role_shapes(c)
        rng = np.random.default_rng(seed)
        self.factors: dict[tuple[int, str], tuple[tf.Variable, tf.Variable]] = {}
        # (layer, role) -> its modules' (first, end, name), as fuse_role places them
        self.parts: dict[tuple[int, str], list[tuple[int, int, str]]] = {}
        for layer in range(c.num_layers):
            for name, (role, part) in self.modules.items():
                width_in = self.shapes[role][0]
                first, end = columns[role][part]
                bound = 1.0 / math.sqrt(width_in)  # PEFT's kaiming_uniform(a=sqrt(5)) on A
                a = rng.uniform(-bound, bound, [rank, width_in]).astype(np.float32)
                self.factors[(layer, name)] = (
                    tf.Variable(a, name=f"l{layer}_{name}_A"),
                    tf.Variable(tf.zeros([end - first, rank]), name=f"l{layer}_{name}_B"))
                self.parts.setdefault((layer, role), []).append((first, end, name))

    @property
    def trainable_variables(self):
        return [v for pair in self.factors.values() for v in pair]

    def fused_layers(self) -> list[dict]:
        """Per layer, role -> (A [in, R], B [R, out]) float32 tensors built from the
        variables (differentiably): the layout the engine serves an adapter in."""
        tnp = tf.experimental.numpy
        layers: list[dict] = [{} for _ in range(self.config.num_layers)]
        for (layer, role), parts in self.parts.items():
            pieces = [(first, end, *self.factors[(layer, name)], self.scale)
                      for first, end, name in parts]
            layers[layer][role] = fuse_role(pieces, self.shapes[role][1], xp=tnp)
        return layers

    def __call__(self, token_ids):
        # the factors are read at trace time inside the trainer's tf.function: built here,
        # inside the trace, they are its tensors and the tape reaches the variables
        with lora_factors(block_factors(self.model.blocks, self.fused_layers())):
            return self.model(tf.cast(token_ids, tf.int32))

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
