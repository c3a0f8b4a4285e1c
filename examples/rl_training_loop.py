"""A toy RL training loop on the default model: rollouts from a start capsule -> a policy-gradient step in
plain torch on a separate copy of the weights -> engine.update_weights -> the start capsule is rebuilt
under the new weights -> the next rollouts. The reward prefers tokens of one class (even token ids), so it
is computable from the tokens alone; the mean reward climbs within a few iterations.

    .venv/bin/python examples/rl_training_loop.py [--iterations 10] [--episodes 16] [--model DIR]

The trainer is HF transformers' Qwen3_5ForCausalLM on the same weights (only the LM head is trained, to
keep the example fast); the rollouts' logprobs come from the engine (GenerateResult.logprobs), and the
trainer recomputes them with gradients.
"""
import argparse
import time

import torch
import transformers

from capsulert import Engine, SamplingParams
from capsulert.model_notice import random_weights_notice

PROMPT = "You are an agent in a small world. Describe your next move in a few words: "


def reward(tokens: list[int]) -> float:
    return sum(t % 2 == 0 for t in tokens) / len(tokens)


def trainer_for(engine: Engine):
    cfg = engine.model_cfg.to_hf_dict()
    hf_cfg = transformers.Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    model = transformers.Qwen3_5ForCausalLM(hf_cfg).eval()
    model.load_state_dict({k: v.clone() for k, v in engine.model_weights.items()}, strict=False)
    for name, p in model.named_parameters():
        p.requires_grad_(name == "lm_head.weight")
    return model


def main(iterations: int, episodes: int, gen: int, model: str = "default") -> list[float]:
    notice = random_weights_notice(model)
    if notice:
        print(f"note: {notice}")
    t0 = time.perf_counter()
    engine = Engine.from_config(model=model, device="cpu", slots=episodes + 1, max_seq=512, prefill_chunk=64)
    trainer = trainer_for(engine)
    opt = torch.optim.Adam([trainer.lm_head.weight], lr=0.003)
    s = engine.open()
    s.append(PROMPT)
    s.snapshot("c0", pin=True)
    prompt_len = len(s)
    s.close()
    history = []
    for it in range(iterations):
        # rollouts: every episode forks the start capsule; the scheduler-free engine batches them
        branches = engine.fork("c0", episodes)
        params = [SamplingParams(temperature=1.0, seed=it * 1000 + e, ignore_eos=True) for e in range(episodes)]
        actions = engine.generate(branches, gen, params)
        sequences = [list(b.tokens) for b in branches]
        for b in branches:
            b.close()
        rewards = torch.tensor([reward(a) for a in actions])
        advantage = rewards - rewards.mean()
        # a REINFORCE step on the trainer's copy of the weights
        ids = torch.tensor(sequences)
        logits = trainer(ids).logits[:, prompt_len - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, prompt_len:, None])[..., 0]
        engine_logp = torch.tensor([a.logprobs for a in actions])
        drift = (logp.detach() - engine_logp).abs().max().item()  # trainer vs engine: same model, same numbers
        loss = -(advantage[:, None] * logp).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        # sync: the engine takes the new weights in place; the pinned start capsule is rebuilt under them
        version = engine.update_weights({k: v.detach() for k, v in trainer.state_dict().items()},
                                        rebuild_pinned=True)
        history.append(float(rewards.mean()))
        print(f"iteration {it}: mean reward {rewards.mean():.3f}  (weights v{version}, "
              f"trainer/engine logprob drift {drift:.1e}, {time.perf_counter() - t0:.1f}s)")
    return history


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--gen", type=int, default=12)
    ap.add_argument("--model", default="default", help="a Qwen3.5 checkpoint directory (default: the embedded "
                    "model, random weights)")
    a = ap.parse_args()
    main(a.iterations, a.episodes, a.gen, a.model)
