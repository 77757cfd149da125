"""Videos reach SGLang (verl #7802: its SGLang path dropped video silently), end to end on a
tiny random Qwen2-VL that SGLang's CPU engine runs here; images, which SGLang 0.5.23 drops
without a word when the prompt is token ids, are refused by name instead.

The engine starts from the model's directory, gets a whole version of its weights through the
channel (the loader checks each against the checkpoint's names and shapes), and samples with a
video or another one: the same seed with another video gives other logprobs (the video reached
the model), the same video gives the same sample. What the engine cannot honour is refused
naming the field; what SGLang itself drops is caught (test_engine_catches...).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from dataclasses import replace
from functools import partial

import anyio
import numpy as np
import pytest
import torch

from tests.engines.sglang import tiny_vl
from tests.engines.sglang.conftest import TRANSFER, spec
from timeshare.engines.base import RolloutRequest, SamplingParams
from timeshare.engines.digest import weights_digest
from timeshare.engines.model_config import ModelConfig
from timeshare.engines.sglang.engine import SglangRollout
from timeshare.errors import UnsupportedInput
from timeshare.protocols.weights import WeightSender
from timeshare.protocols.weights.segments import SHM_DIR as SHM

pytestmark = pytest.mark.slow
SAMPLING = SamplingParams(max_tokens=5, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def vl_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangRollout]:
    """SGLang serving the tiny Qwen2-VL, a whole version of its own weights loaded."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    shm_before = set(os.listdir(SHM))  # (make test runs the SGLang tests one at a time)
    root = tmp_path_factory.mktemp("sglang-vl")
    model_dir = tiny_vl.build(root / "model")
    runtime_dir = root / "run"
    runtime_dir.mkdir()
    settings = spec(model_dir=str(model_dir), context_length=512, max_total_tokens=2048)
    engine = SglangRollout(0, settings, ModelConfig(), 120.0, runtime_dir)
    try:
        weights = sorted(load_file(model_dir / "model.safetensors").items())
        endpoint = f"ipc://{runtime_dir}/w-rank0.sock"
        inlet = engine.open_inlet(endpoint, TRANSFER)
        sender = WeightSender(endpoint, TRANSFER)
        try:
            sending = threading.Thread(
                target=anyio.run, args=(partial(sender.send, weights, version=1),)
            )
            sending.start()
            engine.begin_weight_update()
            inlet.receive(lambda: None)
            sending.join(timeout=60)
        finally:
            sender.close()
        assert engine.digest() == weights_digest(weights)
        engine.tokenizer = AutoTokenizer.from_pretrained(model_dir)  # type: ignore[attr-defined]
        yield engine
    finally:
        engine.close()
    # A multimodal model's start leaves a semaphore nobody maps: the engine released it.
    assert sorted(set(os.listdir(SHM)) - shm_before) == []


def request(engine: SglangRollout, media: str, value: object) -> RolloutRequest:
    tokens = tuple(engine.tokenizer(tiny_vl.prompt(media))["input_ids"])  # type: ignore[attr-defined]
    field = {"video": "videos", "image": "images"}[media]
    return RolloutRequest(f"with-{media}", tokens, SAMPLING, **{field: (value,)})  # type: ignore[arg-type]


def frames(seed: int) -> np.ndarray:
    """Eight 56x56 RGB frames (SGLang takes a video as an array of frames, or a file)."""
    return np.random.default_rng(seed).integers(0, 255, (8, 56, 56, 3), dtype=np.uint8)


def picture(seed: int) -> object:
    from PIL import Image

    return Image.fromarray(frames(seed)[0])


def test_a_multimodal_model_declares_videos(vl_engine: SglangRollout) -> None:
    assert vl_engine.traits().inputs == {"videos"}


def test_a_video_reaches_the_model(vl_engine: SglangRollout) -> None:
    [first] = vl_engine.generate([request(vl_engine, "video", frames(1))])
    [again] = vl_engine.generate([request(vl_engine, "video", frames(1))])
    [other] = vl_engine.generate([request(vl_engine, "video", frames(2))])
    assert len(first.tokens) == SAMPLING.max_tokens and first.weight_version == 1
    assert first == again  # seeded: the same video gives the same sample
    # The same seed and prompt with another video: the model saw it (not dropped).
    assert not torch.allclose(torch.tensor(first.logprobs), torch.tensor(other.logprobs))


def test_what_it_cannot_honour_is_refused_by_name(vl_engine: SglangRollout) -> None:
    plain = request(vl_engine, "video", frames(1))
    for refused in (
        request(vl_engine, "image", picture(1)),
        RolloutRequest(
            "with-processor-output",
            plain.prompt_tokens,
            SAMPLING,
            processor_output={"pixel_values_videos": [[0.0]]},
        ),
    ):
        field = next(iter(refused.fields_in_use()))
        with pytest.raises(UnsupportedInput, match=rf"{field} .*{refused.request_id!r}"):
            vl_engine.generate([plain, refused])
    assert len(vl_engine.generate([plain])) == 1


def test_a_medium_sglang_drops_is_caught_naming_the_request(vl_engine: SglangRollout) -> None:
    """An image let through to SGLang (as if declared) comes back unused: caught, not sampled."""
    images = request(vl_engine, "image", picture(1))
    declared = vl_engine.traits
    vl_engine.traits = lambda: replace(declared(), inputs=frozenset({"images", "videos"}))  # type: ignore[method-assign]
    try:
        with pytest.raises(UnsupportedInput, match=r"'with-image' without its images"):
            vl_engine.generate([images])
    finally:
        del vl_engine.traits
    assert len(vl_engine.generate([request(vl_engine, "video", frames(1))])) == 1
