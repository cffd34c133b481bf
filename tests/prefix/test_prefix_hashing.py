import subprocess
import sys

from gateway.prefix.hashing import prefix_hashes

SYSTEM = "You are a careful agent. " * 200  # ~1,250 tokens


def chat(user, system=SYSTEM, tools=None):
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    if tools:
        body["tools"] = tools
    return body


def test_shared_prefix_shares_leading_hashes_only():
    a = prefix_hashes("chat/completions", chat("question one " * 300), "glm")
    b = prefix_hashes("chat/completions", chat("another question " * 300), "glm")
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert common == len("[gMASK]<sop><|system|>\n" + SYSTEM) // 1024  # every full chunk of the shared part
    assert a[common:] != b[common:]


def test_namespace_and_model_change_every_hash():
    base = prefix_hashes("chat/completions", chat("q " * 2000), "glm", "tenant-a")
    other_tenant = prefix_hashes("chat/completions", chat("q " * 2000), "glm", "tenant-b")
    other_model = prefix_hashes("chat/completions", chat("q " * 2000), "glm-mini", "tenant-a")
    assert not set(base) & set(other_tenant)
    assert not set(base) & set(other_model)


def test_tools_are_part_of_the_prefix_canonically():
    t1 = [{"type": "function", "function": {"name": "f", "parameters": {"a": 1, "b": 2}}}]
    t2 = [{"function": {"parameters": {"b": 2, "a": 1}, "name": "f"}, "type": "function"}]
    assert prefix_hashes("chat/completions", chat("x" * 5000, tools=t1), "m") == prefix_hashes("chat/completions", chat("x" * 5000, tools=t2), "m")
    assert prefix_hashes("chat/completions", chat("x" * 5000, tools=t1), "m")[0] != prefix_hashes("chat/completions", chat("x" * 5000), "m")[0]


def test_only_full_chunks_and_token_ids():
    assert prefix_hashes("completions", {"prompt": "a" * 1023}, "m") == []
    assert len(prefix_hashes("completions", {"prompt": "a" * 2048}, "m")) == 2
    ids = list(range(600))
    assert len(prefix_hashes("completions", {"prompt": ids}, "m")) == 2
    assert prefix_hashes("completions", {"prompt": ids}, "m")[0] == prefix_hashes("completions", {"prompt": ids[:256]}, "m")[0]


def test_hashes_are_identical_across_processes():
    """Every gateway instance must compute the same keys: no per-process seed (AIBrix's failure mode)."""
    code = ("from gateway.prefix.hashing import prefix_hashes\n"
            "print(prefix_hashes('chat/completions', {'messages': [{'role': 'user', 'content': 'z' * 9000}]}, 'glm', 's'))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin"}).stdout for seed in (1, 2)}
    assert len(outs) == 1
    assert outs.pop().strip() == str(prefix_hashes("chat/completions", {"messages": [{"role": "user", "content": "z" * 9000}]}, "glm", "s"))
