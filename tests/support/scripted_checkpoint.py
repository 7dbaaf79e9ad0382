"""A real Qwen3 checkpoint whose weights make it follow a script: after token a it writes token next[a].

Every layer's output projections are zero, so the residual stream at a position is that token's
embedding; each scripted token gets an embedding of its own direction, and the unembedding row of its
successor points the same way, scaled so that the successor wins by a wide margin (greedy and sampled
alike). Tests use it where an answer must contain exact text (a <think> block, a <tool_call>),
through the real engine, stages and router. A token may have only one successor, so a script
never repeats a token.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from qwenserve.default_model import TINY_CONFIG, write_checkpoint
from qwenserve.tokenizer import Tokenizer

MARGIN = 30.0  # the successor's logit over every other token's, before the final norm's scale


def script_ids(tokenizer: Tokenizer, pieces: Sequence[str]) -> list[int]:
    """Token ids of a script written as text pieces (each a tag or plain text)."""
    ids: list[int] = []
    for piece in pieces:
        special = tokenizer.token_to_id(piece)
        ids.extend([special] if special is not None and piece.startswith("<") else tokenizer.encode(piece))
    return ids


def write_scripted_checkpoint(path: Path, chains: Sequence[Sequence[int]]) -> Path:
    """A checkpoint in which each chain's token is followed by the next (chains may share tails)."""
    successor: dict[int, int] = {}
    for chain in chains:
        for a, b in zip(chain, chain[1:], strict=False):
            if successor.setdefault(a, b) != b:
                raise ValueError(f"token {a} cannot be followed by both {successor[a]} and {b}")
    config = {**TINY_CONFIG, "tie_word_embeddings": False, "max_position_embeddings": 1024}
    hidden = config["hidden_size"]
    if len(successor) > hidden:
        raise ValueError(f"a script of {len(successor)} tokens needs hidden_size >= that, not {hidden}")
    write_checkpoint(path, config, seed=11)
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()  # no layer adds anything: the residual is the token's embedding
    tensors["model.norm.weight"].fill_(1.0)
    embed, head = tensors["model.embed_tokens.weight"], tensors["lm_head.weight"]
    head.zero_()
    for k, (a, b) in enumerate(successor.items()):
        direction = torch.zeros(hidden)
        direction[k] = 1.0
        embed[a] = direction
        head[b] += MARGIN * direction
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return path
