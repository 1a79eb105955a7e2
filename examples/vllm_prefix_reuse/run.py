"""Prefix reuse across two vLLM engines through kvpool, on CPU, for real.

1. Builds a tiny random Llama and its tokenizer locally (no download).
2. Starts a kvpool server, and three vLLM CPU engines in their own processes: engines A and B
   ("two inference nodes") use the kvpool connector; engine C has no connector (the cold
   reference).
3. For each trial (a fresh long system prompt S): A serves S + question 1 and stores the
   prompt's blocks in the pool; B, which has never seen S, serves S + question 2 and must load
   S's blocks from the pool; C serves S + question 2 cold.
4. Checks that B's request was served from the pool (``num_cached_tokens`` > 0), that its first
   token id equals C's cold one, and that B's TTFT is below C's; prints both TTFTs, the pool's
   hit rate and the bytes moved. ``--json`` writes the figures.

Run it with the vLLM venv's Python (``examples/vllm_prefix_reuse/setup_venv.sh`` prints it),
with ``kvpool`` installed there (``pip install ./python``):

    PY=$(examples/vllm_prefix_reuse/setup_venv.sh); $PY -m pip install ./python
    $PY examples/vllm_prefix_reuse/run.py
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from tiny_llama import CORPUS, build  # noqa: E402

BLOCK = 128  # vLLM's CPU block size


def server_binary(explicit: Optional[str]) -> Path:
    """``--server-bin``, ``KVPOOL_SERVER_BIN``, else the workspace's build (built if missing)."""
    b = explicit or os.environ.get("KVPOOL_SERVER_BIN")
    if b:
        return Path(b)
    meta = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=REPO,
                          check=True, capture_output=True, text=True)
    target = Path(json.loads(meta.stdout)["target_directory"])
    for profile in ("release", "debug"):
        if (target / profile / "kvpool-server").exists():
            return target / profile / "kvpool-server"
    subprocess.run(["cargo", "build", "-q", "--release", "-p", "kvpool-server"], cwd=REPO, check=True)
    return target / "release" / "kvpool-server"


