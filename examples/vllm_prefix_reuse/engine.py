"""One vLLM CPU engine (an "inference node") driven over stdin/stdout by ``run.py`` and
``scenarios.py``.

Reads one JSON command per line and answers one ``KVPOOL_RESULT {...}`` line; everything else vLLM
prints is log. The engine uses the kvpool connector when ``--kvpool-data-dir`` (or ``--extra``
naming a server) is given, and no connector at all otherwise (the cold reference).

Commands:

- ``{"prompt_token_ids": [...], "max_tokens": 1}``: one request; answers ``first_token``,
  ``tokens``, ``num_cached_tokens``, ``ttft_s``.
- ``{"batch": [[...], ...], "max_tokens": 64}``: all requests at once (the scheduler batches,
  chunks and preempts as it must); answers ``outputs``, ``cached``, ``seconds`` and the
  engine's ``preemptions`` so far (needs ``--inproc``).
- ``{"kv_blocks": [...]}``: for each full block of these tokens, the hash vLLM gives it and the
  bytes the engine's own KV cache holds for it (its K and V of every layer, as the connector
  stores a block), or ``null`` when the block is not in the cache (needs ``--inproc``).
- ``{"reset_prefix_cache": false}``: drop the engine's local prefix cache (``true``: the
  connector's, that is this model's blocks in the pool, too).
- ``{"connector": true}``: the connector's counters (scheduler and worker sides).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--kvpool-data-dir", help="use the kvpool connector with this server data dir")
    p.add_argument("--stats-path", help="connector counters file prefix")
    p.add_argument("--transport", default="auto")
    p.add_argument("--sync-save", action="store_true", help="save inside wait_for_save (async_save False)")
    p.add_argument("--connector-module", default="kvpool.vllm", help="module of the KVPoolConnector class")
    p.add_argument("--kv-connector", default="KVPoolConnector",
                   help="the connector class (vLLM's own, such as MooncakeStoreConnector, by name alone)")
    p.add_argument("--kv-role", default="kv_both")
    p.add_argument("--extra", default="{}", help="more kv_connector_extra_config, as JSON")
    p.add_argument("--num-gpu-blocks", type=int, help="KV cache blocks (a small cache makes vLLM preempt)")
    p.add_argument("--max-batched-tokens", type=int, help="prefill budget per step (chunked prefill)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--inproc", action="store_true", help="run the engine core in this process (its internals "
                                                          "answer kv_blocks and the preemption count)")
    args = p.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.inproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    extra: dict[str, Any] = json.loads(args.extra)
    if args.kv_connector != "KVPoolConnector":
        # One of vLLM's own connectors (its settings come from its own environment, such as
        # MOONCAKE_CONFIG_PATH for MooncakeStoreConnector).
        kv = KVTransferConfig(kv_connector=args.kv_connector, kv_role=args.kv_role,
                              kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    elif args.kvpool_data_dir or extra:
        if args.kvpool_data_dir:
            extra.setdefault("kvpool_data_dir", args.kvpool_data_dir)
        extra.setdefault("kvpool_transport", args.transport)
        extra["async_save"] = not args.sync_save
        if args.stats_path:
            extra["stats_path"] = args.stats_path
        kv = KVTransferConfig(
            kv_connector="KVPoolConnector",
            kv_connector_module_path=args.connector_module,
            kv_role=args.kv_role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    opts: dict[str, Any] = {}
    if args.num_gpu_blocks:
        opts["num_gpu_blocks_override"] = args.num_gpu_blocks
    if args.max_batched_tokens:
        opts["max_num_batched_tokens"] = args.max_batched_tokens
    llm = LLM(
        model=args.model,
        enable_prefix_caching=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=args.max_model_len,
        kv_transfer_config=kv,
        seed=0,
        max_num_seqs=args.max_num_seqs,
        **opts,
    )
    core = _core(llm) if args.inproc else None
    preemptions = [0]
    if core is not None:
        sched = core.scheduler
        inner = sched._preempt_request

        def counted(*a: Any, **k: Any) -> Any:
            preemptions[0] += 1
            return inner(*a, **k)

        sched._preempt_request = counted
    print("KVPOOL_READY", flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        if "batch" in req:
            params = SamplingParams(max_tokens=int(req.get("max_tokens", 64)), temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in req["batch"]], params, use_tqdm=False)
            result: dict[str, Any] = {
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "cached": [o.num_cached_tokens or 0 for o in outs],
                "seconds": time.perf_counter() - t0,
                "preemptions": preemptions[0],
            }
        elif "kv_blocks" in req:
            result = {"blocks": _kv_blocks(core, req["kv_blocks"])}
        elif "reset_prefix_cache" in req:
            result = {"ok": _reset(llm, bool(req["reset_prefix_cache"]))}
        elif "connector" in req:
            result = {"stats": _connector_stats(llm, core)}
        elif "key_prefix" in req:
            # The keys of this engine's blocks (they carry the digest of its KV format).
            result = {"prefix": core.scheduler.connector._scheduler.prefixes[0] if core is not None else None}
        else:
            params = SamplingParams(max_tokens=int(req.get("max_tokens", 1)), temperature=0.0)
            t0 = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt_token_ids"])], params, use_tqdm=False)[0]
            ttft = time.perf_counter() - t0
            result = {
                "first_token": out.outputs[0].token_ids[0],
                "tokens": list(out.outputs[0].token_ids),
                "num_cached_tokens": out.num_cached_tokens or 0,
                "ttft_s": ttft,
            }
        print("KVPOOL_RESULT " + json.dumps(result), flush=True)


def _reset(llm: Any, connector: bool) -> bool:
    """vLLM refuses to drop its prefix cache while a connector's save still holds blocks. An
    in-process engine steps only inside ``generate``, so the saves' completions (which come with
    a step's output) would never arrive: step it until they have, for up to 30 s."""
    deadline = time.monotonic() + 30
    while not llm.reset_prefix_cache(reset_connector=connector):
        if time.monotonic() > deadline:
            return False
        llm.llm_engine.step()
        time.sleep(0.01)
    return True


