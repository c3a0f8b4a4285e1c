"""The RL training-loop example runs and its reward moves: rollouts, a policy-gradient step, update_weights,
rebuilt start capsule, next rollouts."""
import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rl_training_loop.py"


def test_rl_training_loop_reward_moves():
    module = runpy.run_path(str(EXAMPLE), run_name="example")
    history = module["main"](iterations=6, episodes=16, gen=12)
    assert len(history) == 6
    assert max(history[3:]) > history[0] + 0.05
