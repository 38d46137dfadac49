"""DuoAttention: retrieval heads keep the whole prompt, streaming heads sinks + a recent window, by fitted gates."""
