"""The gateway config's sections, one module per concern; `gateway/config.py` assembles them into `GatewayConfig`
and loads it. Kept free of imports here so the routing registry can import a section without the whole config."""