def _core(llm: Any) -> Any:
    """The in-process engine core (scheduler and model executor)."""
    return llm.llm_engine.engine_core.engine_core


def _kv_blocks(core: Any, tokens: list[int]) -> list[Any]:
    """Per full block of ``tokens``: [hash hex, base64 of its KV bytes in this engine's cache]."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    if core is None:
        raise SystemExit("kv_blocks needs --inproc")
    cfg = core.vllm_config.cache_config
    bs = cfg.block_size
    hasher = get_request_block_hasher(bs, get_hash_fn_by_name(cfg.prefix_caching_hash_algo))
    r = Request("kv-blocks", list(tokens), SamplingParams(), None, block_hasher=hasher)
    pool = core.scheduler.kv_cache_manager.block_pool
    kv = core.model_executor.driver_worker.worker.model_runner.kv_caches
    out: list[Any] = []
    for h in r.block_hashes:
        blocks = pool.get_cached_block(h, [0])
        if not blocks:
            out.append([bytes(h).hex(), None])
            continue
        b = blocks[0].block_id
        raw = b"".join(layer[b].contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes() for layer in kv)
        out.append([bytes(h).hex(), base64.b64encode(raw).decode()])
    return out


def _connector_stats(llm: Any, core: Any) -> dict[str, Any]:
    """The connector's counters: the scheduler side's, and the worker side's (in process)."""
    if core is None or core.scheduler.connector is None:
        return {}
    out = {f"scheduler_{k}" if k.startswith("pool_") else k: v
           for k, v in core.scheduler.connector.connector_stats().items()}
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        out.update({f"worker_{k}" if k.startswith("pool_") else k: v
                    for k, v in get_kv_transfer_group().connector_stats().items()})
    return out


if __name__ == "__main__":
    main()
