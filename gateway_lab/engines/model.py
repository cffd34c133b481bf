"""A tiny Llama-style model and a byte-level BPE tokenizer with a ChatML template, built locally in seconds.

Nothing is downloaded: the tokenizer is trained with `tokenizers` on a text generated from a fixed word list and
seed, and the weights are drawn from a seeded numpy generator and written as safetensors by hand (the format is an
8-byte header length, a JSON header and the raw little-endian tensors), so the gateway's own environment builds it
without torch. The same inputs give the same bytes: `fingerprint` hashes every file, and engine tests compare it.
Random weights make gibberish, which is fine: what the gateway depends on (HTTP surface, prefix cache and its
reporting, KV events, tokenization, chat template) does not depend on what the model says.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, with tools rendered as Qwen 2.5 does (a <tools> block in the system turn, <tool_call> JSON in assistant
# turns, <tool_response> in user turns), so SGLang's `qwen25` tool parser and the gateway's bridges meet the
# template a real served model ships.
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{%- endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}<|im_start|>assistant"
    "{%- if message['content'] %}\n{{ message['content'] }}{%- endif %}"
    "{%- for tc in message['tool_calls'] %}{%- set f = tc['function'] if tc.get('function') else tc %}"
    "\n<tool_call>\n{\"name\": \"{{ f['name'] }}\", \"arguments\": "
    "{%- if f['arguments'] is string %}{{ f['arguments'] }}{%- else %}{{ f['arguments'] | tojson }}{%- endif %}"
    "}\n</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}"
    "\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which but all were when "
    "we there can been has more one their if will would so what about out up into them some could other than then "
    "now only its over also after use two how our work first well way even new want because any these give day most "
    "us request token cache prefix replica gateway server route stream model tenant budget latency prompt engine "
    "page block event hash tool call function weather city answer user system assistant json name arguments value "
    "hello world question time number list read write price cost node pool fast slow long short turn agent code"
).split()


@dataclass(frozen=True)
class ModelSpec:
    vocab: int = 2048
    hidden: int = 128
    intermediate: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    max_positions: int = 8192
    seed: int = 0


def corpus(seed: int = 0, words: int = 60_000) -> list[str]:
    """A text of English-like lines with digits, punctuation and JSON, fixed by the seed."""
    rng = random.Random(seed)
    lines = []
    while words > 0:
        n = rng.randint(4, 16)
        words -= n
        line = " ".join(rng.choice(_WORDS) for _ in range(n))
        kind = rng.random()
        if kind < 0.1:
            line = json.dumps({rng.choice(_WORDS): rng.choice(_WORDS), "n": rng.randint(0, 999)})
        elif kind < 0.3:
            line = line.capitalize() + rng.choice([".", "?", "!", ":", ","]) + f" {rng.randint(0, 10_000)}"
        lines.append(line)
    return lines


def build_tokenizer(out: Path, spec: ModelSpec) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(spec.seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": spec.max_positions,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(tok.token_to_id(s)): {"content": s, "special": True, "lstrip": False,
                                                            "rstrip": False, "normalized": False, "single_word": False}
                                 for s in SPECIALS},
    }
    _write_json(out / "tokenizer_config.json", cfg)
    _write_json(out / "special_tokens_map.json", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})


def _bf16(a: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes, rounded to nearest even (numpy has no bfloat16)."""
    u = a.astype("<f4").view("<u4")
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
    out: bytes = rounded.tobytes()
    return out


def weights(spec: ModelSpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)
    h, i, q, kv = spec.hidden, spec.intermediate, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": w(spec.vocab, h)}
    for n in range(spec.layers):
        p = f"model.layers.{n}."
        t[p + "self_attn.q_proj.weight"] = w(q, h)
        t[p + "self_attn.k_proj.weight"] = w(kv, h)
        t[p + "self_attn.v_proj.weight"] = w(kv, h)
        t[p + "self_attn.o_proj.weight"] = w(h, q)
        t[p + "mlp.gate_proj.weight"] = w(i, h)
        t[p + "mlp.up_proj.weight"] = w(i, h)
        t[p + "mlp.down_proj.weight"] = w(h, i)
        t[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    t["model.norm.weight"] = np.ones(h, np.float32)
    t["lm_head.weight"] = w(spec.vocab, h)
    return t


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, off = [], 0
    for name in sorted(tensors):
        b = _bf16(tensors[name])
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the format pads the header to 8 bytes
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in blobs:
            f.write(b)


def model_config(spec: ModelSpec, eos: int, pad: int) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": spec.vocab,
        "hidden_size": spec.hidden, "intermediate_size": spec.intermediate, "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads, "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_positions, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": None, "eos_token_id": eos, "pad_token_id": pad,
        "initializer_range": 0.02,
    }


def build(out: Path, spec: ModelSpec | None = None) -> str:
    """Writes the model and tokenizer into `out` (created) and returns their fingerprint."""
    spec = spec or ModelSpec()
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out, spec)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert eos is not None and pad is not None  # trained in as special tokens
    _write_json(out / "config.json", model_config(spec, eos, pad))
    _write_json(out / "generation_config.json", {"eos_token_id": eos, "pad_token_id": pad, "do_sample": False})
    write_safetensors(out / "model.safetensors", weights(spec))
    fp = fingerprint(out)
    (out / "FINGERPRINT").write_text(fp + "\n")
    return fp


def fingerprint(d: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
                 "tokenizer.json", "tokenizer_config.json"):
        h.update(name.encode() + b"\0" + hashlib.sha256((d / name).read_bytes()).digest())
    return h.hexdigest()[:16]


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
