"""Engine integrations (vLLM, Ray Serve LLM)."""
