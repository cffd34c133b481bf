"""A stand-in for sgl_kernel's compiled `common_ops` in the slim SGLang environment (docs/engines.md).

The kernel package ships CUDA libraries only; its loader falls back to `import common_ops`. This empty module
lets the package's Python wrappers import; they reach `torch.ops.sgl_kernel.*` only when called, and SGLang's CPU
path with `--attention-backend torch_native` checks for those ops (`cpu_has_amx_support`) and uses torch instead.
"""
