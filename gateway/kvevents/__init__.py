"""Precise prefix routing from SGLang's KV-cache events (docs/kv-events.md)."""
