"""Load HF-format Qwen3.5 checkpoints, dense or MoE (config.json + safetensors), and tokenizer.json.

Weight names are normalised to the form `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` hold
(`model.layers.{i}....`, `model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight`). Checkpoints
written by `Qwen3_5ForConditionalGeneration` / `Qwen3_5MoeForConditionalGeneration` (`model.language_model....`)
are accepted; their vision tower (`model.visual.*`) is ignored (one INFO line says how many tensors). The
multi-token-prediction head (`mtp.*`, engine/mtp.py) is loaded when the config names one
(`mtp_num_hidden_layers`) and the checkpoint holds its tensors; a checkpoint without them (HF's
save_pretrained of a CausalLM drops them) loads as a model without an MTP head (one INFO line says so), and
a config without the field ignores them. An MoE checkpoint's experts may be stored fused (3-D tensors) or one by
one (as HF's save_pretrained writes them): they are fused on load (engine/moe_weights.py). Only safetensors is read,
never pickle. A load that takes a while shows a progress bar over the tensors on a terminal, naming the
shard it reads (capsulert/progress.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from capsulert.config.model import FULL, LINEAR, ModelConfig
from capsulert.errors import ModelLoadError
from capsulert.progress import progress_bar
from capsulert.engine.moe_weights import fuse_experts, is_per_expert, moe_mlp_shapes

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers

log = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"

_VLM_PREFIX = "model.language_model."
_IGNORED_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIX = "mtp."
_MAX_NAMES = 8


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of `Qwen3_5ForCausalLM` (or `Qwen3_5MoeForCausalLM`) for `cfg`, by HF name, with its shape
    (the MoE experts fused, as HF holds them)."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i, kind in enumerate(cfg.layer_types):
        shapes.update(layer_shapes(cfg, f"model.layers.{i}.", kind))
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    if cfg.has_mtp:  # after the main model's: the default model's generator draws them last
        shapes.update(mtp_shapes(cfg))
    return shapes


def mtp_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The MTP head's weights (engine/mtp.py) by checkpoint name: the two input norms, the fusion projection
    [h, 2h] (embedding | hidden), its full-attention decoder layers and its final norm. It shares the model's
    embedding and LM head."""
    h = cfg.hidden_size
    shapes = {f"{MTP_PREFIX}pre_fc_norm_embedding.weight": (h,), f"{MTP_PREFIX}pre_fc_norm_hidden.weight": (h,),
              f"{MTP_PREFIX}fc.weight": (h, 2 * h)}
    for i in range(cfg.mtp_num_hidden_layers):
        shapes.update(layer_shapes(cfg, f"{MTP_PREFIX}layers.{i}.", FULL))
    shapes[f"{MTP_PREFIX}norm.weight"] = (h,)
    return shapes


