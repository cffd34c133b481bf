"""The engine kit: a tiny model and tokenizer built locally, real SGLang and vLLM installed into cached environments
outside the checkout, and N real servers started with the deploy recipes' flags (docs/engines.md)."""
