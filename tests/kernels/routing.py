"""Routing from given router logits, through either moe_route (reference or Triton), which takes the router's
input and weights: with x the identity and the router's weights the logits transposed, router @ x is the logits
exactly (products by one and sums of zeros round nothing), so a test can choose ties and gaps."""
import torch


def route_logits(route, logits: torch.Tensor, top_k: int, normalize: bool, n: int | None = None):
    """logits [R, E] -> route's (ids, weights) for the first n rows (all unless given)."""
    R, E = logits.shape
    x = torch.eye(R, dtype=logits.dtype, device=logits.device)
    shared_gate = torch.zeros(1, R, dtype=logits.dtype, device=logits.device)
    ids, weights, _ = route(x, logits.T.contiguous(), shared_gate, R if n is None else n, top_k, normalize)
    return ids, weights
