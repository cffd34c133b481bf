"""OpenAI-compatible inference gateway: prefix-affinity, TTFT-SLA and cost-aware routing over SGLang pools."""

__version__ = "0.1.0"
