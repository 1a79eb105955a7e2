"""The prefix-reuse check through vLLM's OpenAI-compatible server and curl.

Starts a kvpool server and two ``python -m vllm.entrypoints.openai.api_server`` processes
(nodes A and B) with the kvpool connector (``--kv-transfer-config``), then sends completion
requests with curl, the way a user would::

    curl -s http://127.0.0.1:PORT/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "tiny-llama", "prompt": [...token ids...], "max_tokens": 1,
              "temperature": 0, "return_token_ids": true}'

A serves system prompt + question 1 (cold; stores the prompt's blocks in the pool); B, which has
never seen the system prompt, serves it + question 2 and must report cached prompt tokens
(``usage.prompt_tokens_details.cached_tokens``); A then serves B's prompt too (from its own
local prefix cache plus compute) and must produce the same first token. Prints the TTFTs.
Run with the vLLM venv's Python, like ``run.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import Pool, prompts, server_binary  # noqa: E402
from tiny_llama import build  # noqa: E402


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


class ApiServer:
    """``python -m vllm.entrypoints.openai.api_server`` with the kvpool connector."""

    def __init__(self, name: str, model: Path, pool_dir: Path, workdir: Path) -> None:
        self.name = name
        self.port = free_port()
        kv = {
            "kv_connector": "KVPoolConnector",
            "kv_connector_module_path": "kvpool.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvpool_data_dir": str(pool_dir)},
        }
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager", "--enable-prefix-caching",
               "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(kv)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
        self.log = workdir / f"api-{name}.log"
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"api server {self.name} exited:\n" + self.log.read_text()[-3000:])
            r = subprocess.run(["curl", "-sf", f"http://127.0.0.1:{self.port}/health"], capture_output=True)
            if r.returncode == 0:
                return
            time.sleep(1)
        raise SystemExit(f"api server {self.name} not ready within {timeout} s")

    def complete(self, tokens: list[int]) -> dict[str, Any]:
        body = json.dumps({"model": "tiny-llama", "prompt": tokens, "max_tokens": 1, "temperature": 0,
                           "return_token_ids": True})
        t0 = time.perf_counter()
        r = subprocess.run(["curl", "-s", f"http://127.0.0.1:{self.port}/v1/completions",
                            "-H", "Content-Type: application/json", "-d", body],
                           capture_output=True, text=True, check=True)
        ttft = time.perf_counter() - t0
        out = json.loads(r.stdout)
        if "choices" not in out:
            raise SystemExit(f"api server {self.name}: {r.stdout[:2000]}")
        details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
        return {"first_token": out["choices"][0]["token_ids"][0], "cached_tokens": details.get("cached_tokens", 0),
                "ttft_s": ttft}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir")
    p.add_argument("--model-dir")
    p.add_argument("--server-bin")
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--json")
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvpool-vllm-api-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = build(Path(args.model_dir) if args.model_dir else workdir / "model")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    pool = Pool(server_binary(args.server_bin), workdir / "pool")
    servers: list[ApiServer] = []
    try:
        servers = [ApiServer("A", model, pool.dir, workdir), ApiServer("B", model, pool.dir, workdir)]
        for s in servers:
            s.wait_ready()
        a, b = servers
        for s in servers:
            s.complete(tok.encode("warm up the engine", add_special_tokens=False))
        _, p1, p2 = prompts(tok, 100, args.system_tokens)
        ra = a.complete(p1)
        # A's connector saves asynchronously; wait until the pool holds the prompt's blocks.
        from kvpool import Client

        c = Client(data_dir=str(pool.dir))
        want = len(p1) // 128
        for _ in range(600):
            if c.stats()["blocks"] >= want:
                break
            time.sleep(0.05)
        rb = b.complete(p2)
        ra2 = a.complete(p2)
        stats = c.stats()
        c.close()
    finally:
        for s in servers:
            s.stop()
        pool.stop()
    summary = {"A_cold_prompt1": ra, "B_pool_prompt2": rb, "A_prompt2": ra2, "pool_blocks": stats["blocks"]}
    print(f"A (cold) ttft {ra['ttft_s'] * 1e3:.1f} ms | B (pool) ttft {rb['ttft_s'] * 1e3:.1f} ms, cached "
          f"{rb['cached_tokens']} tokens, first token {rb['first_token']} | A on B's prompt: first token "
          f"{ra2['first_token']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    failures = []
    if rb["cached_tokens"] <= 0:
        failures.append("B reported no cached prompt tokens")
    if rb["first_token"] != ra2["first_token"]:
        failures.append("B's first token differs from A's on the same prompt")
    for f in failures:
        print("FAILED: " + f)
    return 1 if failures and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
