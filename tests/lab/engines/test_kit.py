"""The engine kit's parts that need no engine: the model and tokenizer build (deterministic, offline, readable by
the gateway's own tokenizer), the server flags (the deploy recipes'), and the CUDA stub (compiles, answers
CUDA_ERROR_NO_DEVICE). The engines themselves: tests/engines and `gateway engines check`."""

from __future__ import annotations

import ctypes
import json
import struct
from pathlib import Path

import pytest

from gateway.tokenizers.real import HfTokenizer
from gateway_lab.engines import envs, model, recipes


def test_model_build_is_deterministic_and_complete(tmp_path: Path) -> None:
    a, b = model.build(tmp_path / "a"), model.build(tmp_path / "b")
    assert a == b
    raw = (tmp_path / "a" / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    spec = model.ModelSpec()
    emb = header["model.embed_tokens.weight"]
    assert emb["dtype"] == "BF16" and emb["shape"] == [spec.vocab, spec.hidden]
    assert emb["data_offsets"][1] - emb["data_offsets"][0] == spec.vocab * spec.hidden * 2
    assert len(raw) == 8 + n + max(t["data_offsets"][1] for k, t in header.items() if k != "__metadata__")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 2


def test_the_gateway_tokenizer_reads_the_kit_model(tmp_path: Path) -> None:
    """The ChatML template renders through the gateway's own jinja2 path, specials as single ids."""
    model.build(tmp_path)
    tok = HfTokenizer.from_dir(str(tmp_path))
    body = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hello"}]}
    ids = tok.encode_request("chat/completions", body).tolist()
    start, end = tok.tok.token_to_id("<|im_start|>"), tok.tok.token_to_id("<|im_end|>")
    assert ids.count(start) == 3 and ids.count(end) == 2 and ids[-1] != end  # generation prompt opened
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = tok.encode_request("chat/completions", {**body, "tools": tools}).tolist()
    assert len(with_tools) > len(ids) and "get_weather" in tok.tok.decode(with_tools)


def test_server_flags_follow_the_deploy_recipes() -> None:
    f = recipes.ServerFlags(port=30000, kv_port=5557, model="/m")
    argv = recipes.sglang_argv(f)
    for flag in ("--enable-cache-report", "--enable-metrics", "--enable-priority-scheduling",
                 "--kv-events-config", "--page-size"):
        assert flag in argv
    assert argv[argv.index("--default-priority-value") + 1] == "0"
    kv = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert kv == {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    sim = recipes.sim_argv(f)
    assert sim[sim.index("--kv-events-config") + 1] == argv[argv.index("--kv-events-config") + 1]
    assert "--enable-prompt-tokens-details" in recipes.vllm_argv(f)
    with pytest.raises(ValueError, match="known"):
        recipes.recipe("sglang==0.0.1")


def test_cuda_stub_answers_no_device(tmp_path: Path) -> None:
    envs.build_cuda_stub(tmp_path, tmp_path / "log")
    lib = ctypes.CDLL(str(tmp_path / "libcuda.so.1"))
    assert lib.cuInit(0) == 100
    v = ctypes.c_int(-1)
    assert lib.cuDriverGetVersion(ctypes.byref(v)) == 100 and v.value == 0
