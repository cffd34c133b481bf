"""One package per routing policy (`policy.py` exporting `SPEC`, and a README.md with the same sections for each);
`routing/registry.py` lists them."""
