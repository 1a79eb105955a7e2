"""One vLLM CPU engine (an "inference node") driven over stdin/stdout by ``run.py``.

Reads one JSON request per line: ``{"prompt_token_ids": [...]}`` and answers one line
``KVPOOL_RESULT {"first_token": id, "num_cached_tokens": n, "ttft_s": s}``; everything else vLLM
prints is log. The engine uses the kvpool connector when ``--kvpool-data-dir`` is given, and no
connector at all otherwise (the cold reference).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--kvpool-data-dir", help="use the kvpool connector with this server data dir")
    p.add_argument("--stats-path", help="connector counters file prefix")
    p.add_argument("--transport", default="auto")
    p.add_argument("--sync-save", action="store_true", help="save inside wait_for_save (async_save False)")
    args = p.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kv = None
    if args.kvpool_data_dir:
        extra = {"kvpool_data_dir": args.kvpool_data_dir, "kvpool_transport": args.transport,
                 "async_save": not args.sync_save}
        if args.stats_path:
            extra["stats_path"] = args.stats_path
        kv = KVTransferConfig(
            kv_connector="KVPoolConnector",
            kv_connector_module_path="kvpool.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    llm = LLM(
        model=args.model,
        enable_prefix_caching=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=4096,
        kv_transfer_config=kv,
        seed=0,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0)
    print("KVPOOL_READY", flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt_token_ids"])], params, use_tqdm=False)[0]
        ttft = time.perf_counter() - t0
        result = {
            "first_token": out.outputs[0].token_ids[0],
            "num_cached_tokens": out.num_cached_tokens or 0,
            "ttft_s": ttft,
        }
        print("KVPOOL_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
