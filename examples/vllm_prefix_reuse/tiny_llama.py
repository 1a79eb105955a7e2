"""Build a tiny random Llama and its tokenizer locally, with no download.

The model is a 4-layer Llama (hidden 256, 4 heads) with random weights from a fixed seed, saved
as safetensors (~5.5 MB); the tokenizer is a byte-level BPE trained on a few lines of text. Its
output is meaningless text, so the example compares token ids, never text. Building takes a few
seconds and is cached in the target directory (a marker file records the recipe version).

Usage: ``python tiny_llama.py DIR`` (prints DIR when the model is ready).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RECIPE = "tiny-llama-v1"

CORPUS = [
    "You are a helpful assistant that answers questions about distributed systems.",
    "A KV-cache pool stores attention keys and values so that a prefix computed once is reused.",
    "The quick brown fox jumps over the lazy dog while the scheduler batches requests.",
    "Prefill is compute bound; decode is memory bound; caching the prefix saves prefill time.",
    "Question: what is the capital of France? Answer: Paris is the capital of France.",
    "Mooncake Store and kvpool keep blocks of tokens keyed by the hash of their prefix chain.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_/+=*&%$#@",
]


def build(out: Path) -> Path:
    """Create the model and tokenizer in ``out`` unless a build of this recipe is there."""
    marker = out / "kvpool-recipe.json"
    if marker.exists() and json.loads(marker.read_text()).get("recipe") == RECIPE:
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(out)

    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps({"recipe": RECIPE, "vocab_size": cfg.vocab_size}))
    return out


def build_sliding(out: Path, window: int = 256) -> Path:
    """A tiny random Mistral whose every layer attends over a sliding window of ``window``
    tokens, with grouped-query attention (4 heads, 2 KV heads), and the same tokenizer."""
    marker = out / "kvpool-recipe.json"
    recipe = f"tiny-mistral-sw{window}-v1"
    if marker.exists() and json.loads(marker.read_text()).get("recipe") == recipe:
        return out
    import torch
    from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    src = build(out.parent / (out.name + "-tokenizer"))
    tok = PreTrainedTokenizerFast.from_pretrained(str(src))
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    torch.manual_seed(4321)
    cfg = MistralConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        sliding_window=window,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="float32",
    )
    MistralForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    marker.write_text(json.dumps({"recipe": recipe, "vocab_size": cfg.vocab_size}))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(build(Path(sys.argv[1])))
