"""Framework integrations (vLLM)."""
