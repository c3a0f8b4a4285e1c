"""Model architecture config: a frozen view of an HF Qwen3.5 text config, dense (`qwen3_5_text`) or
mixture-of-experts (`qwen3_5_moe_text`, e.g. Qwen3.5-35B-A3B)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from capsulert.errors import ConfigError, UnsupportedModelError

LINEAR = "linear_attention"
FULL = "full_attention"
DENSE_TYPE = "qwen3_5_text"
MOE_TYPE = "qwen3_5_moe_text"
# a multimodal config's model_type -> the model_type of the text_config inside it
_MULTIMODAL = {"qwen3_5": DENSE_TYPE, "qwen3_5_moe": MOE_TYPE}
# the MoE fields and HF Qwen3_5MoeTextConfig's defaults for them (Qwen3.5-35B-A3B's values)
MOE_DEFAULTS = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
                "shared_expert_intermediate_size": 512, "norm_topk_prob": True}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    intermediate_size: int = 0  # the dense MLP's; 0 in an MoE model, which has none
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] = field(default=())
    eos_token_id: int | None = None
    max_position_embeddings: int = 262144
    # mixture of experts (every layer's MLP, as in Qwen3.5-MoE): num_experts = 0 means a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # the top-k routing weights renormalised to sum to 1 (HF's qwen3_5_moe always does; Qwen3-Next's
    # config names it); False keeps the softmax probabilities of the whole expert set
    norm_topk_prob: bool = True
    # the multi-token-prediction head (engine/mtp.py): 0 (none) or 1 full-attention layer, as Qwen3.5 ships it
    mtp_num_hidden_layers: int = 0

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(
                self,
                "layer_types",
                tuple(LINEAR if (i + 1) % 4 else FULL for i in range(self.num_hidden_layers)),
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = set(self.layer_types) - {LINEAR, FULL}
        if bad:
            raise UnsupportedModelError(f"unknown layer types {sorted(bad)}; expected {LINEAR!r} or {FULL!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"rotary dim {self.rotary_dim} must be even and at most head_dim {self.head_dim}")
        if self.mtp_num_hidden_layers not in (0, 1):
            raise UnsupportedModelError(f"mtp_num_hidden_layers {self.mtp_num_hidden_layers} is not supported "
                                        "(0: no MTP head, or 1 layer, as Qwen3.5 ships it)")
        if self.is_moe:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                                  f"got {self.num_experts_per_tok}")
            if self.moe_intermediate_size <= 0 or self.shared_expert_intermediate_size <= 0:
                raise ConfigError("an MoE config needs moe_intermediate_size and shared_expert_intermediate_size > 0")
        elif self.num_experts < 0:
            raise ConfigError(f"num_experts must be >= 0, got {self.num_experts}")
        elif self.intermediate_size <= 0:
            raise ConfigError(f"a dense config needs intermediate_size > 0, got {self.intermediate_size}")

    # derived sizes
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def has_mtp(self) -> bool:
        return self.mtp_num_hidden_layers > 0

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    # HF interop
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        model_type = d.get("model_type")
        if model_type in _MULTIMODAL:  # a vision-language config: its text model is the one capsulert runs
            if "text_config" not in d:
                raise ConfigError(f"a {model_type} config must carry a text_config")
            d = dict(d["text_config"], model_type=d["text_config"].get("model_type", _MULTIMODAL[model_type]))
            model_type = d["model_type"]
        if model_type not in (DENSE_TYPE, MOE_TYPE):
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; capsulert runs {DENSE_TYPE} and {MOE_TYPE} "
                f"(or {' / '.join(_MULTIMODAL)} with a text_config)"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {d['hidden_act']!r} is not supported (only silu)")
        if d.get("attention_bias", False):
            raise UnsupportedModelError("attention_bias=true is not supported")
        rope = dict(d.get("rope_parameters") or {})
        if rope.get("rope_type", "default") != "default":
            raise UnsupportedModelError(f"rope_type {rope['rope_type']!r} is not supported (only default)")
        layer_types = d.get("layer_types")
        n_layers = d["num_hidden_layers"]
        if layer_types is None:
            interval = d.get("full_attention_interval", 4)
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if model_type == MOE_TYPE:
            # a field config.json leaves out has HF's Qwen3_5MoeTextConfig default, as when HF loads it
            mlp = {k: d.get(k, default) for k, default in MOE_DEFAULTS.items()}
        else:
            mlp = {"intermediate_size": d.get("intermediate_size")}
            if mlp["intermediate_size"] is None:
                raise ConfigError("config is missing the field 'intermediate_size'")
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                num_hidden_layers=n_layers,
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d["num_key_value_heads"],
                head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                linear_num_key_heads=d["linear_num_key_heads"],
                linear_num_value_heads=d["linear_num_value_heads"],
                linear_key_head_dim=d["linear_key_head_dim"],
                linear_value_head_dim=d["linear_value_head_dim"],
                linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4),
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", d.get("rope_theta", 10_000_000.0)),
                partial_rotary_factor=rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25)),
                tie_word_embeddings=d.get("tie_word_embeddings", False),
                layer_types=tuple(layer_types),
                eos_token_id=eos,
                max_position_embeddings=d.get("max_position_embeddings", 262144),
                mtp_num_hidden_layers=d.get("mtp_num_hidden_layers", 0),
                **mlp,
            )
        except KeyError as e:
            raise ConfigError(f"config is missing the field {e.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json HF transformers writes for Qwen3_5ForCausalLM (or Qwen3_5MoeForCausalLM) with these
        values. A dense model's dict has no MoE field, and a model without an MTP head no MTP field, so their
        fingerprints are what they were before MoE and MTP support."""
        d = asdict(self)
        if not self.mtp_num_hidden_layers:
            d.pop("mtp_num_hidden_layers")
        d.pop("rope_theta")
        d.pop("partial_rotary_factor")
        if self.is_moe:
            d.pop("intermediate_size")
            if d["norm_topk_prob"]:  # HF's own config has no such field: it always renormalises
                d.pop("norm_topk_prob")
        else:
            for k in MOE_DEFAULTS:
                d.pop(k)
        d["layer_types"] = list(self.layer_types)
        d.update(
            model_type=MOE_TYPE if self.is_moe else DENSE_TYPE,
            architectures=["Qwen3_5MoeForCausalLM" if self.is_moe else "Qwen3_5ForCausalLM"],
            hidden_act="silu",
            attention_bias=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
        )
        return d

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read a config.json (HF) or a YAML file of the same fields (capsulert/configs/models/)."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"no config file at {path}")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path} does not hold a mapping")
        return cls.from_hf_dict(data)
