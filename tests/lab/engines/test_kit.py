"""The engine kit's parts that need no engine: the model and tokenizer build (deterministic, offline, readable by
the gateway's own tokenizer), the server flags (the deploy recipes'), and the CUDA stub (compiles, answers
CUDA_ERROR_NO_DEVICE). The engines themselves: tests/engines and `gateway engines check`."""

from __future__ import annotations

import ctypes
import json
import os
import struct
import subprocess
import sys
import time
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


def test_dp_ranks_get_a_core_each_and_ports_apart() -> None:
    """With --dp-size 2 SGLang binds rank r's PUB on port + r and its replay ROUTER on replay port + r: the kit puts
    the replay port past every PUB, and binds one core per rank as SGLang's `a|b` list."""
    f = recipes.ServerFlags(port=30000, kv_port=5557, model="/m", dp_size=2)
    argv = recipes.sglang_argv(f)
    assert argv[argv.index("--dp-size") + 1] == "2"
    kv = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert kv["endpoint"] == "tcp://*:5557" and kv["replay_endpoint"] == "tcp://*:5559"
    assert recipes.server_env("sglang", 0, None, [0, 1])["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    assert "--dp-size" not in recipes.sglang_argv(recipes.ServerFlags(port=1, kv_port=2, model="/m"))


def test_older_release_recipe_and_its_simulator_twin() -> None:
    """0.5.13.post1 keeps the CPU torch and the slim layout with its own pins; its simulator twin is
    `--sglang-version 0.5.13` (the simulator names releases without the post suffix)."""
    r = recipes.recipe("sglang==0.5.13.post1")
    assert recipes.TORCH_CPU in r.requirements and "transformers==5.8.1" in r.requirements
    assert r.kernel == "sglang-kernel==0.4.3" and r.no_deps == ["sglang==0.5.13.post1"]
    sim = recipes.sim_argv(recipes.ServerFlags(port=1, kv_port=2, model="/m"), r.version)
    assert sim[sim.index("--sglang-version") + 1] == "0.5.13"


def test_each_release_gets_its_page_size_and_its_twin_the_same() -> None:
    """0.5.13's paged allocator runs Triton kernels (no driver on a CPU), so its servers get 1-token pages; 0.5.23
    keeps the deploy recipes' 64. A server's simulator twin is started with the server's own page size."""
    assert recipes.recipe("sglang==0.5.23").page_size == 64 and recipes.recipe("vllm==0.32.0").page_size == 64
    r = recipes.recipe("sglang==0.5.13.post1")
    assert r.page_size == 1
    flags = recipes.ServerFlags(port=1, kv_port=2, model="/m", page_size=r.page_size)
    argv = recipes.sglang_argv(flags)
    assert argv[argv.index("--page-size") + 1] == "1"
    sim = recipes.sim_argv(flags, r.version)
    assert sim[sim.index("--page-size") + 1] == "1"


def test_affinity_table_counts_prefix_hits_of_later_turns() -> None:
    from gateway_lab.engines.affinity import table
    from gateway_lab.engines.workload import Result, Session

    s = Session("a")
    s.prompt, s.cached, s.replicas, s.routes = [500, 700, 900], [0, 448, 640], ["x", "x", "y"], \
        ["cold", "prefix_hit", "least_load"]
    rr = Session("b")
    rr.prompt, rr.cached, rr.replicas, rr.routes = [500, 700], [0, 0], ["x", "y"], ["", ""]
    out = table([Result("gateway", [s]), Result("round-robin", [rr])])
    assert "| gateway | 51.8% | 68.0% | 1 | 1 of 2 |" in out and "| round-robin | 0.0% | 0.0% | 1 | - |" in out


def test_differential_reads_block_stored_in_either_encoding() -> None:
    """The comparison of KV events must see 0.5.13's tagged arrays as it sees 0.5.23's maps: a view that skipped
    arrays would compare zero pages on both sides and call an older release's events equal whatever they were."""
    from gateway_lab.engines.differential import _stored_view

    toks = list(range(128))
    as_map = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": toks,
              "block_size": 64, "lora_id": None, "medium": "GPU"}
    as_array = ["BlockStored", [11, 12], None, toks, 64, None, "GPU"]
    assert _stored_view([as_array]) == _stored_view([as_map])
    assert [p[:2] for p in _stored_view([as_array])] == [(11, None), (12, 11)]
    assert _stored_view([["BlockRemoved", [11]], {"type": "AllBlocksCleared"}]) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_server_in_its_own_session_ends_with_the_process_that_launched_it(tmp_path: Path) -> None:
    """launch()'s preexec: a child in a session of its own (as the engines run) gets SIGTERM when its launcher dies,
    so a killed test run leaves no engine holding the cores."""
    launcher = (
        "import subprocess, sys\n"
        "from gateway_lab.engines.servers import _die_with_parent\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True,\n"
        "                     preexec_fn=_die_with_parent())\n"
        "print(p.pid, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3], timeout=60)
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 60  # bounded: the kernel signals at once, a busy machine reaps it a little later
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a zombie (its parent, init, has not reaped it yet) counts as ended
        try:
            if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(child, 9)
        pytest.fail("the child outlived its launcher")
