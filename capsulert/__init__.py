"""capsulert: a latency-first session runtime for hybrid (Gated DeltaNet + attention) LLMs."""