def layer_shapes(cfg: ModelConfig, p: str, kind: str) -> dict[str, tuple[int, ...]]:
    """One decoder layer's weights (names under the prefix `p`) with their shapes."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    shapes[p + "input_layernorm.weight"] = (h,)
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    if kind == LINEAR:
        nv = cfg.linear_num_value_heads
        la = p + "linear_attn."
        shapes[la + "in_proj_qkv.weight"] = (cfg.conv_dim, h)
        shapes[la + "in_proj_z.weight"] = (cfg.linear_value_dim, h)
        shapes[la + "in_proj_b.weight"] = (nv, h)
        shapes[la + "in_proj_a.weight"] = (nv, h)
        shapes[la + "conv1d.weight"] = (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim)
        shapes[la + "dt_bias"] = (nv,)
        shapes[la + "A_log"] = (nv,)
        shapes[la + "norm.weight"] = (cfg.linear_value_head_dim,)
        shapes[la + "out_proj.weight"] = (h, cfg.linear_value_dim)
    elif kind == FULL:
        sa = p + "self_attn."
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        shapes[sa + "q_proj.weight"] = (2 * q, h)  # query and output gate, interleaved per head
        shapes[sa + "k_proj.weight"] = (kv, h)
        shapes[sa + "v_proj.weight"] = (kv, h)
        shapes[sa + "o_proj.weight"] = (h, q)
        shapes[sa + "q_norm.weight"] = (cfg.head_dim,)
        shapes[sa + "k_norm.weight"] = (cfg.head_dim,)
    if cfg.is_moe:
        shapes.update(moe_mlp_shapes(cfg, p))
    else:
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    return shapes


def _names(names: list[str]) -> str:
    names = sorted(names)
    s = ", ".join(names[:_MAX_NAMES])
    if len(names) > _MAX_NAMES:
        s += f", ... ({len(names) - _MAX_NAMES} more)"
    return s


def _normalise(name: str) -> str | None:
    """The Qwen3_5ForCausalLM name of a stored tensor, or None if it is to be ignored."""
    if name.startswith(_IGNORED_PREFIXES):
        return None
    if name.startswith(_VLM_PREFIX):
        return "model." + name[len(_VLM_PREFIX):]
    return name


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a checkpoint and, for a sharded one, its weight map."""
    index = path / INDEX_FILE
    single = path / SINGLE_FILE
    if index.is_file():
        try:
            data = json.loads(index.read_text())
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not a mapping")
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(f"{index} references shard file(s) that do not exist in {path}: {_names(missing)}")
        return [path / s for s in shards], weight_map
    if single.is_file():
        return [single], None
    raise ModelLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def load_checkpoint(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    progress: bool | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF-format checkpoint directory; return its config and its weights by HF CausalLM name.
    `progress`: a bar over the tensors (None: on a terminal)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"checkpoint directory {path} does not exist")
    cfg_file = path / CONFIG_FILE
    if not cfg_file.is_file():
        raise ModelLoadError(f"no {CONFIG_FILE} in checkpoint directory {path}")
    cfg = ModelConfig.from_file(cfg_file)  # ConfigError / UnsupportedModelError propagate
    shapes = expected_shapes(cfg)

    files, weight_map = _weight_files(path)
    found: dict[str, torch.Tensor] = {}
    per_expert: dict[str, torch.Tensor] = {}  # experts stored one by one, fused once all are read
    origin: dict[str, str] = {}
    unexpected: list[str] = []
    ignored = 0
    tied_lm_head: torch.Tensor | None = None
    # a sharded checkpoint names every tensor in its index; a single file's count is known once it is open
    with progress_bar(len(weight_map) if weight_map is not None else None, "capsulert: loading weights",
                      progress=progress, unit="tensor") as bar:
        for file in files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    keys = list(f.keys())
                    if weight_map is not None:
                        listed = [k for k, v in weight_map.items() if v == file.name]
                        absent = sorted(set(listed) - set(keys))
                        if absent:
                            raise ModelLoadError(
                                f"{INDEX_FILE} places tensor(s) in {file.name} that it does not hold: {_names(absent)}"
                            )
                    elif bar.total is None:
                        bar.total = len(keys)
                    bar.set_postfix_str(file.name)
                    for key in keys:
                        bar.update()
                        name = _normalise(key)
                        if name is None or (name.startswith(MTP_PREFIX) and not cfg.has_mtp):
                            ignored += 1
                            continue
                        if name in origin:
                            raise ModelLoadError(f"tensor {name} appears twice in {path} (as {origin[name]} and {key})")
                        origin[name] = key
                        if name == "lm_head.weight" and cfg.tie_word_embeddings:
                            tied_lm_head = f.get_tensor(key)
                            continue
                        if is_per_expert(name) and cfg.is_moe:
                            per_expert[name] = f.get_tensor(key)
                            continue
                        if name not in shapes:
                            unexpected.append(key)
                            continue
                        shape = tuple(f.get_slice(key).get_shape())
                        if shape != shapes[name]:
                            raise ModelLoadError(
                                f"tensor {key} in {file.name} has shape {list(shape)}, expected {list(shapes[name])} "
                                "for this config"
                            )
                        found[name] = f.get_tensor(key)
            except ModelLoadError:
                raise
            except Exception as e:  # safetensors raises its own error types for truncated or malformed files
                raise ModelLoadError(f"cannot read safetensors file {file}: {type(e).__name__}: {e}") from None

    if unexpected:
        raise ModelLoadError(f"unexpected tensor(s) in {path} for this config: {_names(unexpected)}")
    if cfg.has_mtp and not any(n.startswith(MTP_PREFIX) for n in [*found, *per_expert]):
        log.info("%s names an MTP head (mtp_num_hidden_layers=%d) but holds no mtp.* tensor: loaded without one "
                 "(no MTP state, no drafts)", path, cfg.mtp_num_hidden_layers)
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=0)
        shapes = expected_shapes(cfg)
    found.update(fuse_experts(per_expert, cfg, set(found), ModelLoadError))
    per_expert.clear()
    missing = [n for n in shapes if n not in found]
    if missing:
        raise ModelLoadError(f"missing tensor(s) in {path}: {_names(missing)}")
    if tied_lm_head is not None:
        emb = found["model.embed_tokens.weight"]
        if tied_lm_head.shape != emb.shape or not torch.equal(tied_lm_head.to(emb.dtype), emb):
            raise ModelLoadError(
                f"tie_word_embeddings is true but lm_head.weight in {path} differs from model.embed_tokens.weight"
            )
    if ignored:
        log.info("ignored %d tensor(s) of the vision tower (model.visual.*) or of an MTP head the config does not "
                 "name (mtp.*) in %s", ignored, path)

    weights = {n: found[n].to(device=device, dtype=dtype) for n in shapes}
    return cfg, weights


def weights_fingerprint(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> str:
    """sha256 hex over the config (JSON, sorted keys) and every tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256()
    h.update(json.dumps(cfg.to_hf_dict(), sort_keys=True).encode())
    for name in sorted(weights):
        t = weights[name].detach()
        h.update(f"\0{name}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0".encode())
        flat = t.to("cpu").contiguous().reshape(-1)
        if flat.numel():
            h.update(flat.view(torch.uint8).numpy().data)
    return h.hexdigest()


def load_tokenizer(path: str | Path) -> "tokenizers.Tokenizer | None":
    """The checkpoint's tokenizer.json (via the `tokenizers` library), or None if it has none."""
    file = Path(path) / TOKENIZER_FILE
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:
        raise ModelLoadError(f"cannot read tokenizer {file}: {e}") from None


__all__ = [
    "expected_shapes",
    "load_checkpoint",
    "load_tokenizer",
    "weights_fingerprint",
]