class Checks:
    """Named checks of an example run: printed as they go, failures kept for ``--check``."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.facts: dict[str, Any] = {}

    def expect(self, ok: bool, what: str) -> None:
        print(("ok      " if ok else "FAILED  ") + what, flush=True)
        if not ok:
            self.failures.append(what)


class Pool:
    """A kvpool server process: on loopback, or at ``listen`` on the host the argv prefix
    ``host`` runs commands on (a network namespace, ``python/tests/netns.py``)."""

    def __init__(self, binary: Path, data_dir: Path, dram: str = "1GiB", extra: Sequence[str] = (),
                 listen: str = "127.0.0.1:0", host: Sequence[str] = ()) -> None:
        self.dir = data_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.binary, self.dram, self.extra, self.host = binary, dram, list(extra), list(host)
        self.start(listen)

    def start(self, listen: str) -> None:
        self.log = open(self.dir / "server.log", "ab")
        (self.dir / "endpoint.json").unlink(missing_ok=True)
        metrics = listen.rsplit(":", 1)[0] + ":0"
        self.proc = subprocess.Popen(
            [*self.host, str(self.binary), "--data-dir", str(self.dir), "--listen", listen, "--metrics-listen",
             metrics, "--dram-size", self.dram, "--ssd-capacity", "0", *self.extra],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while not (self.dir / "endpoint.json").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("kvpool-server did not start: " + (self.dir / "server.log").read_text()[-2000:])
            time.sleep(0.05)
        ep = json.loads((self.dir / "endpoint.json").read_text())
        self.metrics, self.addr = ep["metrics_addr"], ep["quic_addr"]

    def kill(self) -> None:
        """SIGKILL: no close reaches the clients, as when a node dies."""
        self.proc.kill()
        self.proc.wait()
        self.log.close()

    def lookup_blocks(self) -> dict[str, float]:
        """``kvpool_lookup_blocks_total`` by result (hit, miss)."""
        text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=10).read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("kvpool_lookup_blocks_total{"):
                label = line.split('result="')[1].split('"')[0]
                out[label] = float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class Engine:
    """An ``engine.py`` process: one vLLM engine."""

    def __init__(self, name: str, model: Path, workdir: Path, pool_dir: Optional[Path], transport: str,
                 sync_save: bool = False, extra_args: Sequence[str] = (), host: Sequence[str] = (),
                 env: Optional[dict[str, str]] = None) -> None:
        self.name = name
        self.stats_path = workdir / f"connector-{name}" if pool_dir else None
        cmd = [*host, sys.executable, str(HERE / "engine.py"), "--model", str(model), "--transport", transport]
        if pool_dir:
            cmd += ["--kvpool-data-dir", str(pool_dir), "--stats-path", str(self.stats_path)]
            if sync_save:
                cmd.append("--sync-save")
        cmd += list(extra_args)
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1", **(env or {}))
        self.log_path = workdir / f"engine-{name}.log"
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=open(self.log_path, "wb"), text=True, env=env)
        self.lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path.with_suffix(".out"), "w") as log:
            for line in self.proc.stdout:
                if line.startswith("KVPOOL_"):
                    self.lines.put(line.strip())
                else:
                    log.write(line)
        self.lines.put("KVPOOL_EXIT")

    def _expect(self, prefix: str, timeout: float) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise SystemExit(f"engine {self.name}: nothing within {timeout:.0f} s; see {self.log_path}") from None
        if not line.startswith(prefix):
            raise SystemExit(f"engine {self.name} exited; see {self.log_path}:\n"
                             + self.log_path.read_text()[-3000:])
        return line[len(prefix):].strip()

    def wait_ready(self, timeout: float = 900) -> None:
        self._expect("KVPOOL_READY", timeout)

    def run(self, tokens: list[int]) -> dict[str, Any]:
        return self.call({"prompt_token_ids": tokens})

    def call(self, command: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
        """One command of ``engine.py`` and its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("KVPOOL_RESULT", timeout))

    def connector_stats(self) -> dict[str, Any]:
        """Counters of this engine's connector (scheduler and worker sides)."""
        out: dict[str, Any] = {}
        if self.stats_path is None:
            return out
        for f in self.stats_path.parent.glob(self.stats_path.name + ".*.json"):
            for k, v in json.loads(f.read_text()).items():
                out[k] = out.get(k, 0) + v
        return out

    def stop(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def prompts(tokenizer: Any, trial: int, system_tokens: int) -> tuple[list[int], list[int], list[int]]:
    """A fresh long system prompt for this trial, and two different questions after it."""
    rng = random.Random(1000 + trial)
    words = " ".join(CORPUS).split()
    system: list[int] = tokenizer.encode(f"System prompt {trial}:", add_special_tokens=False)
    while len(system) < system_tokens:
        system += tokenizer.encode(" " + " ".join(rng.choice(words) for _ in range(32)), add_special_tokens=False)
    system = system[:system_tokens]
    q1 = tokenizer.encode(" Question: what does a KV-cache pool store? Answer:", add_special_tokens=False)
    q2 = tokenizer.encode(" Question: why is prefill compute bound? Answer:", add_special_tokens=False)
    return system, system + q1, system + q2


def wait_saved(engine: Engine, want_blocks: int, timeout: float = 60) -> None:
    """Block until the engine's connector stored (or found stored) ``want_blocks`` blocks in all."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.connector_stats()
        if s.get("saved_blocks", 0) + s.get("save_skipped", 0) >= want_blocks:
            return
        time.sleep(0.05)
    raise SystemExit(f"engine {engine.name} did not save {want_blocks} blocks within {timeout} s: "
                     f"{engine.connector_stats()}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", help="scratch directory (default: a new temporary one, removed after)")
    p.add_argument("--model-dir", help="where the tiny model is built or found (default: in workdir)")
    p.add_argument("--server-bin", help="kvpool-server binary (default: the workspace's build)")
    p.add_argument("--trials", type=int, default=3, help="measured trials (median TTFT)")
    p.add_argument("--warmup-trials", type=int, default=1, help="trials run first and left out of the TTFTs")
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--transport", default="auto", help="kvpool transport of the connectors: auto, quic, shm")
    p.add_argument("--sync-save", action="store_true", help="connectors save inside wait_for_save")
    p.add_argument("--load-sync", action="store_true", help="connectors load within the step that needs the "
                                                             "blocks instead of between steps (load_async false)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--check", action="store_true", help="exit 1 unless every expectation holds")
    args = p.parse_args()

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvpool-vllm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    model = build(Path(args.model_dir) if args.model_dir else workdir / "model")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    pool = Pool(server_binary(args.server_bin), workdir / "pool")
    engines: list[Engine] = []
    try:
        extra = ["--extra", json.dumps({"load_async": False})] if args.load_sync else []
        a = Engine("A", model, workdir, pool.dir, args.transport, args.sync_save, extra)
        b = Engine("B", model, workdir, pool.dir, args.transport, args.sync_save, extra)
        c = Engine("C-cold", model, workdir, None, args.transport)
        engines = [a, b, c]
        for e in engines:
            e.wait_ready()
        t_ready = time.monotonic()
        print(f"kvpool + 3 engines ready in {t_ready - t_start:.0f} s", flush=True)
        # Warm each engine up on a short prompt (less than one block: nothing is stored).
        for e in engines:
            e.run(tok.encode("warm up the engine", add_special_tokens=False))
        trials = []
        warmups = []
        saved_target = 0
        # Warm-up trials go through the same steps (A stores, B loads from the pool, C computes
        # cold) so that first-use costs (the load path, kernels at full prompt length) stay out of
        # the TTFTs compared; their tokens are still checked.
        for t in range(-args.warmup_trials, args.trials):
            system, p1, p2 = prompts(tok, t, args.system_tokens)
            ra = a.run(p1)
            saved_target += len(p1) // BLOCK
            wait_saved(a, saved_target)
            rb = b.run(p2)
            rc = c.run(p2)
            (trials if t >= 0 else warmups).append(
                {"prompt_tokens": len(p2), "shared_tokens": len(system), "A": ra, "B": rb, "C_cold": rc})
            print(f"{'trial' if t >= 0 else 'warm-up'} {t}: A (stores) ttft {ra['ttft_s'] * 1e3:7.1f} ms | B (pool) ttft {rb['ttft_s'] * 1e3:7.1f} ms,"
                  f" cached {rb['num_cached_tokens']} tok, first token {rb['first_token']} | C (cold) ttft "
                  f"{rc['ttft_s'] * 1e3:7.1f} ms, first token {rc['first_token']}", flush=True)
        lookups = pool.lookup_blocks()
        sa, sb = a.connector_stats(), b.connector_stats()
    finally:
        for e in engines:
            e.stop()
        pool.stop()

    hits, misses = lookups.get("hit", 0.0), lookups.get("miss", 0.0)
    ttft_pool = statistics.median(x["B"]["ttft_s"] for x in trials)
    ttft_cold = statistics.median(x["C_cold"]["ttft_s"] for x in trials)
    summary = {
        "trials": trials,
        "ttft_with_pool_s": ttft_pool,
        "ttft_without_pool_s": ttft_cold,
        "ttft_reduction": 1 - ttft_pool / ttft_cold,
        "pool_lookup_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "pool_lookup_blocks": {"hit": hits, "miss": misses},
        "engine_A_connector": sa,
        "engine_B_connector": sb,
        "bytes_saved": sa.get("saved_bytes", 0) + sb.get("saved_bytes", 0),
        "bytes_loaded": sb.get("loaded_bytes", 0),
        "warmup_trials": warmups,
        "first_tokens_equal": all(x["B"]["first_token"] == x["C_cold"]["first_token"] for x in warmups + trials),
        "min_cached_tokens_B": min(x["B"]["num_cached_tokens"] for x in warmups + trials),
        "transport": args.transport,
        "async_save": not args.sync_save,
        "load_async": not args.load_sync,
        "wall_s": time.monotonic() - t_start,
    }
    print(f"TTFT median: without pool {ttft_cold * 1e3:.1f} ms, with pool {ttft_pool * 1e3:.1f} ms "
          f"({summary['ttft_reduction'] * 100:.0f}% lower)")
    print(f"pool lookup hit rate {summary['pool_lookup_hit_rate'] * 100:.1f}% ({hits:.0f} of {hits + misses:.0f} "
          f"blocks); bytes moved: saved {summary['bytes_saved'] / 2**20:.1f} MiB, loaded "
          f"{summary['bytes_loaded'] / 2**20:.1f} MiB; first tokens equal: {summary['first_tokens_equal']}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    failures = []
    if summary["min_cached_tokens_B"] <= 0:
        failures.append("engine B was not served from the pool (num_cached_tokens == 0)")
    if not summary["first_tokens_equal"]:
        failures.append("engine B's first token differs from the cold run")
    if ttft_pool >= ttft_cold:
        failures.append("TTFT did not drop with the pool")
    for f in failures:
        print("FAILED: " + f)
    return 1 if (failures and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
