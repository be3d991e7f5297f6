"""`motorctl tiny-model [DIR]`: a tiny random-weight Llama with a byte-level BPE tokenizer,
built locally (no model hub), to try the real vLLM engine on a machine without weights
(`make run-vllm`, examples/vllm-tiny.yaml); the vLLM tests and benchmarks use it too.

vLLM's CPU attention needs a head size of 32, 64, 80 or more, so the heads are 32 wide. The
model is about 2.6 MB and builds in a few seconds; its answers are random text: it shows serving,
not quality. Building needs torch, transformers and tokenizers (vLLM's CPU set installs them).

    motorctl tiny-model /tmp/motor-models/tiny-llama   # build into a folder (if not there yet) and print it
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

# Weights and tokenizer are a pure function of this version: bump it when the recipe changes.
RECIPE_VERSION = "1"

# A few KB of text for the BPE trainer: digits (probes send "1"), words, punctuation.
_CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "Motor is a control plane for large language model inference engines.",
    "An engine server wraps one engine and answers its management plane over gRPC.",
    "Virtual inference sends a tiny completion to check that the engine still answers.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 1000",
    "Hello, world! How are you today? I am fine, thank you.",
    "Prefill and decode run on different instances and exchange the KV cache.",
    "user assistant system: say something short, please.",
]


# vLLM settings that serve the tiny model lean on a CPU (see docs/vllm.md): eager mode, a
# small context and KV cache, one process. Shared by the vLLM tests and the benchmarks;
# examples/vllm-tiny.yaml spells out the same.
LEAN_CPU_ARGS = {
    "max_model_len": 256,
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_memory_bytes": 64 * 1024 * 1024,
    "distributed_executor_backend": "uni",
}


def corpus_words() -> list[str]:
    """The words the tiny model's tokenizer was trained on (one or two tokens each to it)."""
    return sorted({word.strip(".,!?:") for line in _CORPUS_LINES for word in line.split()} - {""})


def _corpus() -> list[str]:
    lines = []
    for i in range(40):
        for line in _CORPUS_LINES:
            lines.append(f"{line} {i}")
    return lines


def build_tiny_model(path: str) -> str:
    """Write the model and tokenizer into `path` (created) and return it."""
    # Imported here: transformers/torch are heavy and only needed when building.
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    special = ["<unk>", "<s>", "</s>", "<pad>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    # A minimal chat template so /v1/chat/completions works too.
    fast.chat_template = (
        "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(path)

    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    with open(os.path.join(path, "MOTOR_TINY_MODEL"), "w", encoding="utf-8") as marker:
        marker.write(RECIPE_VERSION + "\n")
    return path


def is_built(path: str) -> bool:
    marker = os.path.join(path, "MOTOR_TINY_MODEL")
    try:
        with open(marker, encoding="utf-8") as handle:
            return handle.read().strip() == RECIPE_VERSION
    except OSError:
        return False


def ensure_tiny_model(path: str) -> str:
    """Build into `path` unless a model of this recipe is already there; return the path.

    Builds into a sibling temporary folder and renames, so a concurrent or interrupted build
    never leaves a half-written model behind."""
    if is_built(path):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".tiny-model-", dir=parent)
    build_tiny_model(staging)
    try:
        os.rename(staging, path)
    except OSError:
        # Another process won the race (or an old version is there): keep theirs if valid.
        if not is_built(path):
            import shutil

            shutil.rmtree(path, ignore_errors=True)
            os.rename(staging, path)
        else:
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
    return path


DEFAULT_PATH = "/tmp/motor-models/tiny-llama"  # where examples/vllm-tiny.yaml expects it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="motorctl tiny-model",
        description="Make a tiny random-weight Llama locally (no model hub) to try the real vLLM engine; "
        "prints its folder. Nothing is done when that folder already holds one.",
    )
    parser.add_argument("path", nargs="?", default=DEFAULT_PATH, help=f"folder to build it in [{DEFAULT_PATH}]")
    args = parser.parse_args(argv)
    try:
        print(ensure_tiny_model(os.path.abspath(os.path.expanduser(args.path))))
    except ImportError as exc:
        print(
            f"motorctl tiny-model: {exc.name or exc} is not installed: building the model needs torch, transformers "
            "and tokenizers (vLLM's CPU set: bash scripts/setup-venv.sh)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
