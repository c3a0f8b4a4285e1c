"""The engine a worker owns: model, state set, sessions, loader, sampler and graph plans."""
