"""A tiny, randomly initialised language model, written as a GGUF file for llama.cpp.

No weights can be downloaded here, and a test must still see a real decoder
make real tokens: this writes a two-layer Llama (64-wide, a few hundred
tokens of vocabulary: every printable ASCII character, and the 256 byte
tokens, so that any text can be spelt) with random weights, a chat template
and a SentencePiece-style tokenizer. What it says is noise; that it says it
one sampled token at a time, under a grammar when asked, is the point.
"""

from __future__ import annotations

import string
from pathlib import Path

import gguf
import numpy as np

EMBEDDING = 64
LAYERS = 2
HEADS = 4
FEED_FORWARD = 128
CONTEXT = 1024
TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types): control tokens, printable characters (space as SentencePiece's U+2581), bytes."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    for character in string.printable:
        if character in "\t\n\r\x0b\x0c":
            continue
        tokens.append("\u2581" if character == " " else character)
        types.append(gguf.TokenType.NORMAL)
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(gguf.TokenType.BYTE)
    scores = [0.0 if kind != gguf.TokenType.NORMAL else -float(index) for index, kind in enumerate(types)]
    return tokens, scores, [int(kind) for kind in types]


def write_tiny_model(path: Path, seed: int = 7) -> Path:
    """Write the model to ``path`` (a .gguf file, readable by any user: a model server runs as nobody)."""
    tokens, scores, types = vocabulary()
    generator = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:  # type: ignore[type-arg]
        return (generator.standard_normal(shape) * 0.5).astype(np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("forkyard-tiny-random")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(EMBEDDING)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FEED_FORWARD)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(EMBEDDING // HEADS)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(TEMPLATE)
    vocabulary_size = len(tokens)
    # numpy shapes are ggml's dimensions reversed: a (rows, columns) matrix here is ne = [columns, rows].
    writer.add_tensor("token_embd.weight", weights(vocabulary_size, EMBEDDING))
    writer.add_tensor("output_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
    writer.add_tensor("output.weight", weights(vocabulary_size, EMBEDDING))
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{block}.{name}.weight", weights(EMBEDDING, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(EMBEDDING, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", weights(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_up.weight", weights(FEED_FORWARD, EMBEDDING))
        writer.add_tensor(f"{block}.ffn_down.weight", weights(EMBEDDING, FEED_FORWARD))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.chmod(0o644)
    return path
