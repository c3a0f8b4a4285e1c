"""The models the engine-level exactness tests run on: the dense default model and the tiny MoE
(capsulert/configs/models/tiny_moe.yaml). A test using make_engine / engine runs on each with
`@pytest.mark.parametrize("model_dir", MODELS, indirect=True)` (the fixtures are in tests/conftest.py)."""
from capsulert.engine.default_model import REPO_ROOT

MODELS = ["dense", "moe"]
TINY_MOE_CONFIG = REPO_ROOT / "capsulert" / "configs" / "models" / "tiny_moe.yaml"
