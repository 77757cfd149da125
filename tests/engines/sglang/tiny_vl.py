"""A tiny random Qwen2-VL model directory, made offline: config, weights, tokenizer, image and
video processors. SGLang's CPU engine runs it in seconds, so images and videos can go through
SGLang end to end here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
WORDS = ["user", "assistant", "describe", "the", "image", "video"]
# Words carry their leading space ("▁user"), as in SentencePiece vocabularies: decoding ids
# gives back the prompt's text exactly, as a real tokenizer's does. SGLang's processor decodes
# token-id prompts and finds each image's placeholder in that text; a decoder that put spaces
# between tokens would hide the placeholder from it (and the image would be dropped).
SPACE = "▁"
VOCAB = 64  # what the model's embedding holds (more than the tokenizer's words)
PIXELS = 56 * 56  # the processors' smallest picture: a few patches per frame


def prompt(media: str | None) -> str:
    """A user turn with one image or video placeholder (None: with none), and the assistant's
    turn opened."""
    placeholder = f"<|vision_start|><|{media}_pad|><|vision_end|>" if media else ""
    return (
        f"<|im_start|> user{placeholder} describe the {media or 'image'}"
        "<|im_end|><|im_start|> assistant"
    )


def build(directory: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    directory.mkdir(parents=True, exist_ok=True)
    unknown, end, pad = "[UNK]", "<|im_end|>", "<|endoftext|>"
    spaced = [SPACE + word for word in WORDS]
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *spaced, unknown])}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unknown))
    words.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never")
    words.decoder = decoders.Metaspace(replacement=SPACE, prepend_scheme="never")
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=words,
        unk_token=unknown,
        eos_token=end,
        pad_token=pad,
        model_max_length=1024,
    )
    # Special tokens split out of the text even where no space surrounds them.
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    processor = Qwen2VLProcessor(  # type: ignore[no-untyped-call]
        image_processor=Qwen2VLImageProcessor(min_pixels=PIXELS, max_pixels=2 * PIXELS),
        video_processor=Qwen2VLVideoProcessor(min_pixels=PIXELS, max_pixels=2 * PIXELS),
        tokenizer=tokenizer,
    )
    processor.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    ids = {token: int(tokenizer.convert_tokens_to_ids(token)) for token in SPECIAL_TOKENS}  # type: ignore[arg-type]
    values: dict[str, Any] = dict(
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 1024,
            # head_dim 16: the three M-RoPE sections (time, height, width) sum to half of it
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,  # what the merger hands the language model
            "num_heads": 2,
            "mlp_ratio": 2,
            "in_channels": 3,
            "in_chans": 3,  # SGLang 0.5.23 reads the name transformers 4 had
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config = Qwen2VLConfig(**values)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2VLForConditionalGeneration(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(directory)
    return directory
