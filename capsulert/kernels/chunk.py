"""The chunk of the gated delta rule's chunked form: the row count its prefill kernels work in, the 64-token
grid canonical state is kept on, and the unit of a prefill piece. Here, apart from the kernels, because
configuration is validated against it in processes that never import torch (the serve CLI, its replica)."""

GATED_DELTA_CHUNK = 64
