"""New weights for a running engine (RL weight sync): checked like a checkpoint load, then copied into the
buffers the model already reads, so captured CUDA graphs and every data pointer stay valid.

Each update bumps the engine's weights version and gives the weights an identity (update_identity), which
its fingerprint carries ("<model>@w<identity>.<N>"): capsules made under other weights, in this process or
any earlier one, are refused with StaleCapsuleError until rebuilt (Engine.rebuild re-prefills a capsule's
own tokens under the new weights).
"""
from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path
from typing import Mapping

import torch

from capsulert.errors import CapsuleRTError, InvalidRequestError, WeightUpdateError
from capsulert.config.model import ModelConfig
from capsulert.engine.loader import MTP_PREFIX
from capsulert.engine.moe_weights import fuse_experts, is_per_expert


def read_update(source, cfg: ModelConfig, dtype: torch.dtype,
                progress: bool | None = None) -> Mapping[str, torch.Tensor]:
    """The tensors of an update: a mapping of HF names to tensors, or an HF checkpoint directory of the
    same architecture (safetensors only; `progress`: a bar over its tensors, None: on a terminal). An MoE
    model's experts may come fused (HF's state_dict) or one by one (HF's save_pretrained): they are fused."""
    if isinstance(source, (str, Path)):
        from capsulert.engine.loader import load_checkpoint

        try:
            new_cfg, tensors = load_checkpoint(source, dtype=dtype, device="cpu", progress=progress)
        except CapsuleRTError as e:
            raise WeightUpdateError(f"cannot load the update from {source}: {e}") from None
        if not new_cfg.has_mtp:  # a checkpoint without the MTP head (transformers writes none): the main model's
            new_cfg = dataclasses.replace(new_cfg, mtp_num_hidden_layers=cfg.mtp_num_hidden_layers)
        if new_cfg.to_hf_dict() != cfg.to_hf_dict():
            raise WeightUpdateError(f"the checkpoint at {source} has another architecture than the running model")
        return tensors
    if isinstance(source, Mapping):
        per_expert = {k: v for k, v in source.items() if isinstance(k, str) and is_per_expert(k)}
        if not per_expert:
            return source
        rest = {k: v for k, v in source.items() if k not in per_expert}
        return {**rest, **fuse_experts(per_expert, cfg, set(rest), WeightUpdateError)}
    raise InvalidRequestError(f"update_weights takes a mapping of tensors or a checkpoint path, got {type(source).__name__}")


def check_update(current: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor],
                 tied: bool) -> dict[str, torch.Tensor]:
    """The tensors to copy, by name; WeightUpdateError (naming the offending tensors) unless the update has
    exactly the model's weights with their shapes and floating dtypes, every value finite. An update of a model with tied
    embeddings may carry lm_head.weight as well (HF state dicts do); it must then equal the embedding. The MTP
    head's weights (mtp.*) may be left out (a trainer built on transformers has no head): the head keeps its own."""
    new = dict(new)
    if tied and "lm_head.weight" in new and "lm_head.weight" not in current:
        head = new.pop("lm_head.weight")
        emb = new.get("model.embed_tokens.weight")
        if emb is not None and not (head is emb or torch.equal(head, emb)):
            raise WeightUpdateError("the model ties lm_head to the embeddings but the update's lm_head.weight differs")
    missing = sorted(n for n in set(current) - set(new) if not n.startswith(MTP_PREFIX))
    extra = sorted(set(new) - set(current))
    if missing or extra:
        raise WeightUpdateError(f"update does not match the model's weights: missing {missing[:5]}"
                                f"{'…' if len(missing) > 5 else ''}, unexpected {extra[:5]}{'…' if len(extra) > 5 else ''}")
    for name, t in new.items():
        if not isinstance(t, torch.Tensor):
            raise WeightUpdateError(f"{name} is a {type(t).__name__}, not a tensor")
        if tuple(t.shape) != tuple(current[name].shape):
            raise WeightUpdateError(f"{name} has shape {tuple(t.shape)}, the model's is {tuple(current[name].shape)}")
        if not t.dtype.is_floating_point:
            raise WeightUpdateError(f"{name} has dtype {t.dtype}; weights are floating point")
    nonfinite = nonfinite_counts({name: (t, current[name].device) for name, t in new.items()})
    for name, bad in nonfinite.items():
        if bad:
            raise WeightUpdateError(f"{name} holds {bad} NaN or infinite value(s); a model with them samples "
                                    "garbage (NaN logprobs), so the update is refused")
    return new


FINITE_CHUNK_ELEMENTS = 1 << 26


def nonfinite_counts(tensors: Mapping[str, tuple[torch.Tensor, torch.device]]) -> dict[str, int]:
    """How many NaN or infinite values each tensor holds, counted on the device its weights live on (a host
    tensor bound for a GPU is read there in chunks: a bf16 check on the CPU took 45 s for a 9B model, the copy
    0.3 s) with one synchronisation for all of them. Run after the cheap checks: this reads every byte."""
    counts = []
    for t, device in tensors.values():
        if t.device == device:
            counts.append((~torch.isfinite(t)).sum())
            continue
        flat, total = t.reshape(-1), torch.zeros((), dtype=torch.int64, device=device)
        for start in range(0, flat.numel(), FINITE_CHUNK_ELEMENTS):
            chunk = flat[start:start + FINITE_CHUNK_ELEMENTS].to(device, non_blocking=t.is_pinned())
            total += (~torch.isfinite(chunk)).sum()
        counts.append(total)
    if not counts:
        return {}
    # one engine's weights share a device, so this gathers nothing; the one .tolist() is the synchronisation
    values = torch.stack([c.to(counts[0].device) for c in counts]).tolist()
    return dict(zip(tensors, values))


IDENTITY_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_")
MAX_IDENTITY_CHARS = 64


def update_identity(source, identity: str | None) -> str:
    """The identity of the weights an update installs, carried in the engine's fingerprint (and so in every
    capsule made under them): `identity` when the caller names one (an orchestrator gives every worker the
    same, and the same again to a restarted one), else the content digest of a checkpoint directory (the
    checkpoint fingerprint, cached: re-applying a checkpoint after a restart makes its capsules current
    again, which they are, bitwise), else a random one (tensors in memory: hashing them would cost a copy
    of every weight per update). Never a counter: counters restart at 0 in every process."""
    if identity is not None:
        if not isinstance(identity, str) or not 0 < len(identity) <= MAX_IDENTITY_CHARS \
                or not set(identity) <= IDENTITY_CHARS:
            raise WeightUpdateError(f"identity must be 1 to {MAX_IDENTITY_CHARS} letters, digits, '-' or '_', "
                                    f"got {identity!r:.80}")
        return identity
    if isinstance(source, (str, Path)):
        from capsulert.engine.fingerprint import checkpoint_fingerprint

        return "sha-" + checkpoint_fingerprint(source)[:32]
    return "rnd-" + secrets.token_hex(12)
