"""SGLang-compatible replica simulator (see docs/simulator.md and shared/reference/sglang-simulator-spec.md)."""
