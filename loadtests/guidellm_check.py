"""guidellm (a third-party benchmark client) against `gateway demo`, with its backend validation on: it probes
`GET /health` and `/v1/models` before sending anything (issue 19: it used to stop there). A small synchronous run of
synthetic requests; prints guidellm's verdict and the counts.

    .venv/bin/python -m loadtests.guidellm_check          # installs guidellm into loadtests/.venvs on first use

No model files: the synthetic prompts are built with a tiny word-level tokenizer written here (guidellm needs some
Hugging Face tokenizer to size its prompts; the gateway and the simulator count tokens their own way).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtests.peers import ensure
from loadtests.procs import Proc
from tests.support import free_port

MAKE_TOKENIZER = """
import json, pathlib, sys
from tokenizers import Tokenizer, models, pre_tokenizers
out = pathlib.Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
words = ["[UNK]", "[BOS]", "[EOS]"] + "the model cache token route fast node prefix replica and of to is a in".split()
vocab = {w: i for i, w in enumerate(dict.fromkeys(words + [chr(c) for c in range(33, 127)]))}
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.save(str(out / "tokenizer.json"))
(out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
    "unk_token": "[UNK]", "bos_token": "[BOS]", "eos_token": "[EOS]", "model_max_length": 1000000}))
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20)
    a = p.parse_args(argv)
    bin_dir = ensure("guidellm")
    if bin_dir is None:
        print("guidellm could not be installed here", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="gw-guidellm-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([str(bin_dir / "python"), "-c", MAKE_TOKENIZER, str(work / "tok")], check=True, env=env)
    port = free_port()
    demo = Proc("demo", [sys.executable, "-m", "gateway.cli", "demo", "--port", str(port), "--time-scale", "20"],
                f"http://127.0.0.1:{port}/readyz", log=work / "demo.log")
    try:
        demo.wait_ready(60)
        cmd = [str(bin_dir / "guidellm"), "run",
               "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model=glm-5.2,api_key=sk-demo",
               "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={a.requests}",
               "--tokenizer", f"kind=huggingface_auto,model={work / 'tok'}",
               "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=16",
               "--output", f"kind=json,path={work / 'out.json'}", "--disable-console-interactive"]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        lines = (r.stdout + r.stderr).splitlines()
        for ln in lines:
            if "backend validated" in ln or "completed |" in ln:
                print(ln.strip())
        if r.returncode != 0:
            print("\n".join(lines[-20:]), file=sys.stderr)
            return r.returncode
        report = json.loads((work / "out.json").read_text())
        m = report["benchmarks"][0]["scheduler_state"]
        print(f"guidellm exit 0: {m.get('successful_requests')} successful, {m.get('errored_requests')} errored")
        return 0 if m.get("errored_requests") == 0 else 1
    finally:
        demo.stop()


if __name__ == "__main__":
    raise SystemExit(main())
